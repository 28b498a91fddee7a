"""Ring attention: exact attention over a sequence sharded across devices, on the Mask.

Inside `jax.shard_map`, each of the P devices on `axis_name` holds one shard of the
queries, keys and values. The key/value shards travel round the ring with
`lax.ppermute`, and with each shard go its key-side mask arrays (`Mask.key_side`: the
keys' positions and segment ids), so that at every step the device's mask, bound once
to its local shapes, describes exactly the shard it holds (`Mask.with_key_side`). Each
visiting shard is folded into the device's rows by `attnjax.chunked`'s block-sparse
kernel, and the partial results are combined by their log-sum-exp; after P steps each
device holds the exact attention of its queries over the whole sequence. Nothing larger
than a shard is ever formed.

Skipping. Before each step the mask's own block classifier, with each half of a
shard as one block, says whether any query of this device sees any key of the
visiting shard (for any example and head); a step that sees nothing is skipped
(`lax.cond`). Within a step the kernel skips the invisible blocks itself, so the
zig-zag layout's two chunks per shard need no special case: with chunks a multiple of
the kernel's blocks (256 here), no block straddles two chunks.

The backward pass is a custom VJP that saves only the output and the log-sum-exp
(O(T/P) per device) and runs the ring again: the key/value shards travel with their
gradient accumulators, which arrive home after the last step.

Positions are global. By default they are the layout's: with the contiguous layout
shard i holds positions [i·L, (i + 1)·L); with the zig-zag layout it holds chunks i and
2P − 1 − i of 2P equal chunks, so that under a causal mask every device does the same
work (with contiguous shards device P − 1 does P times device 0's). `zigzag` /
`unzigzag` reorder a sequence into and out of that layout, and `ring_self_attention`
does all of this for global `[B, T, N, H]` arrays on a mesh.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnjax import _checks, chunked, heads, masks
from attnjax.attention import functions_as_of, map_heads
from attnjax.core import MASKED
from attnjax.masks import SKIP, Grid, Mask, Shape, pad_axis
from attnjax.scores import Score, _logits_dtype

LAYOUTS = ("contiguous", "zigzag")


def _shard_positions(index, num_shards: int, length: int, layout: str) -> Int[Array, " L"]:
    """`[L]` int32: the global positions held by shard `index` (an int, or the traced
    axis index) of `num_shards` shards of `length` each."""
    chunks = [index] if layout == "contiguous" else [index, 2 * num_shards - 1 - index]
    size = length // len(chunks)
    # [size]
    offsets = jnp.arange(size, dtype=jnp.int32)
    return jnp.concatenate([chunk * size + offsets for chunk in chunks])


# --------------------------------------------------------------------------------------
# One step: this device's queries against the key/value shard it holds.


def head_major(x: Float[Array, "B S K D"]) -> Float[Array, "B K 1 S D"]:
    """Keys or values `[B, S, K, ·]` as `[B, K, 1, S, ·]`, the layout of the kernel's
    block products: the ring carries them so, one copy per call, not one per step."""
    return jnp.moveaxis(x, 1, 2)[:, :, None]


def _sees(query, key, mask: Mask) -> Bool[Array, ""]:
    """Whether any query of this shard may see any key of the visiting one (head-major
    `[B, K, 1, S, H]`), in any example or head: the mask's block classifier with one
    block per half shard (a zig-zag shard's two chunks lie far apart: one range over
    both would hide the gap)."""

    def shard_class(q, k, v, mask):
        t, s = q.shape[0], k.shape[0]
        grid = Grid(t, s, t // 2 if t % 2 == 0 else t, s // 2 if s % 2 == 0 else s)
        return (jnp.any(mask.classify(mask.blocks(grid)) != SKIP),)

    # [B, S, K, 0]: the keys' sizes, without their values
    sizes = jnp.zeros((key.shape[0], key.shape[3], key.shape[1], 0), query.dtype)
    # [B, K, G]
    (sees,) = map_heads(shard_class, query, sizes, sizes, (mask,), rows_first=(False,))
    return jnp.any(sees)


# The ring's kernel blocks: a block of logits of all heads at once (the ring does not
# split the heads into groups) of 256 × 256 stays in cache and holds half the
# temporaries of 512 × 512; measured ~7% slower on a 2-core CPU (benchmarks/ring.py).
RING_BLOCK = 256


def _block_sizes(t: int, s: int) -> tuple[int | None, int | None]:
    """Kernel blocks that divide each half of a shard where they can, so that no block
    straddles the two chunks of a zig-zag shard (and misses the skipping)."""
    def fit(length):
        size = math.gcd(RING_BLOCK, max(length // 2, 1))
        return size if size >= 64 else None
    return fit(t), fit(s)


def _grouped(query, key, mask: Mask, score: Score):
    """Queries as `[B, T, K, G, H]` and the mask and score laid out per head; key
    head-major `[B, K, 1, S, H]`."""
    b, t, n, h = query.shape
    kv_heads = key.shape[1]
    mask, score = heads.group((mask, score), n, kv_heads)
    return query.reshape(b, t, kv_heads, n // kv_heads, h), mask, score


def _padded_rows(t: int, s: int) -> int:
    """The kernel's query rows, T padded to whole blocks."""
    block_q = chunked.block_sizes(t, s, *_block_sizes(t, s))[0]
    return -(-t // block_q) * block_q


def _heads_first(x, kv_heads: int, t_padded: int):
    """`[B, T, N, ·]` (or `[B, T, N]`) -> heads first `[B, K, G, Tp, ·]`, padded."""
    b, t, n = x.shape[:3]
    x = pad_axis(x.reshape((b, t, kv_heads, n // kv_heads) + x.shape[3:]), t_padded, 1)
    return jnp.moveaxis(x, 1, 3)


def _rows_first(x, t: int):
    """The inverse of `_heads_first`: `[B, K, G, Tp, ·]` -> `[B, T, N, ·]`."""
    b, kv_heads, g = x.shape[:3]
    return jnp.moveaxis(x[:, :, :, :t], 3, 1).reshape((b, t, kv_heads * g) + x.shape[4:])


def _attend_shard(query, key, value, mask: Mask, score: Score):
    """Output `[B, K, G, Tp, V]` and log-sum-exp `[B, K, G, Tp]`, both in the
    accumulation dtype (float32, or float64), of the queries against one key/value
    shard: heads first and padded, as the kernel holds them (no copy per step)."""
    grouped, mask, score = _grouped(query, key, mask, score)
    out, lse = chunked.forward_with_lse(grouped, key, value, mask, score,
                                        _block_sizes(query.shape[1], key.shape[3]),
                                        rows_first=False)
    return out, lse


def _shard_grads(query, key, value, mask: Mask, score: Score, out, lse, d_out):
    """float32 `(d_query [B, K, G, Tp, H], d_key [B, S, K, H], d_value [B, S, K, V])` of
    one key/value shard's share of the rows; out `[B, K, G, Tp, V]`, lse `[B, K, G, Tp]`
    and d_out `[B, K, G, Tp, V]` (heads first, padded) are of the whole rows."""
    grouped, mask, score = _grouped(query, key, mask, score)
    return chunked.backward_with_lse(grouped, key, value, mask, score, out, lse, d_out,
                                     _block_sizes(query.shape[1], key.shape[3]),
                                     rows_first=False)


def visit_shard(query, key, value, mask: Mask, score: Score, out, lse):
    """One ring step: the running output `[B, K, G, Tp, V]` and log-sum-exp
    `[B, K, G, Tp]` (heads first, padded; accumulation dtype) of this device's queries
    `[B, T, N, H]` with the key/value shard it holds folded in, or as they are, without
    running the kernel, when the classifier says no query sees any key of it (a skipped
    step). key and value head-major, `[B, K, 1, S, ·]` (`head_major`); mask bound to the
    shard's positions. Folding inside the branch leaves XLA no step's output to hold."""
    return lax.cond(
        _sees(query, key, mask),
        lambda: _combine(out, lse, *_attend_shard(query, key, value, mask, score)),
        lambda: (out, lse))


def _combine(out, lse, block_out, block_lse):
    """Two partial softmaxes of the same rows as one: each normalised output weighted
    by its share of the rows' total mass. A part that saw nothing has lse = MASKED and
    weight exp(MASKED − total) = 0; a row that saw nothing keeps zeros and an lse at
    MASKED (to rounding), which `chunked.backward_with_lse` reads as nothing seen."""
    # [B, K, G, Tp]: finite, as both parts are
    total = jnp.logaddexp(lse, block_lse)
    mine, theirs = jnp.exp(lse - total), jnp.exp(block_lse - total)
    return out * mine[..., None] + block_out * theirs[..., None], total


# --------------------------------------------------------------------------------------
# The ring, forward and backward.


def _ring_steps(p: int, step_and_pass, carry):
    """`step_and_pass(i, carry)` for the P ring steps: one loop body (one copy of the
    kernel to compile), or, on CPUs, the P steps written out. XLA's CPU runtime runs the
    collectives of a program one after another, but a loop as one operation, whose
    collective-permutes can run alongside the program's collectives outside the loop,
    in whichever order each device reaches them; the devices of a collective must reach
    it together. With the loop, the copy model training on --mesh seq=4 in one process
    waited forever in its first step in 4 of 5 runs whose programs came from jax's
    compilation cache (two devices at a collective-permute, two at an all-gather), and
    two processes on data=2,seq=2 whenever one reached the step seconds after the
    other."""
    if jax.default_backend() == "cpu":
        for i in range(p):
            carry = step_and_pass(i, carry)
        return carry
    return lax.fori_loop(0, p, step_and_pass, carry)


def _ring_forward(query, key, value, mask: Mask, axis_name, score: Score):
    """Output `[B, T, N, V]` in the input dtype, and the output and log-sum-exp heads
    first and padded (`[B, K, G, Tp, V]`, `[B, K, G, Tp]`, in the accumulation dtype:
    `chunked._backward`'s O) for the backward pass."""
    p = lax.axis_size(axis_name)
    b, t, n, _ = query.shape
    kv_heads = key.shape[2]
    acc = _logits_dtype(value.dtype)
    ring = [(i, (i + 1) % p) for i in range(p)]

    def step_and_pass(_, carry):
        key, value, key_side, out, lse = carry
        # the key/value shard held now, with its key-side mask arrays
        out, lse = visit_shard(query, key, value, mask.with_key_side(key_side), score, out,
                               lse)
        key, value, key_side = lax.ppermute((key, value, key_side), axis_name, ring)
        return key, value, key_side, out, lse

    # [B, K, G, Tp, V], [B, K, G, Tp]
    rows = (b, kv_heads, n // kv_heads, _padded_rows(t, key.shape[1]))
    out = jnp.zeros(rows + (value.shape[-1],), acc)
    lse = jnp.full(rows, MASKED, acc)
    # [B, K, 1, S, ·]
    key, value = head_major(key), head_major(value)
    # P steps (`_ring_steps`): the last passing on returns the shards home, unused
    out, lse = _ring_steps(p, step_and_pass, (key, value, mask.key_side(), out, lse))[3:]
    return _rows_first(out.astype(query.dtype), t), out, lse


def _ring_backward(query, key, value, mask: Mask, axis_name, score: Score, out, lse,
                   d_out):
    """float32 (d_query, d_key, d_value); d_key/d_value travel with their shard and
    end at home. out and lse heads first and padded, as `_ring_forward` gives them."""
    p = lax.axis_size(axis_name)
    t = query.shape[1]
    acc = _logits_dtype(value.dtype)
    ring = [(i, (i + 1) % p) for i in range(p)]
    # [B, K, G, Tp, V]
    d_out = _heads_first(d_out, key.shape[2], out.shape[3])

    def accumulate(key, value, key_side, d_key, d_value, d_query):
        """Adds the gradients of this device's rows' share in the shard held now."""
        visiting = mask.with_key_side(key_side)

        def add():
            d_q, d_k, d_v = _shard_grads(query, key, value, visiting, score, out, lse, d_out)
            return d_key + d_k, d_value + d_v, d_query + d_q

        return lax.cond(_sees(query, key, visiting), add, lambda: (d_key, d_value, d_query))

    def step_and_pass(_, carry):
        key, value, key_side, d_key, d_value, d_query = carry
        d_key, d_value, d_query = accumulate(key, value, key_side, d_key, d_value, d_query)
        key, value, key_side, d_key, d_value = lax.ppermute(
            (key, value, key_side, d_key, d_value), axis_name, ring)
        return key, value, key_side, d_key, d_value, d_query

    # [B, S, K, ·], [B, K, G, Tp, H]
    d_key, d_value = (jnp.zeros(x.shape, acc) for x in (key, value))
    d_query = jnp.zeros(out.shape[:4] + query.shape[3:], acc)
    # [B, K, 1, S, ·]
    key, value = head_major(key), head_major(value)
    # after P steps the accumulators have come home with their shards
    d_key, d_value, d_query = _ring_steps(
        p, step_and_pass, (key, value, mask.key_side(), d_key, d_value, d_query))[3:]
    return _rows_first(d_query, t), d_key, d_value


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(query, key, value, mask, traced, axis_name, scale):
    mask = _with_traced(mask, traced)
    return _ring_forward(query, key, value, mask, axis_name, Score(scale))[0]


def _ring_fwd(query, key, value, mask, traced, axis_name, scale):
    out, heads_out, lse = _ring_forward(query, key, value, _with_traced(mask, traced),
                                        axis_name, Score(scale))
    return out, (query, key, value, mask, traced, heads_out, lse)


def _ring_bwd(axis_name, scale, residuals, d_out):
    query, key, value, mask, traced, out, lse = residuals
    d_query, d_key, d_value = _ring_backward(query, key, value, _with_traced(mask, traced),
                                             axis_name, Score(scale), out, lse, d_out)
    # the mask holds integer positions and segment ids, and what its from_fn functions
    # read: no cotangent
    return (d_query.astype(query.dtype), d_key.astype(key.dtype),
            d_value.astype(value.dtype), None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


class _Hoisted:
    """A from_fn function whose closed-over values that an enclosing trace traces are
    `_ring`'s arguments, `traced[start:stop]` (`chunked.hoist_traced`)."""

    def __init__(self, converted, start: int, stop: int):
        self.converted, self.start, self.stop = converted, start, stop

    def __call__(self, *args):
        raise RuntimeError("a ring mask's from_fn called without its traced values")


def _hoisted(mask: Mask) -> tuple[Mask, list]:
    """The mask with each from_fn's closed-over values that an enclosing trace traces
    (a jit's segment ids, say) taken out, and those values: `_ring`'s forward and
    backward passes, traced apart from the caller's trace, then hold none of its
    tracers (a from_fn closing over one failed under grad(jit(...)))."""
    traced = []
    # one example and head, and [1, 1] positions: what a from_fn reads them as
    example = (jnp.int32(0), jnp.int32(0), jnp.zeros((1, 1), jnp.int32),
               jnp.zeros((1, 1), jnp.int32))

    def hoist(fn):
        converted, values = chunked.hoist_traced(fn, *example)
        if not values:   # closing over no tracer: the function as it is
            return fn, ()
        traced.extend(values)
        return _Hoisted(converted, len(traced) - len(values), len(traced)), ()

    return mask.with_functions(hoist), traced


def _with_traced(mask: Mask, traced: list) -> Mask:
    """`_hoisted`'s mask with its from_fn functions given their values back."""
    def give(fn):
        if not isinstance(fn, _Hoisted):
            return fn, ()
        return functools.partial(fn.converted, traced[fn.start:fn.stop]), ()
    return mask.with_functions(give)


# --------------------------------------------------------------------------------------
# Public API.


def ring_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B S K H"],
    value: Float[Array, "B S K V"],
    *,
    axis_name: str,
    mask: Mask | None = None,
    positions: tuple[Int[ArrayLike, "..."], Int[ArrayLike, "..."]] | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
) -> Float[Array, "B T N V"]:
    """Exact attention of this device's query shard over every device's keys and values.

    Call inside `jax.shard_map(..., check_vma=False)` with the sequence axis sharded
    over `axis_name` (the kernels' loop carries and the skipped steps' zeros start
    replicated, which the varying-axes type check would refuse). Every argument is
    this device's shard. score_mod, bias and sinks are not supported here, nor masks
    that read array indices (`masks.lengths`, `masks.from_array`): an index means
    nothing once a key shard has left home.

    Args:
      query: `[B, T, N, H]`, this device's shard of the queries.
      key: `[B, S, K, H]`, this device's shard of the keys; K divides N (grouped-query
        attention when K < N).
      value: `[B, S, K, V]`, this device's shard of the values.
      axis_name: the mesh axis the sequence is sharded over.
      mask: an `attnjax.Mask` built from this device's shards of the per-position
        arrays, e.g. `masks.segments(q_ids, k_ids)` with q_ids `[B, T]` and k_ids
        `[B, S]` (the key ids travel round the ring with the keys), combined with rules
        of positions (`causal`, `window`, `prefix`, `chunked_causal`, `from_fn`).
        Padding is a segment id that no query (or no key) carries.
      positions: `(query_positions, key_positions)`, int `[B, T]` and `[B, S]` (or
        `[T]` and `[S]`): the global positions of this device's queries and keys (the
        key positions travel with the keys). Default: those of `layout`, aligned
        bottom-right as in `attnjax.dot_product_attention`: global query i sits at
        i + P·(S − T).
      is_causal: adds `masks.causal()`: key j visible to query i when its position is
        not after the query's.
      scale: multiplies the logits; default 1/√H.
      layout: which positions each shard holds by default: "contiguous" (shard i holds
        the i-th of P equal parts) or "zigzag" (chunks i and 2P − 1 − i of 2P; see
        `zigzag`), which balances causal work.

    Returns:
      `[B, T, N, V]` in the input dtype: this shard's rows of the attention over the
      whole sequence. A query that sees no key gets zeros, and zero gradients.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec
        >>> from attnjax.parallel import ring_attention
        >>> mesh = Mesh(np.asarray(jax.devices()), ("seq",))
        >>> q = k = v = jnp.ones((1, 8 * len(jax.devices()), 2, 8))       # [B, T, N, H]
        >>> spec = PartitionSpec(None, "seq", None, None)
        >>> attend = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="seq"),
        ...                        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
        >>> attend(q, k, v).shape == q.shape
        True
    """
    _check(query, key, value, layout)
    mask = _ring_mask(mask, is_causal)
    b, t, n, h = query.shape
    s = key.shape[1]
    p = _axis_size(axis_name)
    if positions is None:
        me = lax.axis_index(axis_name)
        positions = (_shard_positions(me, p, t, layout) + p * (s - t),
                     _shard_positions(me, p, s, layout))
    bound, traced = _hoisted(mask.bind(Shape(b, t, s, n), positions, traced=True))
    # [B, T, N, V]
    return _ring(query, key, value, bound, traced, axis_name, _checks.resolve_scale(scale, h))


def _check(query, key, value, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    for name, x, shape in (("query", query, "[B, T, N, H]"), ("key", key, "[B, S, K, H]"),
                           ("value", value, "[B, S, K, V]")):
        _checks.check_rank(name, x, (4,), shape)
        _checks.check_floating(name, x)
    _checks.check_same_dtype(query=query, key=key, value=value)
    varying = sorted(set().union(*(chunked._varying(x) for x in (query, key, value))))
    if varying:
        raise ValueError(f"ring_attention runs inside jax.shard_map(..., check_vma=False); got "
                         f"arrays typed as varying over {varying} (check_vma=True): its skipped "
                         f"steps' zeros and loop carries start replicated")
    shapes = (f"query {_checks.shape_str(query.shape)} [B, T, N, H], key "
              f"{_checks.shape_str(key.shape)} [B, S, K, H], value "
              f"{_checks.shape_str(value.shape)} [B, S, K, V]")
    # as dot_product_attention: an empty axis leaves nothing to attend with
    sizes = dict(zip("BTNH", query.shape)) | dict(zip("SK", key.shape[1:3]))
    if 0 in sizes.values():
        raise ValueError(f"query, key and value must not be empty; got "
                         f"{', '.join(f'{a}=0' for a, size in sizes.items() if size == 0)} in "
                         f"{shapes}")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key and value must agree on B, S and K; got {shapes}")
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        raise ValueError(f"query and key must agree on B and H; got {shapes}")
    if query.shape[2] % key.shape[2]:
        raise ValueError(f"key heads K={key.shape[2]} must divide query heads "
                         f"N={query.shape[2]}; got {shapes}")
    if layout == "zigzag" and (query.shape[1] % 2 or key.shape[1] % 2):
        raise ValueError(f"the zigzag layout splits each shard in two halves; got shard "
                         f"lengths T={query.shape[1]}, S={key.shape[1]}")


def _axis_size(axis_name) -> int:
    """The size of the shard_map axis the sequence is sharded over, which must be bound."""
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of an enclosing "
                         f"jax.shard_map: call ring_attention inside shard_map over a mesh "
                         f"with that axis (or ring_self_attention with the mesh)") from None


def _ring_mask(mask, is_causal: bool) -> Mask:
    """The user's mask (every key when None), checked, with causal added if asked."""
    _checks.check_flag("is_causal", is_causal)
    if mask is None:
        mask = masks.everything()
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be an attnjax.Mask (e.g. masks.segments(q_ids, k_ids) "
                        f"of this device's shards); got {type(mask).__name__}")
    by_index = [part.kind for part in mask.rule.parts() if part.by_index]
    if by_index:
        raise ValueError(
            f"ring_attention cannot use a mask with {' and '.join(by_index)}: it reads "
            f"array indices, which do not follow a key/value shard round the ring; got "
            f"{mask!r}. Express padding with segment ids (masks.segments, with an id that "
            f"no query or no key carries) or with positions")
    return mask & masks.causal() if is_causal else mask


def zigzag(x, num_shards: int, axis: int = 1):
    """Reorders the sequence axis into the causal-balanced zig-zag layout.

    Reorders the sequence axis so that contiguous shard i holds chunks i and
    2P − 1 − i of 2P equal chunks (P = num_shards): the causal-balanced layout.

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax.parallel import zigzag
        >>> zigzag(jnp.arange(8)[None], num_shards=2).tolist()             # chunks 0, 3 | 1, 2
        [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    return _reordered(x, zigzag_order(x.shape[axis], num_shards), axis)


def unzigzag(x, num_shards: int, axis: int = 1):
    """The inverse of `zigzag`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax.parallel import unzigzag, zigzag
        >>> x = jnp.arange(8)[None]
        >>> bool((unzigzag(zigzag(x, 2), 2) == x).all())
        True
    """
    return _reordered(x, np.argsort(zigzag_order(x.shape[axis], num_shards)), axis)


def _reordered(x, order, axis: int):
    """jnp.take(x, order, axis). Split along that axis in its type (a mesh of Explicit
    axes), x keeps its sharding: the reordering moves slices across the devices, which
    jax's own take leaves to the caller there (its ShardingTypeError)."""
    spec = heads.explicit_spec(x)
    if spec is None or len(spec) <= axis % x.ndim or spec[axis % x.ndim] is None:
        return jnp.take(x, order, axis=axis)
    sharding = jax.typeof(x).sharding
    return jax.sharding.auto_axes(lambda x: jnp.take(x, order, axis=axis),
                                  out_sharding=sharding)(x)


def zigzag_order(length: int, num_shards: int) -> np.ndarray:
    """int32 `[length]`: the original index of each slot of the zig-zag layout
    (`zigzag(x)[:, j] = x[:, order[j]]`)."""
    chunks = 2 * num_shards
    if length % chunks:
        raise ValueError(f"the zigzag layout needs a length divisible by 2P={chunks}; got "
                         f"{length}")
    size = length // chunks
    order = [c for i in range(num_shards) for c in (i, chunks - 1 - i)]
    return np.concatenate([np.arange(c * size, (c + 1) * size, dtype=np.int32)
                           for c in order])


def ring_self_attention(
    query: Float[Array, "B T N H"],
    key: Float[Array, "B T K H"],
    value: Float[Array, "B T K V"],
    mesh: Mesh,
    *,
    axis: str = "seq",
    is_causal: bool = False,
    scale: float | None = None,
    batch_axis: str | None = None,
    head_axis: str | None = None,
    mask: Mask | None = None,
    segment_ids: Int[ArrayLike, "B T"] | None = None,
    positions: Int[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T N V"]:
    """Ring attention on global `[B, T, N, H]` arrays, the sequence sharded over `axis`.

    Causal attention (`is_causal`, or a mask holding `masks.causal()`) runs in the
    zig-zag layout (q, k, v, segment ids and positions are reordered here and the
    output back), so every device does the same work; anything else runs contiguous.
    score_mod, bias and sinks are not supported (see `ring_attention`).

    Args:
      query: `[B, T, N, H]`.
      key: `[B, T, K, H]`; K divides N.
      value: `[B, T, K, V]`.
      mesh: a mesh with the axis `axis` (and `batch_axis` / `head_axis` if given).
      axis: the mesh axis the sequence is sharded over; its size P must divide T (2P
        for the zig-zag layout).
      is_causal: key j visible to query i when j's position is not after i's.
      scale: multiplies the logits; default 1/√H.
      batch_axis: a mesh axis to shard B over, or None.
      head_axis: a mesh axis to shard the heads N and K over, or None.
      mask: an `attnjax.Mask` of rules without per-position arrays, used on every
        shard: `causal`, `window`, `chunked_causal`, `prefix(int)`, `from_fn`, and
        their `&` / `|` (from_fn reads global example and head indices: not with
        batch_axis or head_axis sharding them). Segment ids and positions go in
        `segment_ids` / `positions`, which are sharded with the sequence.
      segment_ids: int `[B, T]`: sequence packing, query i sees key j only when they
        carry the same id.
      positions: int `[B, T]`: the positions the mask's rules read; default 0..T−1.

    Returns:
      `[B, T, N, V]` in the input dtype.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import Mesh
        >>> from attnjax.parallel import ring_self_attention
        >>> mesh = Mesh(np.asarray(jax.devices()), ("seq",))
        >>> q = k = v = jnp.ones((1, 8 * len(jax.devices()), 2, 8))       # [B, T, N, H]
        >>> ring_self_attention(q, k, v, mesh, is_causal=True).shape == q.shape
        True
    """
    _checks.check_rank("query", query, (4,), "[B, T, N, H]")
    b, t = query.shape[:2]
    _checks.check_flag("is_causal", is_causal)
    for name, x in (("key", key), ("value", value)):
        _checks.check_rank(name, x, (4,), "[B, T, K, H|V]")
        if x.shape[:2] != (b, t):
            raise ValueError(f"self-attention needs {name} of the query's [B, T] = "
                             f"{_checks.shape_str((b, t))}; got {name} "
                             f"{_checks.shape_str(x.shape)} for query "
                             f"{_checks.shape_str(query.shape)}")
    # on the whole arrays, so that a message names the caller's shapes, not a shard's
    _check(query, key, value, "contiguous")
    for name, given in (("axis", axis), ("batch_axis", batch_axis), ("head_axis", head_axis)):
        if given is not None and given not in mesh.shape:
            raise ValueError(f"{name}={given!r} is not an axis of the mesh; its axes are "
                             f"{tuple(mesh.axis_names)}")
    named = [a for a in (axis, batch_axis, head_axis) if a is not None]
    if len(set(named)) < len(named):
        raise ValueError(f"axis, batch_axis and head_axis must be different mesh axes; got "
                         f"axis={axis!r}, batch_axis={batch_axis!r}, head_axis={head_axis!r}")
    for name, given, sizes in (("batch_axis", batch_axis, {"B": b}),
                               ("head_axis", head_axis, {"N": query.shape[2],
                                                         "K": key.shape[2]})):
        split = mesh.shape[given] if given is not None else 1
        for size_name, size in sizes.items():
            if size % split:
                raise ValueError(f"{name}={given!r} splits {size_name} over its {split} "
                                 f"devices, which needs {size_name} divisible by {split}; got "
                                 f"{size_name}={size}")
    scale = _checks.resolve_scale(scale, query.shape[-1])
    mask = _array_free(mask)
    check_from_fn_unsharded(mask.rule, mesh, batch_axis, head_axis)
    per_position = {}
    for name, x in (("segment_ids", segment_ids), ("positions", positions)):
        if x is not None:
            _checks.check_lengths(name, x, (b, t), "[B, T]")
            per_position[name] = x
    p = mesh.shape[axis]
    causal = is_causal or any(isinstance(part, masks.Causal) for part in mask.rule.parts())
    layout = "zigzag" if causal else "contiguous"
    chunks = 2 * p if layout == "zigzag" else p
    if t % chunks:
        raise ValueError(f"the {layout} layout needs the query length T={t} divisible by "
                         f"{chunks} ({'two chunks on each of ' if layout == 'zigzag' else ''}"
                         f"the P={p} devices of mesh axis {axis!r})")

    # Called eagerly, one compiled program, compiled for what a from_fn computes now (as
    # dot_product_attention's); inside a transformation, traced into the caller's.
    arrays = (query, key, value, per_position, mask)
    eager = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(arrays))
    computed = functions_as_of(query, key, mask, Score()) if eager else None
    static = dict(mesh=mesh, axis=axis, batch_axis=batch_axis, head_axis=head_axis,
                  is_causal=is_causal, scale=scale, layout=layout)
    attend = (functools.partial(_compiled, computed, **static) if computed is not None
              else functools.partial(_sharded, **static))
    attend = functools.partial(attend, mask=mask)
    if layout == "contiguous":
        return attend(query, key, value, per_position)
    query, key, value = (zigzag(x, p) for x in (query, key, value))
    per_position = {name: zigzag(x, p) for name, x in per_position.items()}
    return unzigzag(attend(query, key, value, per_position), p)


def _sharded(query, key, value, per_position, *, mask, mesh, axis, batch_axis, head_axis,
             is_causal, scale, layout):
    """ring_attention on every shard (mask's rules the same on each)."""

    def local(query, key, value, per_position):
        local_mask = mask
        if "segment_ids" in per_position:
            local_mask = local_mask & masks.segments(per_position["segment_ids"])
        local_positions = per_position.get("positions")
        return ring_attention(
            query, key, value, axis_name=axis, mask=local_mask, is_causal=is_causal,
            scale=scale, layout=layout,
            positions=None if local_positions is None else (local_positions,
                                                            local_positions))

    spec = PartitionSpec(batch_axis, axis, head_axis, None)
    rows = {name: PartitionSpec(batch_axis, axis) for name in per_position}
    if jax.sharding.AxisType.Explicit in mesh.axis_types:
        # On a mesh of Explicit axes shard_map takes arrays typed as its specs: arrays
        # split otherwise, or not at all, are split so first (an Auto mesh's are
        # implicitly; jax's in_specs error, before).
        on = lambda x, spec: jax.sharding.reshard(x, NamedSharding(mesh, spec))  # noqa: E731
        query, key, value = (on(x, spec) for x in (query, key, value))
        per_position = {name: on(x, rows[name]) for name, x in per_position.items()}
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, rows),
                         out_specs=spec, check_vma=False)(query, key, value, per_position)


# _sharded as one compiled program (called eagerly, the ring would otherwise run operation
# by operation on every device), for each `computed` (functions_as_of); the mask is an
# argument, its rules' arrays traced.
_compiled = jax.jit(lambda computed, *args, **kwargs: _sharded(*args, **kwargs),
                    static_argnums=0,
                    static_argnames=("mesh", "axis", "batch_axis", "head_axis", "is_causal",
                                     "scale", "layout"))


def check_from_fn_unsharded(rule, mesh: Mesh, batch_axis, head_axis) -> None:
    """A ValueError if the rule holds a from_fn and the batch or the heads are sharded:
    it reads the example and head indices, which are local to a shard then."""
    if any(isinstance(part, masks.FromFn) for part in rule.parts()) and (
            mesh.shape.get(batch_axis, 1) > 1 or mesh.shape.get(head_axis, 1) > 1):
        raise ValueError("from_fn reads the example and head indices, which are local once "
                         f"the batch or the heads are sharded; got a mesh {dict(mesh.shape)} "
                         f"with batch_axis={batch_axis!r}, head_axis={head_axis!r}")


def _array_free(mask) -> Mask:
    """ring_self_attention's mask, refused if it holds per-position arrays (they would
    need sharding and reordering with the sequence)."""
    if mask is None:
        return masks.everything()
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be an attnjax.Mask; got {type(mask).__name__}")
    shapes = [_checks.shape_str(jnp.shape(x)) for x in jax.tree.leaves(mask) if jnp.ndim(x)]
    if shapes:
        raise ValueError(
            f"ring_self_attention's mask may hold only rules without arrays (causal, "
            f"window, chunked_causal, prefix(int), from_fn); got {mask!r} holding arrays "
            f"{', '.join(shapes)}. Pass packed sequences as segment_ids= (global [B, T]) "
            f"and positions as positions=, which are sharded with the sequence")
    return mask
