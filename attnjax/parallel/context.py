"""Context parallelism: a model's sequences sharded over a mesh axis, attention as a ring.

A model trained on a mesh with a sequence axis ("seq", P devices) keeps every
per-token computation — embeddings, projections, feed-forward, layer norms, logits, the
loss — on the device that holds the token, and runs attention as ring attention over
the axis (`attnjax.parallel.ring`): no device ever holds more than 1/P of a sequence's
activations. Two pieces, used together:

  lay_out, layout_positions   once per batch, on the host: every `[B, L]` array padded
                              to a multiple of 2P and permuted into the zig-zag layout
                              (device i holds chunks i and 2P − 1 − i of 2P), so that
                              every device has the same causal work; the tokens'
                              positions and segment ids travel with them.
  ring_engine(mesh)           `attnjax.dot_product_attention`'s signature for arrays in
                              that layout; `attnjax.nn.attention.attention_engine` makes
                              every module's attention call it while a model is traced.

The Mask stays correct because its rules read positions and segment ids, which are
permuted with their tokens. Rules that read array indices are rewritten once here:
`masks.lengths` becomes segment ids of the tokens' original indices (padding a query
id and a key id that nothing else carries). The loss is a sum over tokens, which
needs no undoing; `restore` undoes the layout for outputs read per position.

Padding to a multiple of 2P is exact when no real token sees the padding: the tokens
appended at the end come after every real token (causal), or lie past the valid
lengths, or carry a segment id of their own (not so for a window that looks ahead).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from attnjax import _checks, masks
from attnjax.parallel import ring

AXIS = "seq"


def padded_length(length: int, num_shards: int) -> int:
    """The smallest multiple of 2P (two zig-zag chunks per device) that holds length."""
    if not _checks.is_int(num_shards) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive int (the devices of the sequence "
                         f"axis); got {num_shards!r}")
    chunks = 2 * num_shards
    return -(-length // chunks) * chunks


def lay_out(x, num_shards: int, fill=0) -> np.ndarray:
    """`[B, L, ...]` on the host -> `[B, L', ...]`: padded with `fill` to L' =
    `padded_length(L, P)` and permuted into the zig-zag layout of P shards."""
    x = np.asarray(x)
    pad = padded_length(x.shape[1], num_shards) - x.shape[1]
    x = np.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return x[:, ring.zigzag_order(x.shape[1], num_shards)]


def layout_positions(batch: int, length: int, num_shards: int) -> np.ndarray:
    """int32 `[B, L']`: the position of every slot of `lay_out`'s layout of sequences
    of `length` (padding continues after the last token)."""
    order = ring.zigzag_order(padded_length(length, num_shards), num_shards)
    return np.broadcast_to(order, (batch, order.size)).copy()


def restore(x, num_shards: int, length: int, axis: int = 1):
    """The inverse of `lay_out` along `axis`: the first `length` positions in order."""
    return jax.lax.slice_in_dim(ring.unzigzag(x, num_shards, axis), 0, length, axis=axis)


def ring_engine(mesh: Mesh, *, axis: str = AXIS, batch_axis: str | None = "data",
                head_axis: str | None = "model") -> Callable:
    """`attnjax.dot_product_attention`'s signature on global `[B, T, N, H]` arrays in
    the zig-zag layout (`lay_out`), as ring attention over the mesh axis `axis`.

    Call it (or install it with `attnjax.nn.attention.attention_engine`) inside a
    jit-compiled function: the arrays are sharded batch over `batch_axis`, sequence
    over `axis` and heads over `head_axis` (axes the mesh lacks are not used).

    It takes mask (an `attnjax.Mask` with global per-position arrays, `[B, T]` segment
    ids, `[B]` lengths), positions (global, in the layout; default: each slot's own,
    bottom-right aligned), is_causal and scale. Attention dropout, weights, score_mod,
    bias, sinks and learned alignments are refused (ValueError), as are bool-array
    masks (TypeError: the mask is a Mask), and from_fn when the batch or heads are
    sharded (it would see local indices). T and S must be multiples of 2P: pad with `lay_out`.
    """
    if axis not in mesh.shape:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh; its axes are "
                         f"{tuple(mesh.axis_names)}")
    batch_axis = batch_axis if batch_axis in mesh.shape else None
    head_axis = head_axis if head_axis in mesh.shape else None
    p = mesh.shape[axis]
    rows = PartitionSpec(batch_axis, axis, head_axis, None)

    def attend(query, key, value, *, mask=None, positions=None, is_causal=False, scale=None,
               dropout_rate=0.0, dropout_rng=None, dropout_broadcast=True,
               return_weights=False, implementation=None, **options):
        # without dropout its rng is unused; the ring folds with the chunked kernel
        del dropout_rng, dropout_broadcast, implementation
        refused = [f"{name}=" for name, x in options.items() if x is not None]
        refused += ["dropout_rate > 0"] * bool(dropout_rate) + ["return_weights"] * bool(
            return_weights)
        if refused:
            raise ValueError(f"attention over a sequence sharded on mesh axis {axis!r} (ring "
                             f"attention) takes mask, positions, is_causal and scale only; "
                             f"got {', '.join(refused)}")
        b, t = query.shape[:2]
        s = key.shape[1]
        for name, length in (("query length T", t), ("key length S", s)):
            if length % (2 * p):
                raise ValueError(f"{name}={length} must be a multiple of 2P={2 * p} (two "
                                 f"zig-zag chunks on each of the P={p} devices of mesh axis "
                                 f"{axis!r}); pad the sequences with lay_out")
        shape = masks.Shape(b, t, s, query.shape[2])
        order_q, order_k = ring.zigzag_order(t, p), ring.zigzag_order(s, p)
        if positions is None:
            positions = (order_q + (s - t), order_k)
        q_pos = _rows(shape, "query positions", positions[0], t)
        k_pos = _rows(shape, "key positions", positions[1], s)
        rule = _shardable(_mask(mask, is_causal).rule, shape, order_q, order_k)
        ring.check_from_fn_unsharded(rule, mesh, batch_axis, head_axis)
        rule = jax.tree.map(jnp.asarray, rule)
        # [B, L] arrays follow the sequence, [B] arrays the batch
        rule_specs = jax.tree.map(lambda x: PartitionSpec(*(batch_axis, axis)[:x.ndim]), rule)
        sequence = PartitionSpec(batch_axis, axis)

        def local(query, key, value, rule, q_pos, k_pos):
            return ring.ring_attention(query, key, value, axis_name=axis,
                                       mask=masks.Mask(rule), positions=(q_pos, k_pos),
                                       scale=scale, layout="zigzag")

        sharded = jax.shard_map(local, mesh=mesh,
                                in_specs=(rows, rows, rows, rule_specs, sequence, sequence),
                                out_specs=rows, check_vma=False)
        return sharded(query, key, value, rule, q_pos, k_pos)

    return attend


def _mask(mask, is_causal: bool) -> masks.Mask:
    _checks.check_flag("is_causal", is_causal)
    if mask is None:
        mask = masks.everything()
    if not isinstance(mask, masks.Mask):
        raise TypeError(f"a sequence-sharded attention takes an attnjax.Mask (segment ids, "
                        f"lengths and rules of positions); got {type(mask).__name__}")
    return mask & masks.causal() if is_causal else mask


def _rows(shape: masks.Shape, name: str, x, length: int):
    """int32 `[B, length]` from `[B, length]` or `[length]`, checked."""
    x = shape.per_example(name, x, (length,), "[B, L]")[:, 0]
    return jnp.broadcast_to(x, (shape.b, length))


def _shardable(rule, shape: masks.Shape, order_q, order_k):
    """The rule with every per-position array as a global `[B, L]` array in the layout,
    `lengths` (array indices) rewritten as segment ids of the tokens' original indices:
    a query past its length carries −1, a key past its length −2, which nothing else
    carries."""
    if isinstance(rule, (masks.And, masks.Or)):
        return type(rule)(_shardable(rule.left, shape, order_q, order_k),
                          _shardable(rule.right, shape, order_q, order_k))
    if isinstance(rule, masks.Lengths):
        def ids(lengths, order, padding):
            if lengths is None:
                return jnp.zeros((shape.b, order.size), jnp.int32)
            # [B|1, 1]
            lengths = shape.per_example("lengths", lengths, (), "[B]", count=True)
            return jnp.broadcast_to(jnp.where(order[None] < lengths, 0, padding),
                                    (shape.b, order.size)).astype(jnp.int32)
        return masks.Segments(ids(rule.query, order_q, -1), ids(rule.key, order_k, -2))
    if isinstance(rule, masks.Segments):
        if rule.key is None and shape.t != shape.s:
            raise ValueError(f"segments(query_ids) alone needs T = S (self-attention); got "
                             f"T={shape.t}, S={shape.s}: pass key_ids too")
        key = rule.query if rule.key is None else rule.key
        return masks.Segments(_rows(shape, "segment ids (query)", rule.query, shape.t),
                              _rows(shape, "segment ids (key)", key, shape.s))
    if rule.by_index:
        raise ValueError(f"a sequence-sharded attention cannot use {rule.kind}: it reads "
                         f"array indices, which the layout permutes; express it with "
                         f"segment ids or positions")
    return rule
