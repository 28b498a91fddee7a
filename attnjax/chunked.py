"""The chunked kernel: block-sparse online softmax, O(T + S) memory.

The Mask classifies every (query block, key block) pair of every head as SKIP, PARTIAL
or FULL (`attnjax.masks`). Each query block folds in only the key blocks some head can
see — first those every head sees whole, where no mask is evaluated at all, then the
others, where the Mask's `visible` is — with a running max, a running sum and a float32
accumulator (FlashAttention).

The block loops run over all heads at once, and only the arithmetic of one block is
mapped over the batch and the heads (`attnjax.heads`): a loop inside a vmap would have
XLA move every key and value to head-major order first, a copy of the whole key/value
cache at every decoding step. Keys and values stay in their `[B, S, K, ·]` layout and
only the block in hand is rearranged.

What a score_mod declares about itself (`attnjax.scores`) changes only the arithmetic,
never the result: a bounded one (soft_cap) shifts every row by its upper bound instead of
a running maximum, and its division-free near-zero form serves the blocks whose logits
Cauchy–Schwarz bounds within the cap (`_near_table`), each kind of block in a loop of its
own, so no block evaluates both forms.

The custom VJP saves only the output and the log-sum-exp per query and recomputes each
visited block's weights in the backward pass (FlashAttention-2), which takes the key
blocks in turn and visits only the query blocks that can see each. Nothing T×S is
stored, forward or backward (a full `[T, S]` bias or boolean mask is accepted, but is
itself O(T·S)). score_mod is differentiated block by block, and gradients reach the
arrays it closes over (`jax.closure_convert`), the sinks and the bias.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from attnjax import heads
from attnjax.core import FLOOR, MASKED
from attnjax.masks import (FULL, PARTIAL, SKIP, Coords, FromFn, Grid, Mask, pad_axis,
                           slice_block)
from attnjax.options import Options
from attnjax.scores import Score, _logits_dtype, apply_score_mod, split_scale

# Chosen on a 2-core CPU with benchmarks/attention.py: large enough that each block's
# matrix products run near the GEMM rate, small enough that a block of logits for all
# heads stays in cache.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
# The largest block of logits (bytes, over all heads taken at once) the block loops work
# on: more heads are split into groups that take the loops in turn. On a 2-core CPU with
# 2 MiB of L2 per core, 512 × 512 blocks ran at ~75% of the GEMM rate with four heads
# at once and ~57% with eight (benchmarks/attention.py).
LOGITS_BLOCK_BYTES = 4 * 2**20
# A score_mod whose values lie in [lo, hi] (`score_mod.bounds`, e.g. soft_cap(cap): ±cap)
# with hi − lo at most this has every row shifted by hi instead of by its running
# maximum: exp(s − hi) then lies in [e^−64, 1], far from float32's overflow and its
# denormals, and the forward pass takes no row maxima and rescales nothing.
BOUNDED_RANGE = 64.0


@dataclasses.dataclass(frozen=True)
class _Plan(Grid):
    """Static facts of one call: sizes, blocks, dropout, and the part of the scale the
    logits take (`scores.split_scale`; q arrives scaled by the rest)."""

    dropout_rate: float = 0.0
    logit_scale: float = 1.0


def block_sizes(t: int, s: int, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """Blocks no larger than the sequences rounded up to a multiple of 8."""
    def fit(requested, default, length):
        size = default if requested is None else requested
        return min(size, max(8, -(-length // 8) * 8))
    return fit(block_q, DEFAULT_BLOCK_Q, t), fit(block_k, DEFAULT_BLOCK_K, s)


def _kinds(near_split: bool, one_block: bool) -> tuple[tuple[bool, bool], ...]:
    """The kinds of visit, `(masked, near)`, in the order the block loops take them:
    FULL blocks before PARTIAL ones, and with near_split, near-zero blocks (see
    `_near_table`) before the others.

    Where a loop has one block to visit (a row of one column), FULL and PARTIAL are one
    kind, masked. With two loops of at most one step each and a table known only at
    run time (an array mask, segment ids, lengths), XLA's CPU backend ran the products
    of both (profiled): a causal [8, 512, 512] array mask in one 512 block, forward and
    backward, N=8, H=32, took 98 ms against 54 ms for is_causal. A mask that hides
    nothing costs no more as masked (the same 48 ms)."""
    nears = (True, False) if near_split else (False,)
    return tuple((masked, near) for masked in ((True,) if one_block else (False, True))
                 for near in nears)


def _visits(table, near=None, transpose: bool = False):
    """For each row of a `[rows, cols]` block table (and of its `[rows, cols]` near-zero
    table, if any), the columns of each kind of visit (`_kinds`): a pair per kind
    (`[rows, cols]` column lists, in order and then padding; `[rows]` counts). With
    transpose, the rows of each column instead."""
    if transpose:
        table, near = table.T, None if near is None else near.T
    lists = []
    one_block = table.shape[1] == 1
    for masked, close in _kinds(near is not None, one_block):
        hit = (table != SKIP if one_block else
               table == (PARTIAL if masked else FULL))
        if near is not None:
            hit = hit & (near == close)
        order = jnp.argsort(~hit, axis=1, stable=True).astype(jnp.int32)
        lists.append((order, jnp.sum(hit, axis=1, dtype=jnp.int32)))
    return tuple(lists)


def _table(plan: _Plan, mask: Mask, sizes) -> Array:
    """`[nq, nk]` int8 classes of the blocks over every head: FULL where every head sees
    the block whole, SKIP where no head sees any of it. Blocks holding key padding are at
    most PARTIAL, so that the padding is masked."""
    def classify(mask):
        return (mask.classify(mask.blocks(plan)),)

    # [B|1, K|1, G|1, nq, nk]
    per_head = heads.over_heads(classify, sizes, ("heads",), ("heads",))(mask)[0]
    lowest, highest = per_head.min(axis=(0, 1, 2)), per_head.max(axis=(0, 1, 2))
    table = jnp.where(lowest == FULL, FULL, jnp.where(highest == SKIP, SKIP, PARTIAL))
    table = table.astype(jnp.int8)
    if plan.s % plan.block_k:
        table = table.at[:, -1].min(jnp.int8(PARTIAL))
    return table


class _Blocks:
    """Per-block logits and dropout of one head, shared by both passes.

    `mod` is the closure-converted score_mod (or None), called with its hoisted
    `consts`; q arrives pre-scaled (but for the plan's logit_scale).
    """

    def __init__(self, plan, mask, bias, mod, dropout_key):
        self.plan, self.mask, self.bias, self.mod = plan, mask, bias, mod
        self.dropout_key = dropout_key

    def raw(self, q_i, k_j, i, j):
        """q·kᵀ (+ bias) of block (i, j), float32 `[bq, bk]`."""
        p = self.plan
        # [bq, bk]
        s = jnp.einsum("TH,SH->TS", q_i, k_j, preferred_element_type=_logits_dtype(q_i.dtype))
        if p.logit_scale != 1.0:
            s = s * p.logit_scale
        if self.bias is not None:
            s = s + slice_block(self.bias, i * p.block_q, p.block_q, j * p.block_k,
                              p.block_k).astype(s.dtype)
        return s

    def coords(self, i, j):
        p = self.plan
        return self.mask.coords(i * p.block_q, p.block_q, j * p.block_k, p.block_k)

    def modify(self, raw, at, consts):
        if self.mod is None:
            return raw
        return apply_score_mod(self.mod, raw, (at.b, at.n, at.q_pos, at.k_pos, *consts),
                               self.bias is not None, block=True)

    def visible(self, at):
        """`[bq, bk]`: the Mask's answer, keys past S (padding) hidden."""
        visible = self.mask.visible(at)
        if self.plan.s % self.plan.block_k:
            visible = visible & (at.k_idx < self.plan.s)
        return visible

    def unseen_hidden(self, q_i, k_j, v_j, i, j, masked: bool):
        """(coordinates, `[bq, bk]` visibility or None where the block is unmasked, and
        the q, k, v blocks with every row and column that sees nothing zeroed: a NaN or
        inf in padding is selected away, never multiplied by a zero weight)."""
        at = self.coords(i, j)
        if not masked:
            return at, None, q_i, k_j, v_j
        visible = self.visible(at)
        return (at, visible) + _hide_unseen(visible, q_i, k_j, v_j)

    def keep_scale(self, i, j):
        """Inverted-dropout multipliers of block (i, j): 0 or 1/(1 − rate), float32."""
        p = self.plan
        key = jax.random.fold_in(self.dropout_key, i * p.num_k_blocks + j)
        keep = jax.random.bernoulli(key, 1.0 - p.dropout_rate, (p.block_q, p.block_k))
        return jnp.where(keep, 1.0 / (1.0 - p.dropout_rate), 0.0).astype(jnp.float32)


def _hide_unseen(visible, q_i, k_j, v_j):
    """q rows that see no key of the block, and k, v rows that no query sees, zeroed."""
    rows, cols = _seen(visible)
    return (jnp.where(rows[:, None], q_i, 0), jnp.where(cols[:, None], k_j, 0),
            jnp.where(cols[:, None], v_j, 0))


def _seen(visible):
    """The rows and the columns of `visible` that see something. Behind a barrier: for a
    mask that is a constant of the program (a flax user's closed-over array) in one
    block, XLA would evaluate these reductions at compile time, 5 s for [8, 512, 512]."""
    visible = lax.optimization_barrier(visible)
    return jnp.any(visible, axis=1), jnp.any(visible, axis=0)


def _varying(x) -> frozenset:
    """The manual axes (inside jax.shard_map with check_vma) x varies over."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", None) or ())


def _varying_over(x, axes: frozenset):
    """x varying over `axes` too (inside jax.shard_map with check_vma)."""
    missing = tuple(sorted(axes - _varying(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def _varying_as(tree, *refs):
    """tree's leaves varying over every manual axis any leaf of refs varies over: a
    loop's carry, made of constants, has the type of what its body computes from
    them (inside jax.shard_map with check_vma; elsewhere tree as it is)."""
    axes = frozenset().union(*map(_varying, jax.tree.leaves(refs)))
    return jax.tree.map(lambda x: _varying_over(x, axes), tree) if axes else tree


def _as_primal(cotangent, primal):
    """A cotangent summed over the manual axes its primal does not vary over (a value
    every shard shares gets the sum of their gradients, as autodiff gives it), with the
    primal's sharding."""
    if cotangent is None:
        return None
    missing = tuple(sorted(_varying(cotangent) - _varying(primal)))
    if missing:
        cotangent = lax.psum(cotangent, missing)
    # on a mesh of Explicit axes, sharded as the primal (a bias or sinks given whole,
    # whose gradient the heads' shards computed)
    spec = heads.explicit_spec(primal)
    if spec is not None and jax.typeof(cotangent).sharding.spec != spec:
        cotangent = heads.reshard(cotangent, spec, primal)
    return cotangent


def _sharded_as(tree, ref, axes: int):
    """tree's leaves sharded as ref's first `axes` axes, on a mesh of Explicit axes
    (jax.make_mesh's default under jax.set_mesh), where shardings are part of the
    types: a loop's carry, made of constants, has none, and its body's results those of
    the inputs on the mesh they are computed from (replicated ones too). Elsewhere tree
    as it is."""
    spec = None if ref is None else heads.explicit_spec(ref)
    if spec is None:
        return tree

    def shard(x):
        # (a unit axis where ref's is whole, a broadcast one, is not sharded)
        lead = [entry if x.shape[a] == ref.shape[a] else None
                for a, entry in enumerate(tuple(spec)[:axes])]
        return heads.reshard(x, (*lead, *(None,) * (x.ndim - len(lead))), ref)

    return jax.tree.map(shard, tree)


def _visit(visits, step, init):
    """`step(index, carry, masked, near)` over the listed blocks of each kind (`_kinds`).
    visits: `_visits`' pairs of one row or column."""
    carry = init
    one_block = visits[0][0].shape[-1] == 1
    kinds = _kinds(len(visits) > (1 if one_block else 2), one_block)
    for (masked, near), (listed, count) in zip(kinds, visits, strict=True):
        carry = lax.fori_loop(
            0, count, lambda t, c, m=masked, n=near, b=listed: step(b[t], c, m, n), carry)
    return carry


# The layouts of the one-head block functions' arguments (see attnjax.heads).
_FORWARD_IN = ("heads",) * 7
_BACKWARD_IN = ("heads",) * 11


@dataclasses.dataclass(frozen=True)
class _Facts:
    """What a score_mod declares about itself (attnjax.scores), as the kernel uses it.

    monotone: f, with score_mod = f(score) non-decreasing; an unmasked block's row
      maximum is taken before the modification.
    ceiling: hi of its bounds (lo, hi) when hi − lo ≤ BOUNDED_RANGE; every row is shifted
      by hi (or its sink, if larger) instead of by a running maximum.
    near_zero: (limit, g); blocks whose logits all lie within ±limit use g instead.
    """

    monotone: Callable | None = None
    ceiling: float | None = None
    near_zero: tuple[float, Callable] | None = None


def _facts(score_mod, consts, bias, logits_dtype, value_dtype) -> _Facts:
    if score_mod is None:
        return _Facts()
    lo, hi = getattr(score_mod, "bounds", (-math.inf, math.inf))
    near_zero = getattr(score_mod, "near_zero", None)
    # g is a float32 function of the score alone (nothing closed over to differentiate);
    # the near-zero blocks are found from q and k alone (no bias).
    if consts or bias is not None or jnp.dtype(logits_dtype) != jnp.float32:
        near_zero = None
    # The weights meet v in v's dtype: shifted by hi, a row's largest may be as small as
    # e^−(hi − lo), which must stay a normal number there. float16's smallest is e^−9.7:
    # soft_cap(30)'s rows of ordinary logits, shifted by 30, were all zeros.
    bounded = min(BOUNDED_RANGE, -math.log(float(jnp.finfo(value_dtype).tiny)))
    return _Facts(getattr(score_mod, "monotone", None),
                  float(hi) if hi - lo <= bounded else None, near_zero)


def row_norms(q, k):
    """float32 Euclidean norms of the rows of q `[B, T, K, G, H]` and k `[B, S, K, H]`
    (or head-major `[B, K, 1, S, H]`): `[B, T, K, G]` and `[B, S, K]`, what
    `_near_table` bounds the logits with."""
    def norm(x):
        # As a product: XLA's CPU backend ran jnp.linalg.norm, fused with the block
        # maxima, ten times slower (5 ms per call at T=4096, N=4). HIGHEST: a bf16 or
        # TF32 pass would understate the norms, and the bound must hold.
        x = x.astype(jnp.float32)
        return jnp.sqrt(jnp.einsum("...h,...h->...", x, x, precision=lax.Precision.HIGHEST))

    return norm(q), (jnp.moveaxis(norm(k)[:, :, 0], 1, 2) if k.ndim == 5 else norm(k))


def _near_table(plan: _Plan, norms, scale: float, limit: float) -> Array:
    """`[nq, nk]` bool: the blocks whose logits of every head lie within ±limit, by
    Cauchy–Schwarz, |scale·q·k| ≤ |scale|·|q|·|k| (norms: `row_norms` of the unscaled q
    and of k, unpadded), with a margin for rounding. NaN and inf are never near."""
    def block_max(norms, length, block):
        # [B, L, ...] -> [B, L / block, ...], padding rows at norm 0
        return pad_axis(norms, length, 1).reshape(
            (norms.shape[0], -1, block) + norms.shape[2:]).max(axis=2)

    q_norms, k_norms = norms
    # [B, nq, K, G], [B, nk, K]
    q_max = block_max(q_norms, plan.padded_t, plan.block_q) * abs(scale)
    k_max = block_max(k_norms, plan.padded_s, plan.block_k)
    bound = jnp.max(q_max[:, :, None] * k_max[:, None, :, :, None], axis=(0, 3, 4))
    return bound <= limit * (1 - 1e-5)


def _near(plan: _Plan, facts: _Facts, q, k, scale, norms=None):
    """The `_near_table` of a call whose score_mod has a near-zero form, else None. q
    and k as `row_norms` takes them (unscaled), unless their norms are given."""
    if facts.near_zero is None:
        return None
    return _near_table(plan, row_norms(q, k) if norms is None else norms, scale,
                       facts.near_zero[0])


def _masked(s, visible):
    return s if visible is None else jnp.where(visible, s, MASKED)


def _forward_step(plan, mod, facts: _Facts, consts, i, j, masked: bool, near: bool):
    """Block (i, j) folded into one head's running (max, sum, accumulator); with a
    ceiling the max is that fixed shift and never changes. near: the block's logits lie
    within facts.near_zero's limit."""

    def step(q_i, k_j, v_j, carry, mask, bias, dropout_key):
        blocks = _Blocks(plan, mask, bias, mod, dropout_key)
        at, visible, q_i, k_j, v_j = blocks.unseen_hidden(q_i, k_j, v_j, i, j, masked)
        # [bq, bk]
        raw = blocks.raw(q_i, k_j, i, j)
        row_max, row_sum, acc = carry
        s = facts.near_zero[1](raw) if near else blocks.modify(raw, at, consts)
        s = _masked(s, visible)
        if facts.ceiling is not None:
            new_max = row_max
        elif facts.monotone is not None and not masked:
            # A score_mod that is a non-decreasing function of the score alone has its
            # row maximum at the raw maximum: no pass over the modified logits for it.
            new_max = jnp.maximum(row_max, facts.monotone(jnp.max(raw, axis=-1)))
        else:
            new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))
        p = jnp.exp(s - new_max[:, None])
        if facts.ceiling is None:
            correction = jnp.exp(row_max - new_max)
            row_sum, acc = row_sum * correction, acc * correction[:, None]
        row_sum = row_sum + jnp.sum(p, axis=-1)
        if plan.dropout_rate > 0.0:
            p = p * blocks.keep_scale(i, j)
        # [bq, V]: with v in float32 (16-bit values are exact there) rather than the
        # weights rounded to 16 bits, so that O is P v, as the backward pass's rowsum(dO ∘
        # O) must be: with weights of 8 bits, where keys share a large part (d_q = Σ ds·k
        # cancels it), chunked's bfloat16 d_q had 10 times jax.nn's error.
        pv = jnp.einsum("TS,SV->TV", p, v_j.astype(acc.dtype), preferred_element_type=acc.dtype)
        return ((new_max, row_sum, acc + pv),)

    return step


def _forward(plan, mod, q, k, v, mask, bias, sinks, consts, dropout_key, rows,
             facts: _Facts = _Facts()):
    """Output `[B, K, G, Tp, V]` in the accumulation dtype (float32, or float64),
    log-sum-exp `[B, K, G, Tp]` (MASKED for rows that see nothing) and its parts
    (`_backward`'s `lse_parts`). q `[B, K, G, Tp, H]` (heads first, pre-scaled), k and v
    `[B, Sp, K, ·]` (or already head-major, `[B, K, 1, Sp, ·]`)."""
    sizes = q.shape[:3]
    acc_dtype = _logits_dtype(v.dtype)
    # The block products want keys and values head-major, [B, K, 1, ·, ·] ("heads"
    # layout, shared by the G heads of a group). Every key block is read once per query
    # block: with several query blocks, reorder the whole K/V once; with one (a decoding
    # step) reorder each block as it is read, so no copy of the whole cache is kept.
    head_major = lambda x: jnp.moveaxis(x, 1, 2)[:, :, None]  # noqa: E731
    if plan.num_q_blocks > 1 or k.ndim == 5:
        if k.ndim == 4:
            k, v = head_major(k), head_major(v)
        key_block = lambda x, j: lax.dynamic_slice_in_dim(  # noqa: E731
            x, j * plan.block_k, plan.block_k, axis=3)
    else:
        key_block = lambda x, j: head_major(lax.dynamic_slice_in_dim(  # noqa: E731
            x, j * plan.block_k, plan.block_k, axis=1))

    def query_block(xs):
        i, *visits = xs
        # [B, K, G, bq, H]
        q_i = lax.dynamic_slice_in_dim(q, i * plan.block_q, plan.block_q, axis=3)

        def step(j, carry, masked, near):
            # [B, K, 1, bk, H], [B, K, 1, bk, V]
            k_j, v_j = key_block(k, j), key_block(v, j)
            fold = heads.over_heads(
                _forward_step(plan, mod, facts, consts, i, j, masked, near), sizes,
                _FORWARD_IN, ("heads",))
            return fold(q_i, k_j, v_j, carry, mask, bias, dropout_key)[0]

        # A sink starts every row's sum at exp(sink − max); without one, the max starts
        # at FLOOR (or the ceiling), so masked logits (MASKED) contribute exactly 0.
        rows_shape = sizes + (plan.block_q,)
        start = FLOOR if sinks is None else sinks.astype(acc_dtype)[..., None]
        # (at least FLOOR: a sink of -inf, a head without one, must not start it at -inf)
        row_max = jnp.maximum(start, FLOOR if facts.ceiling is None else facts.ceiling)
        row_max = jnp.broadcast_to(jnp.asarray(row_max, acc_dtype), rows_shape)
        init = (
            row_max,
            (jnp.zeros(rows_shape, acc_dtype) if sinks is None
             else jnp.exp(jnp.broadcast_to(start, rows_shape) - row_max)),
            jnp.zeros(rows_shape + (v.shape[-1],), acc_dtype),
        )
        init = _varying_as(_sharded_as(init, q_i, 3), q_i, k, v, mask, bias, sinks, consts,
                           dropout_key)
        # [B, K, G, bq], [B, K, G, bq], [B, K, G, bq, V]
        row_max, row_sum, acc = _visit(visits, step, init)
        if sinks is not None and facts.ceiling is not None:
            # Shifted by a ceiling far above it, a sink adds exp(sink − ceiling) = 0 to
            # the sum: a row that saw no key then still has its sink (its weight 1, its
            # log-sum-exp the sink), as a running maximum would have kept it.
            sink = jnp.broadcast_to(start, rows_shape)
            alone = (row_sum == 0) & (sink > FLOOR)
            row_max, row_sum = jnp.where(alone, sink, row_max), jnp.where(alone, 1.0, row_sum)
        seen = row_sum > 0
        safe_sum = jnp.where(seen, row_sum, 1.0)
        out = acc / safe_sum[..., None]
        # the log-sum-exp in its two parts, the shift and the log of the shifted sum
        # (zeros for a row that saw nothing)
        shift, log_sum = jnp.where(seen, row_max, 0.0), jnp.log(safe_sum)
        lse = jnp.where(seen, shift + log_sum, MASKED)
        return out, lse, (shift, log_sum)

    xs = (jnp.arange(plan.num_q_blocks, dtype=jnp.int32),) + tuple(rows)
    # [nq, B, K, G, bq, V], [nq, B, K, G, bq]
    out, lse, parts = lax.map(query_block, xs)
    out = jnp.moveaxis(out, 0, 3).reshape(sizes + (plan.padded_t, v.shape[-1]))
    rows_of = lambda x: jnp.moveaxis(x, 0, 3).reshape(sizes + (plan.padded_t,))  # noqa: E731
    return out, rows_of(lse), tuple(map(rows_of, parts))


def _backward_step(plan, mod, facts: _Facts, consts, i, j, masked: bool, near: bool,
                   with_ds: bool, upcast: bool = False):
    """One head's gradient contributions of block (i, j): to its queries, the key and
    value block, the block's logits (for the bias) and score_mod's closed-over arrays.
    upcast: d_k's and d_v's products take their (half-precision) operands in the
    accumulator's dtype, the same products (see _upcast_key_value_products)."""

    def step(q_i, q_t, do_i, do_t, lse_parts_i, delta_i, k_j, v_j, mask, bias, dropout_key):
        shift_i, log_sum_i = lse_parts_i
        # q_t `[H, bq]` and do_t `[V, bq]` are q_i and do_i transposed (in memory, not
        # as a view): d_kᵀ = q_iᵀ ds and d_vᵀ = do_iᵀ p are then row-major products,
        # which XLA's CPU backend runs ~4× faster than a product contracting the
        # leading axis of ds and p.
        blocks = _Blocks(plan, mask, bias, mod, dropout_key)
        acc_dtype = delta_i.dtype
        at, visible, q_i, k_j, v_j = blocks.unseen_hidden(q_i, k_j, v_j, i, j, masked)
        if masked:
            q_t = jnp.where(_seen(visible)[0][None, :], q_t, 0)
        raw = blocks.raw(q_i, k_j, i, j)
        if near:
            s, back = jax.vjp(facts.near_zero[1], raw)
            modify_vjp = lambda ds: (back(ds)[0], [])  # noqa: E731
        elif mod is None:
            s, modify_vjp = raw, lambda ds: (ds, None)  # noqa: E731
        else:
            s, modify_vjp = jax.vjp(lambda r, c: blocks.modify(r, at, c), raw, consts)
        s = _masked(s, visible)
        # [bq, bk]: the forward weights, exactly, from the saved log-sum-exp's parts: the
        # shift first, which leaves the logits' difference from it exact, then the log of
        # the sum (their sum, at logits of 1e7, would round the log of the sum away).
        p = jnp.exp((s - shift_i[:, None]) - log_sum_i[:, None])
        dp = jnp.einsum("TV,SV->TS", do_i, v_j, preferred_element_type=acc_dtype)
        p_used = p
        if plan.dropout_rate > 0.0:
            keep = blocks.keep_scale(i, j)
            p_used, dp = p * keep, dp * keep
        # [V, bk]
        wide = (lambda x: x.astype(acc_dtype)) if upcast else (lambda x: x)  # noqa: E731
        d_v = jnp.einsum("VT,TS->VS", wide(do_t), wide(p_used.astype(v_j.dtype)),
                         preferred_element_type=acc_dtype)
        # [bq, bk]: the gradient of the (modified) logits; zero where masked, as p is.
        ds, d_consts = modify_vjp(p * (dp - delta_i[:, None]))
        # q·kᵀ's own gradient (the bias's is ds)
        ds_qk = ds if plan.logit_scale == 1.0 else ds * plan.logit_scale
        if q_i.dtype != acc_dtype:
            # ds's products take float32 operands (16-bit values are exact in float32):
            # in float16, ds grows with dO·vᵀ (|dO|·|v|·V) past 65504 where every input,
            # output and gradient fits; in bfloat16, d_q = Σ ds·k cancels where the keys
            # a row weighs are alike (its ds sums to 0), and ds rounded to 8 bits left
            # d_q 25% off (jax.nn: exact).
            ds_in, q_t, k_j = ds_qk, q_t.astype(acc_dtype), k_j.astype(acc_dtype)
        else:
            ds_in = ds_qk
        # [H, bk]
        d_k = jnp.einsum("HT,TS->HS", wide(q_t), wide(ds_in), preferred_element_type=acc_dtype)
        d_q = jnp.einsum("TS,SH->TH", ds_in, k_j, preferred_element_type=acc_dtype)
        return d_q, d_k, d_v, ds if with_ds else None, d_consts

    return step


def _backward(plan, mod, q, k, v, mask, bias, sinks, consts, dropout_key, cols, out,
              lse_parts, d_out, d_lse, facts: _Facts = _Facts()):
    """Gradients of the (pre-scaled, padded) q, k, v, the bias, the sinks and score_mod's
    closed-over arrays, recomputing each visited block's weights. q, out and d_out are
    heads first `[B, K, G, Tp, ·]`, d_lse `[B, K, G, Tp]`, and lse_parts the log-sum-exp
    as (shift, log of the shifted sum), each `[B, K, G, Tp]`, zeros for a row that saw
    nothing (`_forward`'s, or `_lse_parts` of a log-sum-exp)."""
    sizes = q.shape[:3]
    acc_dtype = _logits_dtype(v.dtype)
    # [B, K, G, Tp]: rowsum(dO ∘ O) = rowsum(dP ∘ P), also under dropout; minus the lse's
    # cotangent. (O as accumulated: rounded to 16 bits, it no longer equals P v, and in a
    # row whose weights are sharp the difference, times |k|, outweighed d_q itself.)
    delta = jnp.sum(d_out.astype(acc_dtype) * out.astype(acc_dtype), axis=-1)
    if d_lse is not None:
        delta = delta - d_lse.astype(acc_dtype)
    # Rows that saw nothing: exp(MASKED − 0 − 0) = 0 recomputes their (zero) weights.
    lse_parts = tuple(x.astype(acc_dtype) for x in lse_parts)
    differentiable = [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts]
    # [B, K, G, H, Tp], [B, K, G, V, Tp]: copied transposed once, here, outside the
    # loops, so that XLA cannot fold the transposes back into the block products.
    q_t, d_out_t = (jnp.swapaxes(x, -1, -2) for x in (q, d_out))

    def key_block(carry, xs):
        j, *visits = xs
        # [B, K, 1, bk, H], [B, K, 1, bk, V]: the block in head-major order once per key
        # block ("heads" layout, shared by the G heads of a group), not once per visit.
        if k.ndim == 5:   # head-major already
            k_j, v_j = (lax.dynamic_slice_in_dim(x, j * plan.block_k, plan.block_k, axis=3)
                        for x in (k, v))
        else:
            k_j, v_j = (jnp.moveaxis(lax.dynamic_slice_in_dim(
                x, j * plan.block_k, plan.block_k, axis=1), 1, 2)[:, :, None] for x in (k, v))

        def step(i, inner, masked, near):
            d_q, d_bias, d_consts, d_k, d_v = inner
            rows = i * plan.block_q
            take = lambda x, axis=3: lax.dynamic_slice_in_dim(  # noqa: E731
                x, rows, plan.block_q, axis=axis)
            grads = heads.over_heads(
                _backward_step(plan, mod, facts, consts, i, j, masked, near,
                               d_bias is not None, _upcast_key_value_products(q.dtype, sizes)),
                sizes,
                _BACKWARD_IN, ("heads",) * 5)
            d_q_i, d_k_j, d_v_j, ds, d_block_consts = grads(
                take(q), take(q_t, 4), take(d_out), take(d_out_t, 4), tuple(map(take, lse_parts)),
                take(delta),
                k_j, v_j, mask, bias, dropout_key)
            d_q = lax.dynamic_update_slice_in_dim(d_q, take(d_q) + d_q_i, rows, axis=3)
            if d_bias is not None:
                d_bias = _add_block(d_bias, ds, rows, j * plan.block_k)
            if mod is not None:
                d_consts = [d + g.sum(axis=(0, 1, 2)) if ok else d
                            for d, g, ok in zip(d_consts, d_block_consts, differentiable)]
            return d_q, d_bias, d_consts, d_k + d_k_j, d_v + d_v_j

        d_q, d_bias, d_consts = carry
        # [B, K, G, ·, bk]: every query head's share of the block's gradients, transposed
        d_k, d_v = _varying_as(_sharded_as(
            (jnp.zeros(sizes + (k.shape[-1], plan.block_k), acc_dtype),
             jnp.zeros(sizes + (v.shape[-1], plan.block_k), acc_dtype)), q, 3), *inputs)
        d_q, d_bias, d_consts, d_k, d_v = _visit(visits, step, (d_q, d_bias, d_consts, d_k, d_v))
        # The G query heads of a group share its keys and values: [B, bk, K, ·]
        d_k, d_v = (jnp.moveaxis(x.sum(axis=2), 3, 1) for x in (d_k, d_v))
        return (d_q, d_bias, d_consts), (d_k, d_v)

    # Inside jax.shard_map the accumulators vary as the inputs do, but score_mod's
    # arrays' gradients as those arrays (each block's is summed over the devices where
    # they are shared: the transpose of their broadcast in score_mod's jaxpr).
    inputs = (q, k, v, d_out, mask, bias, dropout_key)
    init = (_varying_as(_sharded_as(jnp.zeros(q.shape, acc_dtype), q, q.ndim), *inputs),
            None if bias is None else _varying_as(
                _sharded_as(jnp.zeros(bias.shape, acc_dtype), q, 3), *inputs),
            [_varying_as(jnp.zeros(c.shape, c.dtype if ok else acc_dtype), c)
             for c, ok in zip(consts, differentiable)])
    xs = (jnp.arange(plan.num_k_blocks, dtype=jnp.int32),) + tuple(cols)
    # d_k, d_v: [nk, B, bk, K, ·]
    (d_q, d_bias, d_consts), (d_k, d_v) = lax.scan(key_block, init, xs)
    d_k, d_v = (jnp.moveaxis(x, 0, 1).reshape(x.shape[1:2] + (plan.padded_s,) + x.shape[3:])
                for x in (d_k, d_v))
    d_sinks = None
    if sinks is not None:
        # The sink is a column of every row with a zero value vector: dp = 0 there.
        shift, log_sum = lse_parts
        per_head = -jnp.sum(jnp.exp((sinks.astype(acc_dtype)[..., None] - shift) - log_sum)
                            * delta, axis=-1)
        d_sinks = _sum_to(per_head, sinks.shape)
    d_consts = [d if ok else None for d, ok in zip(d_consts, differentiable)]
    return d_q, d_k, d_v, d_bias, d_sinks, d_consts


def _upcast_key_value_products(dtype, sizes: tuple[int, int, int]) -> bool:
    """Whether the backward pass's products for d_k and d_v take float32 operands: in
    bfloat16 on a CPU, where B, K and G all exceed 1. Those products sum over the
    queries apart for each query head of a group, a product with three batch axes, and
    XLA's CPU runtime has no bfloat16 one with a float32 result (grouped-query training
    in bfloat16 failed: "Unsupported element type for DotThunk::Execute"). bfloat16
    values are exact in float32, and their products too: the same products."""
    return (jax.default_backend() == "cpu" and dtype == jnp.bfloat16
            and all(n > 1 for n in sizes))


def _sum_to(x, shape):
    """x summed over the axes where `shape` has a unit (broadcast) axis."""
    axes = tuple(a for a, (have, want) in enumerate(zip(x.shape, shape)) if want == 1 < have)
    return x.sum(axis=axes, keepdims=True)


def _add_block(total, block, row, col):
    """total[..., row:, col:] += block (`[B, K, G, bq, bk]`), summed over total's unit
    (broadcast) axes."""
    block = _sum_to(block, total.shape)
    row = jnp.int32(0) if total.shape[-2] == 1 else row
    col = jnp.int32(0) if total.shape[-1] == 1 else col
    start = (jnp.int32(0),) * 3 + (row, col)
    current = lax.dynamic_slice(total, start, block.shape)
    return lax.dynamic_update_slice(total, current + block, start)


def _kernel(plan: _Plan, mod, facts: _Facts):
    """The custom-VJP attention of one plan, on padded, heads-first queries: `(out, lse)`."""

    @jax.custom_vjp
    def attend(q, k, v, bias, sinks, consts, mask, dropout_key, rows, cols):
        out, lse, _ = _forward(plan, mod, q, k, v, mask, bias, sinks, consts, dropout_key,
                               rows, facts)
        return out.astype(v.dtype), lse

    def forward(q, k, v, bias, sinks, consts, mask, dropout_key, rows, cols):
        # the output kept for the backward pass as accumulated, not rounded (`_backward`)
        out, lse, parts = _forward(plan, mod, q, k, v, mask, bias, sinks, consts,
                                   dropout_key, rows, facts)
        return (out.astype(v.dtype), lse), (q, k, v, bias, sinks, consts, mask, dropout_key,
                                            cols, out, parts)

    def backward(residuals, cotangents):
        q, k, v, bias, sinks, consts, mask, dropout_key, cols, out, parts = residuals
        d_out, d_lse = cotangents
        # q entered pre-scaled: autodiff of that multiply applies the scale to d_q.
        d_q, d_k, d_v, d_bias, d_sinks, d_consts = _backward(
            plan, mod, q, k, v, mask, bias, sinks, consts, dropout_key, cols, out, parts,
            d_out, d_lse, facts)
        return (_as_primal(d_q.astype(q.dtype), q), _as_primal(d_k.astype(k.dtype), k),
                _as_primal(d_v.astype(v.dtype), v),
                None if bias is None else _as_primal(d_bias.astype(bias.dtype), bias),
                None if sinks is None else _as_primal(d_sinks.astype(sinks.dtype), sinks),
                [None if d is None else _as_primal(d.astype(c.dtype), c)
                 for d, c in zip(d_consts, consts)],
                None, None, None, None)

    attend.defvjp(forward, backward)
    return attend


def _prepare(q, k, v, mask: Mask, score: Score, block_q, block_k, dropout_rate,
             norms=None):
    """The plan, the padded inputs (q scaled and heads first), the block table, the
    converted score_mod, what it declares (`_Facts`) and its near-zero table or None
    (norms: q's and k's `row_norms`, if already taken)."""
    b, t, kv_heads, g, _ = q.shape
    given_q, given_k = q, k
    # keys and values [B, S, K, ·], or head-major [B, K, 1, S, ·] (ring attention)
    seq_axis = 3 if k.ndim == 5 else 1
    s = k.shape[seq_axis]
    q_scale, logit_scale = split_scale(score.scale, q.dtype)
    plan = _Plan(t, s, *block_sizes(t, s, block_q, block_k), dropout_rate, logit_scale)
    mask = mask.padded(plan.padded_t, plan.padded_s)
    table = _table(plan, mask, (b, kv_heads, g))
    # q scaled once, rather than every [bq, bk] block of logits; [B, K, G, Tp, H]
    q = jnp.moveaxis(pad_axis(q * jnp.asarray(q_scale, q.dtype), plan.padded_t, 1), 1, 3)
    k, v = pad_axis(k, plan.padded_s, seq_axis), pad_axis(v, plan.padded_s, seq_axis)
    bias = None if score.bias is None else pad_axis(
        pad_axis(score.bias, plan.padded_t, -2, broadcast=True), plan.padded_s, -1,
        broadcast=True)
    # The traced arrays the user's functions close over become arguments of the custom
    # VJP: score_mod's, so that their gradients can be returned, and every one, integers
    # too, so that none is a tracer of a trace the VJP's passes are not in (a from_fn's
    # ids traced by an enclosing jit, differentiated from outside it).
    # (traced on indices of the types of the mask's: inside jax.shard_map, varying as
    # they vary, so that the jaxpr's operations take what they will be given)
    indices = (_varying_as(jnp.int32(0), mask.example), _varying_as(jnp.int32(0), mask.head),
               _varying_as(jnp.zeros((plan.block_q, 1), jnp.int32), mask.q_positions),
               _varying_as(jnp.zeros((1, plan.block_k), jnp.int32), mask.k_positions))

    def mask_function(fn):
        fn, consts = closure_convert_all(fn, *indices)
        # laid out as a head's arrays, [1, 1, 1, ...]: every head gets them whole
        return fn, [jnp.asarray(c)[None, None, None] for c in consts]

    _check_on_the_whole_grid(t, s, mask, score, indices[:2], q, k, bias)
    mask = mask.with_functions(mask_function)
    mod, consts = None, []
    if score.mod is not None:
        # logits of q and k's type (inside jax.shard_map: varying as they vary)
        logits = _varying_as(jnp.zeros((plan.block_q, plan.block_k), _logits_dtype(q.dtype)),
                             q, k, bias, mask)
        example = (logits, *indices)
        mod, consts = closure_convert_all(score.mod, *example)
    facts = _facts(score.mod, consts, bias, _logits_dtype(q.dtype), v.dtype)
    near = _near(plan, facts, given_q, given_k, score.scale, norms)
    return plan, q, k, v, bias, mask, table, mod, list(consts), facts, near


def _check_on_the_whole_grid(t: int, s: int, mask: Mask, score: Score, heads_of, q, k, bias):
    """The user's functions (from_fn's and score_mod) traced once more, abstractly, on
    the call's whole `[T, S]` grid, as the dense kernel calls them, so that what each
    returns is checked against the call's shapes: on the blocks alone, the transposed
    answer of a square block would pass. heads_of: the example and head indices; q, k,
    bias: what the logits are made of (their types)."""
    if score.mod is None and not mask.functions():
        return
    q_pos = _varying_as(jnp.zeros((t, 1), jnp.int32), mask.q_positions)
    k_pos = _varying_as(jnp.zeros((1, s), jnp.int32), mask.k_positions)
    at = Coords(*heads_of, q_pos, k_pos, q_pos, k_pos)

    def call():
        for fn in mask.functions():
            FromFn(fn).visible(at)
        if score.mod is not None:
            logits = _varying_as(jnp.zeros((t, s), _logits_dtype(q.dtype)), q, k, bias, mask)
            apply_score_mod(score.mod, logits, (at.b, at.n, q_pos, k_pos), bias is not None)

    jax.eval_shape(call)


def closure_convert(fn, *example_args):
    """`jax.closure_convert(fn, *example_args)` traced afresh: jax keeps one conversion
    per function, and a kept one holds what the user's function read when it was first
    traced (a Python number it closes over), which a later trace must read again."""
    return jax.closure_convert(lambda *args: fn(*args), *example_args)


def closure_convert_all(fn, *example_args):
    """`(converted, traced)`: fn traced on example_args, with every value it closes over
    that an enclosing trace traces made an argument, `converted(*args, *traced)`
    (`jax.closure_convert` keeps the integer ones closed over); known arrays stay
    constants of the program."""
    closed, shapes = jax.make_jaxpr(lambda *args: fn(*args), return_shape=True)(
        *example_args)
    out_tree, count = jax.tree.structure(shapes), len(example_args)
    is_traced = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    known = [c for c, t in zip(closed.consts, is_traced) if not t]
    # inside jax.shard_map: the manual axes each example argument varies over, which the
    # jaxpr's operations expect of what they are given
    varying = [_varying(x) for x in jax.tree.leaves(example_args)]

    def converted(*args_and_traced):
        args, traced = args_and_traced[:count], iter(args_and_traced[count:])
        known_ = iter(known)
        consts = [next(traced) if t else next(known_) for t in is_traced]
        leaves = [_varying_over(x, axes) for x, axes in zip(jax.tree.leaves(args), varying)]
        out = jax.core.eval_jaxpr(closed.jaxpr, consts, *leaves)
        return jax.tree.unflatten(out_tree, out)

    return converted, [c for c, t in zip(closed.consts, is_traced) if t]


def hoist_traced(fn, *example_args):
    """`(converted, traced)`: the values fn closes over that an enclosing trace traces
    (found by tracing fn on example_args), and `converted(values, *args)`, fn with
    those replaced by values, traced anew at the shapes of the args it is given
    (`closure_convert_all`'s function holds one trace, at the example's shapes)."""
    closed = jax.make_jaxpr(lambda *args: fn(*args))(*example_args)
    traced = [c for c in closed.consts if isinstance(c, jax.core.Tracer)]
    # (alive as long as fn is: their ids name them)
    ids = [id(c) for c in traced]

    def converted(values, *args):
        closed, shapes = jax.make_jaxpr(lambda *a: fn(*a), return_shape=True)(*args)
        given = dict(zip(ids, values))
        consts = [given.get(id(c), c) for c in closed.consts]
        out = jax.core.eval_jaxpr(closed.jaxpr, consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return converted, traced


def _rows_first(x, t: int):
    """`[B, K, G, Tp, ...]` -> `[B, T, K, G, ...]`, the padding dropped."""
    return jnp.moveaxis(x[:, :, :, :t], 3, 1)


def attend(
    q: Float[Array, "B T K G H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K V"],
    mask: Mask,
    score: Score,
    options: Options,
) -> tuple[Float[Array, "B T K G V"], Float[Array, "B T K G"], None]:
    """Output and log-sum-exp of every example and head in blocks: the numbers of
    `attnjax.dense.attend` (which alone returns weights). mask, score and options are
    bound and grouped per head (`attnjax.heads.group`).

    The heads go through the block loops in groups small enough that a block of logits
    of every head of a group stays in cache (`LOGITS_BLOCK_BYTES`)."""
    b, t, kv_heads, g, _ = q.shape
    block_q, block_k = block_sizes(t, k.shape[1], options.block_q, options.block_k)
    per_head = b * block_q * block_k * jnp.dtype(_logits_dtype(q.dtype)).itemsize
    # Split the key/value heads K when there are several (each group keeps its G query
    # heads), else the query heads G of the one key/value head.
    axis, size = (2, kv_heads) if kv_heads > 1 else (3, g)
    heads_per_pass = per_head * kv_heads * g // size
    per_pass = max([d for d in range(1, size + 1)
                    if size % d == 0 and d * heads_per_pass <= LOGITS_BLOCK_BYTES] or [1])
    spec = heads.explicit_spec(q)
    if spec is not None and len(spec) > axis and spec[axis] is not None:
        # heads sharded in their type (a mesh of Explicit axes): one pass, as groups
        # would slice across the devices' shards
        per_pass = size
    if per_pass == size:
        return _attend(q, k, v, mask, score, options)
    groups = size // per_pass

    # Per-head arrays are [B|1, K|1, G|1, ...]: sliced where the axis is whole, shared
    # where it is a unit axis. Each group slices its heads out of the arrays as they
    # are: splitting them into groups up front would copy q, k and v whole.
    meta_axis = axis - 1
    meta = (mask, score, options)
    whole = jax.tree.map(lambda x: x.shape[meta_axis] == size, meta)
    # The row norms a near-zero form needs, of all heads in one pass each: per group,
    # XLA's CPU backend would first copy each group's heads out of q and k.
    norms = row_norms(q, k) if getattr(score.mod, "near_zero", None) else None

    def one_group(index):
        heads_of = lambda x, at: lax.dynamic_slice_in_dim(  # noqa: E731
            x, index * per_pass, per_pass, at)
        k_g, v_g = (k, v) if axis == 3 else (heads_of(k, 2), heads_of(v, 2))
        meta_g = jax.tree.map(lambda x, w: heads_of(x, meta_axis) if w else x, meta, whole)
        norms_g = None if norms is None else (
            heads_of(norms[0], axis), norms[1] if axis == 3 else heads_of(norms[1], 2))
        return _attend(heads_of(q, axis), k_g, v_g, *meta_g, norms_g)[:2]

    out, lse = lax.map(one_group, jnp.arange(groups, dtype=jnp.int32))
    # [groups, B, T, ..., per_pass, ...] -> [B, T, K, G, ·]
    merge = lambda x: jnp.moveaxis(x, 0, axis).reshape(  # noqa: E731
        x.shape[1:axis + 1] + (size,) + x.shape[axis + 2:])
    return merge(out), merge(lse), None


def _attend(q, k, v, mask: Mask, score: Score, options: Options, norms=None):
    """`attend` for the heads of one pass (norms: their `row_norms`, if taken)."""
    plan, q, k, v, bias, mask, table, mod, consts, facts, near = _prepare(
        q, k, v, mask, score, options.block_q, options.block_k, options.dropout_rate, norms)
    out, lse = _kernel(plan, mod, facts)(q, k, v, bias, score.sinks, consts, mask,
                                         options.dropout_key, _visits(table, near),
                                         _visits(table, near, transpose=True))
    return _rows_first(out, plan.t), _rows_first(lse, plan.t), None


def forward_with_lse(q, k, v, mask: Mask, score: Score, block_sizes=(None, None),
                     rows_first: bool = True):
    """Output `[B, T, K, G, V]` and log-sum-exp `[B, T, K, G]`, both in the accumulation
    dtype (float32, or float64), against these keys only (no dropout, no sinks);
    arguments as for `attend`, but k and v may come head-major, `[B, K, 1, S, ·]`, as
    ring attention carries them (no copy of them per call). Not
    differentiable itself: its pair `backward_with_lse` is, given the output and
    log-sum-exp of the whole rows. For ring attention, which folds key/value shards in
    one at a time. rows_first=False: as the kernel holds them, heads first and padded
    to whole blocks, `[B, K, G, Tp, V]` and `[B, K, G, Tp]` (no copy)."""
    plan, q, k, v, bias, mask, table, mod, consts, facts, near = _prepare(
        q, k, v, mask, score, *block_sizes, 0.0)
    rows = _visits(table, near)
    out, lse, _ = _forward(plan, mod, q, k, v, mask, bias, None, consts, None, rows, facts)
    if not rows_first:
        return out, lse
    return _rows_first(out, plan.t), _rows_first(lse, plan.t)


def _lse_parts(lse):
    """A log-sum-exp as `_backward`'s parts: itself as the shift (0 for a row that saw
    nothing, MASKED) and no sum beside it."""
    shift = jnp.where(lse < FLOOR, 0.0, lse)
    return shift, jnp.zeros_like(shift)


def backward_with_lse(q, k, v, mask: Mask, score: Score, out, lse, d_out,
                      block_sizes=(None, None), rows_first: bool = True):
    """float32 `(d_q [B, T, K, G, H], d_k [B, S, K, H], d_v [B, S, K, V])` of these
    keys' share of each row's attention; k and v as `forward_with_lse` takes them.

    out `[B, T, K, G, V]`, lse `[B, T, K, G]` and d_out are of the whole rows (every key
    shard together): this share's weights are exp(logits − lse), so the shares'
    gradients add up to the rows'. rows_first=False: out, lse, d_out and the returned
    d_q as `forward_with_lse(..., rows_first=False)` gives them, heads first and padded.
    """
    plan, q, k, v, bias, mask, table, mod, consts, facts, near = _prepare(
        q, k, v, mask, score, *block_sizes, 0.0)
    # [B, K, G, Tp, ·]
    heads_first = lambda x: x if not rows_first else jnp.moveaxis(  # noqa: E731
        pad_axis(x, plan.padded_t, 1), 1, 3)
    cols = _visits(table, near, transpose=True)
    d_q, d_k, d_v, *_ = _backward(plan, mod, q, k, v, mask, bias, None, consts, None, cols,
                                  heads_first(out), _lse_parts(heads_first(lse)),
                                  heads_first(d_out), None, facts)
    # q entered pre-scaled (by the queries' part of the scale; d_q holds the logits'):
    # the chain rule applies that to d_q
    q_scale, _ = split_scale(score.scale, q.dtype)
    d_q = (_rows_first(d_q, plan.t) if rows_first else d_q) * q_scale
    return d_q, d_k[:, : plan.s], d_v[:, : plan.s]
