"""The chunked kernel: block-sparse online softmax, O(T + S) memory.

One head, like `attnjax.dense`, and vmapped the same way by the batched API. The Mask
classifies every (query block, key block) pair as SKIP, PARTIAL or FULL
(`attnjax.masks`). Each query block folds in only the key blocks it can see — first
the FULL ones, where no mask is evaluated at all, then the PARTIAL ones, where the
Mask's `visible` is — with a running max, a running sum and a float32 accumulator
(FlashAttention).

The custom VJP saves only the output and the log-sum-exp per query and recomputes each
visited block's weights in the backward pass (FlashAttention-2), which takes the key
blocks in turn and visits only the query blocks that can see each. Nothing T×S is
stored, forward or backward (a full `[T, S]` bias or boolean mask is accepted, but is
itself O(T·S)). score_mod is differentiated block by block, and gradients reach the
arrays it closes over (`jax.closure_convert`), the sinks and the bias.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from attnjax.core import FLOOR, MASKED
from attnjax.masks import FULL, PARTIAL, Mask
from attnjax.options import Options
from attnjax.scores import Score, _logits_dtype

# Chosen on a 2-core CPU with benchmarks/attention.py: large enough that each block's
# matrix products run near the GEMM rate, small enough that a block of logits for all
# heads stays in cache.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one call: sizes, blocks, dropout."""

    t: int
    s: int
    block_q: int
    block_k: int
    dropout_rate: float

    @property
    def num_q_blocks(self) -> int:
        return -(-self.t // self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return -(-self.s // self.block_k)

    @property
    def padded_t(self) -> int:
        return self.num_q_blocks * self.block_q

    @property
    def padded_s(self) -> int:
        return self.num_k_blocks * self.block_k


def block_sizes(t: int, s: int, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """Blocks no larger than the sequences rounded up to a multiple of 8."""
    def fit(requested, default, length):
        size = default if requested is None else requested
        return min(size, max(8, -(-length // 8) * 8))
    return fit(block_q, DEFAULT_BLOCK_Q, t), fit(block_k, DEFAULT_BLOCK_K, s)


def _visits(table):
    """For each row of a `[rows, cols]` block table, the FULL and the PARTIAL columns:
    two pairs (`[rows, cols]` column lists, in order and then padding; `[rows]` counts)."""
    lists = []
    for kind in (FULL, PARTIAL):
        hit = table == kind
        order = jnp.argsort(~hit, axis=1, stable=True).astype(jnp.int32)
        lists.append((order, jnp.sum(hit, axis=1, dtype=jnp.int32)))
    return tuple(lists)


def _table(plan: _Plan, mask: Mask):
    """`[nq, nk]` int8 block classes; blocks holding key padding are at most PARTIAL,
    so that the padding is masked."""
    table = mask.classify(mask.blocks(plan.t, plan.s, plan.block_q, plan.block_k))
    if plan.s % plan.block_k:
        table = table.at[:, -1].min(jnp.int8(PARTIAL))
    return table


def _slice_2d(x, row, rows: int, col, cols: int):
    """x[row:row+rows, col:col+cols]; a unit (broadcast) axis is kept whole."""
    if x.shape[0] > 1:
        x = lax.dynamic_slice_in_dim(x, row, rows, 0)
    if x.shape[1] > 1:
        x = lax.dynamic_slice_in_dim(x, col, cols, 1)
    return x


def _pad_axis(x, size: int, axis: int):
    """Zero-pad axis to `size` (a unit axis of a broadcast bias stays as it is)."""
    if x is None or x.shape[axis] in (1, size):
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


class _Blocks:
    """Per-block logits and dropout of one head, shared by both passes.

    `mod` is the closure-converted score_mod (or None), called with its hoisted
    `consts`; q arrives pre-scaled.
    """

    def __init__(self, plan, mask, bias, mod, dropout_key):
        self.plan, self.mask, self.bias, self.mod = plan, mask, bias, mod
        self.dropout_key = dropout_key

    def raw(self, q_i, k_j, i, j):
        """q·kᵀ (+ bias) of block (i, j), float32 `[bq, bk]`."""
        p = self.plan
        # [bq, bk]
        s = jnp.einsum("TH,SH->TS", q_i, k_j, preferred_element_type=_logits_dtype(q_i.dtype))
        if self.bias is not None:
            s = s + _slice_2d(self.bias, i * p.block_q, p.block_q, j * p.block_k,
                              p.block_k).astype(s.dtype)
        return s

    def coords(self, i, j):
        p = self.plan
        return self.mask.coords(i * p.block_q, p.block_q, j * p.block_k, p.block_k)

    def modify(self, raw, at, consts):
        if self.mod is None:
            return raw
        return self.mod(raw, at.b, at.n, at.q_pos, at.k_pos, *consts).astype(raw.dtype)

    def mask_out(self, s, at):
        """MASKED where the pair is not visible (or the key is padding)."""
        visible = self.mask.visible(at)
        if self.plan.s % self.plan.block_k:
            visible = visible & (at.k_idx < self.plan.s)
        return jnp.where(visible, s, MASKED)

    def logits(self, q_i, k_j, i, j, masked: bool, consts):
        at = self.coords(i, j)
        s = self.modify(self.raw(q_i, k_j, i, j), at, consts)
        return self.mask_out(s, at) if masked else s

    def keep_scale(self, i, j):
        """Inverted-dropout multipliers of block (i, j): 0 or 1/(1 − rate), float32."""
        p = self.plan
        key = jax.random.fold_in(self.dropout_key, i * p.num_k_blocks + j)
        keep = jax.random.bernoulli(key, 1.0 - p.dropout_rate, (p.block_q, p.block_k))
        return jnp.where(keep, 1.0 / (1.0 - p.dropout_rate), 0.0).astype(jnp.float32)


def _visit(full, partial, step, init):
    """`step(index, carry, masked)` over the listed FULL blocks (no mask), then the
    PARTIAL ones. full / partial: (block list, count) of one row or column."""
    (full_list, full_count), (partial_list, partial_count) = full, partial
    carry = lax.fori_loop(
        0, full_count, lambda t, c: step(full_list[t], c, masked=False), init)
    return lax.fori_loop(
        0, partial_count, lambda t, c: step(partial_list[t], c, masked=True), carry)


def _forward(plan, q, k, v, blocks, sink, consts, rows):
    """Padded output `[Tq, V]` and log-sum-exp `[Tq]` (MASKED for rows that see nothing)."""
    acc_dtype = _logits_dtype(v.dtype)

    def query_block(xs):
        i, full, partial = xs
        q_i = lax.dynamic_slice_in_dim(q, i * plan.block_q, plan.block_q)

        def step(j, carry, masked):
            row_max, row_sum, acc = carry
            k_j = lax.dynamic_slice_in_dim(k, j * plan.block_k, plan.block_k)
            v_j = lax.dynamic_slice_in_dim(v, j * plan.block_k, plan.block_k)
            # [bq, bk]
            s = blocks.logits(q_i, k_j, i, j, masked, consts)
            new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))
            p = jnp.exp(s - new_max[:, None])
            correction = jnp.exp(row_max - new_max)
            row_sum = row_sum * correction + jnp.sum(p, axis=-1)
            if plan.dropout_rate > 0.0:
                p = p * blocks.keep_scale(i, j)
            # [bq, V]
            pv = jnp.einsum("TS,SV->TV", p.astype(v.dtype), v_j, preferred_element_type=acc_dtype)
            return new_max, row_sum, acc * correction[:, None] + pv

        # A sink starts every row at exp(sink − sink) = 1; without one, the running max
        # starts at FLOOR, so masked logits (MASKED) contribute exactly 0.
        start = FLOOR if sink is None else sink.astype(acc_dtype)
        init = (
            jnp.full((plan.block_q,), start, acc_dtype),
            jnp.full((plan.block_q,), 0.0 if sink is None else 1.0, acc_dtype),
            jnp.zeros((plan.block_q, v.shape[-1]), acc_dtype),
        )
        row_max, row_sum, acc = _visit(full, partial, step, init)
        seen = row_sum > 0
        safe_sum = jnp.where(seen, row_sum, 1.0)
        out = acc / safe_sum[:, None]
        lse = jnp.where(seen, row_max + jnp.log(safe_sum), MASKED)
        return out.astype(v.dtype), lse

    (full_list, full_count), (partial_list, partial_count) = rows
    xs = (jnp.arange(plan.num_q_blocks, dtype=jnp.int32), (full_list, full_count),
          (partial_list, partial_count))
    # [nq, bq, V], [nq, bq]
    out, lse = lax.map(query_block, xs)
    return out.reshape(-1, v.shape[-1]), lse.reshape(-1)


def _backward(plan, q, k, v, blocks, sink, consts, cols, out, lse, d_out, d_lse):
    """Gradients of the (pre-scaled, padded) q, k, v, the bias, the sink and score_mod's
    closed-over arrays, recomputing each visited block's weights."""
    acc_dtype = _logits_dtype(v.dtype)
    # [Tq]: rowsum(dO ∘ O) = rowsum(dP ∘ P), also under dropout; minus the lse's cotangent
    delta = jnp.sum(d_out.astype(acc_dtype) * out.astype(acc_dtype), axis=-1)
    if d_lse is not None:
        delta = delta - d_lse.astype(acc_dtype)
    # Rows that saw nothing: exp(MASKED − 0) = 0 recomputes their (zero) weights.
    lse = jnp.where(lse < FLOOR, 0.0, lse)
    bias = blocks.bias
    differentiable = [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts]

    def key_block(carry, xs):
        j, full, partial = xs
        k_j = lax.dynamic_slice_in_dim(k, j * plan.block_k, plan.block_k)
        v_j = lax.dynamic_slice_in_dim(v, j * plan.block_k, plan.block_k)

        def step(i, inner, masked):
            d_q, d_bias, d_consts, d_k, d_v = inner
            rows = i * plan.block_q
            q_i = lax.dynamic_slice_in_dim(q, rows, plan.block_q)
            do_i = lax.dynamic_slice_in_dim(d_out, rows, plan.block_q)
            at = blocks.coords(i, j)
            raw = blocks.raw(q_i, k_j, i, j)
            if blocks.mod is None:
                s = raw
            else:
                s, mod_vjp = jax.vjp(lambda r, c: blocks.modify(r, at, c), raw, consts)
            if masked:
                s = blocks.mask_out(s, at)
            # [bq, bk]: the forward weights, exactly, from the saved log-sum-exp.
            p = jnp.exp(s - lax.dynamic_slice_in_dim(lse, rows, plan.block_q)[:, None])
            dp = jnp.einsum("TV,SV->TS", do_i, v_j, preferred_element_type=acc_dtype)
            p_used = p
            if plan.dropout_rate > 0.0:
                keep = blocks.keep_scale(i, j)
                p_used, dp = p * keep, dp * keep
            d_v = d_v + jnp.einsum("TS,TV->SV", p_used.astype(v.dtype), do_i,
                                   preferred_element_type=acc_dtype)
            # [bq, bk]: the gradient of the (modified) logits; zero where masked, as p is.
            ds = p * (dp - lax.dynamic_slice_in_dim(delta, rows, plan.block_q)[:, None])
            if blocks.mod is not None:
                ds, d_block_consts = mod_vjp(ds)
                d_consts = [d + g if ok else d for d, g, ok in
                            zip(d_consts, d_block_consts, differentiable)]
            ds_in = ds.astype(q.dtype)
            d_k = d_k + jnp.einsum("TS,TH->SH", ds_in, q_i, preferred_element_type=acc_dtype)
            d_q_i = lax.dynamic_slice_in_dim(d_q, rows, plan.block_q) + jnp.einsum(
                "TS,SH->TH", ds_in, k_j, preferred_element_type=acc_dtype)
            d_q = lax.dynamic_update_slice_in_dim(d_q, d_q_i, rows, 0)
            if d_bias is not None:
                d_bias = _add_block(d_bias, ds, rows, j * plan.block_k)
            return d_q, d_bias, d_consts, d_k, d_v

        d_q, d_bias, d_consts = carry
        init = (d_q, d_bias, d_consts, jnp.zeros(k_j.shape, acc_dtype),
                jnp.zeros(v_j.shape, acc_dtype))
        d_q, d_bias, d_consts, d_k, d_v = _visit(full, partial, step, init)
        return (d_q, d_bias, d_consts), (d_k, d_v)

    init = (jnp.zeros(q.shape, acc_dtype),
            None if bias is None else jnp.zeros(bias.shape, acc_dtype),
            [jnp.zeros(c.shape, c.dtype if ok else acc_dtype)
             for c, ok in zip(consts, differentiable)])
    (full_list, full_count), (partial_list, partial_count) = cols
    xs = (jnp.arange(plan.num_k_blocks, dtype=jnp.int32), (full_list, full_count),
          (partial_list, partial_count))
    (d_q, d_bias, d_consts), (d_k, d_v) = lax.scan(key_block, init, xs)
    d_sink = None
    if sink is not None:
        # The sink is a column of every row with a zero value vector: dp = 0 there.
        d_sink = -jnp.sum(jnp.exp(sink.astype(acc_dtype) - lse) * delta)
    d_consts = [d if ok else None for d, ok in zip(d_consts, differentiable)]
    return d_q, d_k.reshape(k.shape), d_v.reshape(v.shape), d_bias, d_sink, d_consts


def _add_block(total, block, row, col):
    """total[row:, col:] += block, summing the block over total's unit (broadcast) axes."""
    if total.shape[0] == 1:
        block, row = jnp.sum(block, axis=0, keepdims=True), jnp.int32(0)
    if total.shape[1] == 1:
        block, col = jnp.sum(block, axis=1, keepdims=True), jnp.int32(0)
    current = lax.dynamic_slice(total, (row, col), block.shape)
    return lax.dynamic_update_slice(total, current + block, (row, col))


def _kernel(plan: _Plan, mod):
    """The custom-VJP attention of one plan, on block-padded arrays: `(out, lse)`."""

    @jax.custom_vjp
    def attend(q, k, v, bias, sink, consts, mask, dropout_key, rows, cols):
        blocks = _Blocks(plan, mask, bias, mod, dropout_key)
        return _forward(plan, q, k, v, blocks, sink, consts, rows)

    def forward(q, k, v, bias, sink, consts, mask, dropout_key, rows, cols):
        blocks = _Blocks(plan, mask, bias, mod, dropout_key)
        out, lse = _forward(plan, q, k, v, blocks, sink, consts, rows)
        return (out, lse), (q, k, v, bias, sink, consts, mask, dropout_key, cols, out, lse)

    def backward(residuals, cotangents):
        q, k, v, bias, sink, consts, mask, dropout_key, cols, out, lse = residuals
        d_out, d_lse = cotangents
        blocks = _Blocks(plan, mask, bias, mod, dropout_key)
        # q entered pre-scaled: autodiff of that multiply applies the scale to d_q.
        d_q, d_k, d_v, d_bias, d_sink, d_consts = _backward(
            plan, q, k, v, blocks, sink, consts, cols, out, lse, d_out, d_lse)
        return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype),
                None if bias is None else d_bias.astype(bias.dtype),
                None if sink is None else d_sink.astype(sink.dtype),
                [None if d is None else d.astype(c.dtype) for d, c in zip(d_consts, consts)],
                None, None, None, None)

    attend.defvjp(forward, backward)
    return attend


def _prepare(q, k, v, mask: Mask, score: Score, options: Options):
    """The plan, the block-padded inputs, the visit lists and the converted score_mod."""
    t, s = q.shape[0], k.shape[0]
    plan = _Plan(t, s, *block_sizes(t, s, options.block_q, options.block_k),
                 options.dropout_rate)
    mask = mask.padded(plan.padded_t, plan.padded_s)
    table = _table(plan, mask)
    # q scaled once, rather than every [bq, bk] block of logits.
    q = _pad_axis(q * jnp.asarray(score.scale, q.dtype), plan.padded_t, 0)
    k, v = _pad_axis(k, plan.padded_s, 0), _pad_axis(v, plan.padded_s, 0)
    bias = None if score.bias is None else _pad_axis(
        _pad_axis(score.bias, plan.padded_t, 0), plan.padded_s, 1)
    mod, consts = None, []
    if score.mod is not None:
        # Hoist the arrays score_mod closes over into arguments of the custom VJP, so
        # that their gradients can be returned.
        example = (jnp.zeros((plan.block_q, plan.block_k), _logits_dtype(q.dtype)),
                   jnp.int32(0), jnp.int32(0), jnp.zeros((plan.block_q, 1), jnp.int32),
                   jnp.zeros((1, plan.block_k), jnp.int32))
        mod, consts = jax.closure_convert(score.mod, *example)
    return plan, q, k, v, bias, mask, table, mod, list(consts)


def attend(
    q: Float[Array, "T H"],
    k: Float[Array, "S H"],
    v: Float[Array, "S V"],
    mask: Mask,
    score: Score,
    options: Options,
) -> tuple[Float[Array, "T V"], Float[Array, " T"], None]:
    """Output `[T, V]` and log-sum-exp `[T]` of one head in blocks: the numbers of
    `attnjax.dense.attend` (which alone returns weights)."""
    plan, q, k, v, bias, mask, table, mod, consts = _prepare(q, k, v, mask, score, options)
    out, lse = _kernel(plan, mod)(q, k, v, bias, score.sinks, consts, mask,
                                  options.dropout_key, _visits(table), _visits(table.T))
    return out[: plan.t], lse[: plan.t], None


def forward_with_lse(q, k, v, mask: Mask, score: Score):
    """Output `[T, V]` and log-sum-exp `[T]` of one head against these keys only (no
    dropout, no sinks). Not differentiable itself: its pair `backward_with_lse` is,
    given the output and log-sum-exp of the whole row. For ring attention."""
    plan, q, k, v, bias, mask, table, mod, consts = _prepare(q, k, v, mask, score, Options())
    blocks = _Blocks(plan, mask, bias, mod, None)
    out, lse = _forward(plan, q, k, v, blocks, None, consts, _visits(table))
    return out[: plan.t], lse[: plan.t]


def backward_with_lse(q, k, v, mask: Mask, score: Score, out, lse, d_out):
    """float32 `(d_q, d_k, d_v)` of these keys' share of each row's attention.

    out, lse and d_out are of the whole row (every key shard together): this share's
    weights are exp(logits − lse), so the shares' gradients add up to the row's.
    """
    scale = score.scale
    plan, q, k, v, bias, mask, table, mod, consts = _prepare(q, k, v, mask, score, Options())
    blocks = _Blocks(plan, mask, bias, mod, None)
    pad_q = functools.partial(_pad_axis, size=plan.padded_t, axis=0)
    d_q, d_k, d_v, *_ = _backward(plan, q, k, v, blocks, None, consts, _visits(table.T),
                                  pad_q(out), pad_q(lse), pad_q(d_out), None)
    # q entered pre-scaled: the chain rule applies the scale to d_q
    return d_q[: plan.t] * scale, d_k[: plan.s], d_v[: plan.s]
