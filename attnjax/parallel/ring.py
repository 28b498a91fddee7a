"""Ring attention: exact attention over a sequence sharded across devices.

Inside `jax.shard_map`, each of the P devices on `axis_name` holds one shard of the
queries, keys and values. The key/value shards travel round the ring with
`lax.ppermute`; every device folds each visiting shard into its own queries' output with
the online softmax (log-sum-exp combination), so after P steps each device holds the
exact attention of its queries over the whole sequence. Nothing larger than a shard is
ever formed: each (query chunk, key chunk) pair runs `attnjax.chunked`'s blocks.

The backward pass is a custom VJP that saves only the output and the log-sum-exp
(O(T/P) per device) and runs the ring again: the key/value shards travel with their
gradient accumulators, which arrive home after the last step.

Causal attention and balance: with contiguous shards, device i sees i + 1 shards of
keys and device P − 1 does P times device 0's work. The zig-zag layout gives device i
chunks i and 2P − 1 − i of 2P equal chunks, so every device does the same work;
`zigzag` / `unzigzag` reorder a sequence into and out of it, and `ring_self_attention`
does all of this for `[B, T, N, H]` arrays on a mesh.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from attnjax import chunked

LAYOUTS = ("contiguous", "zigzag")
_SKIP, _FULL, _DIAGONAL = 0, 1, 2


def _chunk_ids(index, num_shards: int, layout: str):
    """Global chunk numbers held by shard `index`: one (contiguous) or two (zig-zag)."""
    if layout == "contiguous":
        return [index]
    return [index, 2 * num_shards - 1 - index]


def _case(q_chunk, k_chunk, is_causal: bool):
    """How a query chunk sees a key chunk: whole, causally (the same chunk), or not."""
    if not is_causal:
        return jnp.int32(_FULL)
    return jnp.where(k_chunk < q_chunk, _FULL, jnp.where(k_chunk == q_chunk, _DIAGONAL, _SKIP))


def _per_head(fn, num_args: int):
    """`fn(q, k, v, *rows)` on one head's arrays, mapped over batch, K and G: q and the
    per-row arrays are `[B, L, K, G, ·]`, k and v `[B, L, K, ·]` (shared by G)."""
    over_groups = jax.vmap(fn, in_axes=(1, None, None) + (1,) * (num_args - 3), out_axes=1)
    over_heads = jax.vmap(over_groups, in_axes=1, out_axes=1)
    return jax.vmap(over_heads, in_axes=0, out_axes=0)


def _block_forward(q, k, v, case, scale):
    """Out `[B, C, K, G, V]` (float32) and lse `[B, C, K, G]` of q against one k/v chunk."""

    def run(is_causal):
        def one(q, k, v):
            out, lse = chunked.forward_with_lse(q, k, v, is_causal=is_causal, scale=scale)
            return out.astype(jnp.float32), lse
        return _per_head(one, 3)(q, k, v)

    def skip():
        b, c, kh, g, _ = q.shape
        return (jnp.zeros((b, c, kh, g, v.shape[-1]), jnp.float32),
                jnp.full((b, c, kh, g), -jnp.inf, jnp.float32))

    return lax.switch(case, [skip, lambda: run(False), lambda: run(True)])


def _block_backward(q, k, v, out, lse, d_out, case, scale):
    """float32 (d_q, d_k, d_v) of q's row share against one k/v chunk."""

    def run(is_causal):
        def one(q, k, v, out, lse, d_out):
            return chunked.backward_with_lse(q, k, v, out, lse, d_out, is_causal=is_causal,
                                             scale=scale)
        d_q, d_k, d_v = _per_head(one, 6)(q, k, v, out, lse, d_out)
        # k/v are shared by the G query heads of a group: their gradients add up
        return d_q, d_k.sum(axis=3), d_v.sum(axis=3)

    def skip():
        return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                jnp.zeros(v.shape, jnp.float32))

    return lax.switch(case, [skip, lambda: run(False), lambda: run(True)])


def _combine(out, lse, block_out, block_lse):
    """Online softmax across blocks: the normalised outputs weighted by their mass."""
    # [B, C, K, G]
    total = jnp.logaddexp(lse, block_lse)
    # Rows that have seen nothing stay at −inf: shift by 0 so both weights are 0.
    shift = jnp.where(jnp.isfinite(total), total, 0.0)
    mine, theirs = jnp.exp(lse - shift), jnp.exp(block_lse - shift)
    return out * mine[..., None] + block_out * theirs[..., None], total


def _chunks(x, count: int):
    """x split along its length axis (1) into `count` equal chunks."""
    size = x.shape[1] // count
    return [x[:, i * size:(i + 1) * size] for i in range(count)]


def _ring_forward(q, k, v, axis_name, is_causal, scale, layout):
    """Output `[B, T, K, G, V]` in q's dtype and float32 lse `[B, T, K, G]`."""
    p = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    count = 1 if layout == "contiguous" else 2
    q_chunks, q_ids = _chunks(q, count), _chunk_ids(me, p, layout)
    ring = [(i, (i + 1) % p) for i in range(p)]

    def fold(step, k, v, outs, lses):
        """Folds the k/v shard held at `step` (device me − step's) into every row."""
        k_ids = _chunk_ids((me - step) % p, p, layout)
        outs, lses = list(outs), list(lses)
        for a, q_chunk in enumerate(q_chunks):
            for b, (k_chunk, v_chunk) in enumerate(zip(_chunks(k, count), _chunks(v, count))):
                case = _case(q_ids[a], k_ids[b], is_causal)
                block = _block_forward(q_chunk, k_chunk, v_chunk, case, scale)
                outs[a], lses[a] = _combine(outs[a], lses[a], *block)
        return outs, lses

    def step_and_pass(step, carry):
        k, v, outs, lses = carry
        outs, lses = fold(step, k, v, outs, lses)
        k, v = lax.ppermute((k, v), axis_name, ring)
        return k, v, outs, lses

    # [B, C, K, G, V] and [B, C, K, G] per query chunk
    outs = [jnp.zeros(c.shape[:-1] + v.shape[-1:], jnp.float32) for c in q_chunks]
    lses = [jnp.full(c.shape[:-1], -jnp.inf, jnp.float32) for c in q_chunks]
    k, v, outs, lses = lax.fori_loop(0, p - 1, step_and_pass, (k, v, outs, lses))
    outs, lses = fold(p - 1, k, v, outs, lses)   # the last shard needs no passing on
    out = jnp.concatenate(outs, axis=1).astype(q.dtype)
    return out, jnp.concatenate(lses, axis=1)


def _ring_backward(q, k, v, out, lse, d_out, axis_name, is_causal, scale, layout):
    """float32 (d_q, d_k, d_v); d_k/d_v travel with their shard and end at home."""
    p = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    count = 1 if layout == "contiguous" else 2
    q_ids = _chunk_ids(me, p, layout)
    rows = list(zip(_chunks(q, count), _chunks(out, count), _chunks(lse, count),
                    _chunks(d_out, count)))
    ring = [(i, (i + 1) % p) for i in range(p)]
    size = k.shape[1] // count

    def accumulate(step, k, v, d_k, d_v, d_q):
        """Adds the gradients of the pairs with the k/v shard held at `step`."""
        k_ids = _chunk_ids((me - step) % p, p, layout)
        d_q = list(d_q)
        for a, (q_chunk, out_chunk, lse_chunk, d_out_chunk) in enumerate(rows):
            for b, (k_chunk, v_chunk) in enumerate(zip(_chunks(k, count), _chunks(v, count))):
                case = _case(q_ids[a], k_ids[b], is_causal)
                dq, dk, dv = _block_backward(q_chunk, k_chunk, v_chunk, out_chunk, lse_chunk,
                                             d_out_chunk, case, scale)
                d_q[a] = d_q[a] + dq
                d_k = d_k.at[:, b * size:(b + 1) * size].add(dk)
                d_v = d_v.at[:, b * size:(b + 1) * size].add(dv)
        return d_k, d_v, d_q

    def step_and_pass(step, carry):
        k, v, d_k, d_v, d_q = carry
        d_k, d_v, d_q = accumulate(step, k, v, d_k, d_v, d_q)
        k, v, d_k, d_v = lax.ppermute((k, v, d_k, d_v), axis_name, ring)
        return k, v, d_k, d_v, d_q

    d_q = [jnp.zeros(r[0].shape, jnp.float32) for r in rows]
    d_k, d_v = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    k, v, d_k, d_v, d_q = lax.fori_loop(0, p - 1, step_and_pass, (k, v, d_k, d_v, d_q))
    d_k, d_v, d_q = accumulate(p - 1, k, v, d_k, d_v, d_q)
    # the accumulators take the last hop home; k and v are done
    d_k, d_v = lax.ppermute((d_k, d_v), axis_name, ring)
    return jnp.concatenate(d_q, axis=1), d_k, d_v


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ring(q, k, v, axis_name, is_causal, scale, layout):
    return _ring_forward(q, k, v, axis_name, is_causal, scale, layout)[0]


def _ring_fwd(q, k, v, axis_name, is_causal, scale, layout):
    out, lse = _ring_forward(q, k, v, axis_name, is_causal, scale, layout)
    return out, (q, k, v, out, lse)


def _ring_bwd(axis_name, is_causal, scale, layout, residuals, d_out):
    q, k, v, out, lse = residuals
    d_q, d_k, d_v = _ring_backward(q, k, v, out, lse, d_out, axis_name, is_causal, scale, layout)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(query, key, value, *, axis_name: str, is_causal: bool = False,
                   scale: float | None = None, layout: str = "contiguous"):
    """Exact attention of this device's query shard over every device's keys and values.

    Call inside `jax.shard_map(..., check_vma=False)` with the sequence axis sharded
    over `axis_name` (the chunked kernel's loop carries start replicated, which the
    varying-axes type check would refuse).

    Args:
      query: `[B, T, N, H]`, this device's shard of the queries.
      key: `[B, S, K, H]`, this device's shard of the keys; K divides N (grouped-query
        attention when K < N).
      value: `[B, S, K, V]`.
      axis_name: the mesh axis the sequence is sharded over.
      is_causal: key j visible to query i when j ≤ i (global positions; needs the query
        and key shards to be the same positions, T = S).
      scale: multiplies the logits; default 1/√H.
      layout: which positions each shard holds: "contiguous" (shard i holds the i-th of P
        equal parts) or "zigzag" (chunks i and 2P − 1 − i of 2P; see `zigzag`), which
        balances causal work.

    Returns:
      `[B, T, N, V]`: this shard's rows of the attention over the whole sequence.
    """
    _check(query, key, value, is_causal, layout)
    b, t, n, h = query.shape
    heads = key.shape[2]
    scale = h ** -0.5 if scale is None else scale
    # [B, T, K, G, H]
    q = query.reshape(b, t, heads, n // heads, h)
    out = _ring(q, key, value, axis_name, is_causal, float(scale), layout)
    return out.reshape(b, t, n, value.shape[-1])


def _check(query, key, value, is_causal, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [B, L, heads, dim]; got shape {x.shape}")
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key [B, S, K, H] and value [B, S, K, V] must agree on B, S, K; got "
                         f"key {key.shape}, value {value.shape}")
    if query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        raise ValueError(f"query [B, T, N, H] and key [B, S, K, H] must agree on B and H; got "
                         f"query {query.shape}, key {key.shape}")
    if query.shape[2] % key.shape[2]:
        raise ValueError(f"key heads K={key.shape[2]} must divide query heads "
                         f"N={query.shape[2]}")
    if is_causal and query.shape[1] != key.shape[1]:
        raise ValueError(f"is_causal needs query and key shards of the same positions; got "
                         f"T={query.shape[1]}, S={key.shape[1]}")
    if layout == "zigzag" and (query.shape[1] % 2 or key.shape[1] % 2):
        raise ValueError(f"the zigzag layout splits each shard in two; got shard lengths "
                         f"T={query.shape[1]}, S={key.shape[1]}")


def zigzag(x, num_shards: int, axis: int = 1):
    """Reorders the sequence axis so that contiguous shard i holds chunks i and
    2P − 1 − i of 2P equal chunks (P = num_shards): the causal-balanced layout."""
    return jnp.take(x, _zigzag_order(x.shape[axis], num_shards), axis=axis)


def unzigzag(x, num_shards: int, axis: int = 1):
    """The inverse of `zigzag`."""
    order = _zigzag_order(x.shape[axis], num_shards)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    return jnp.take(x, inverse, axis=axis)


def _zigzag_order(length: int, num_shards: int):
    chunks = 2 * num_shards
    if length % chunks:
        raise ValueError(f"the zigzag layout needs a length divisible by 2P={chunks}; got "
                         f"{length}")
    size = length // chunks
    order = [c for i in range(num_shards) for c in (i, chunks - 1 - i)]
    return jnp.concatenate([jnp.arange(c * size, (c + 1) * size) for c in order])


def ring_self_attention(query, key, value, mesh: Mesh, *, axis: str = "seq",
                        is_causal: bool = False, scale: float | None = None,
                        batch_axis: str | None = None, head_axis: str | None = None):
    """Ring attention on global `[B, T, N, H]` arrays, the sequence sharded over `axis`.

    Causal attention runs in the zig-zag layout (reordered here and back), so every
    device does the same work. batch_axis / head_axis optionally shard B and the heads.
    """
    p = mesh.shape[axis]
    layout = "zigzag" if is_causal else "contiguous"
    spec = PartitionSpec(batch_axis, axis, head_axis, None)
    attend = jax.shard_map(
        functools.partial(ring_attention, axis_name=axis, is_causal=is_causal, scale=scale,
                          layout=layout),
        mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
    if not is_causal:
        return attend(query, key, value)
    query, key, value = (zigzag(x, p) for x in (query, key, value))
    return unzigzag(attend(query, key, value), p)
