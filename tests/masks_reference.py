"""An independent statement of the Mask rules, the score modifications and attention with
sinks, in plain jax.numpy on whole `[B, N, T, S]` grids (float64 in the tests).

Nothing here calls attnjax: the rules are written again from their definitions.

A mask is described by a small tree of tuples:

    ("everything",)                      every key
    ("causal",)                          k_pos ≤ q_pos
    ("window", left, right)              q_pos − left ≤ k_pos ≤ q_pos + right
    ("chunked_causal", size)             ⌊k_pos/size⌋ = ⌊q_pos/size⌋ and k_pos ≤ q_pos
    ("prefix", length)                   k_pos < length (an int, or int [B])
    ("lengths", query, key)              i < query[b] and j < key[b] (array indices;
                                         either may be None)
    ("segments", query_ids, key_ids)     query_ids[b, i] = key_ids[b, j]
    ("array", array)                     a bool array broadcast to [B, N, T, S]
    ("fn", fn)                           fn(b, n, q_pos, k_pos), elementwise
    ("and", a, b), ("or", a, b)

Positions default to the bottom-right alignment: query i at i + (S − T), key j at j.

A score modification is None or one of

    ("soft_cap", cap)                    cap · tanh(score / cap)
    ("alibi", slopes)                    score − slopes[n] · |q_pos − k_pos|
    ("t5", table, num_buckets, max_distance, bidirectional)
                                         score + table[bucket(k_pos − q_pos), n]
    ("custom", fn)                       fn(score, b, n, q_pos, k_pos), elementwise
    ("chain", first, second)             second applied to first's result
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def default_positions(b: int, t: int, s: int):
    """`[B, T]` and `[B, S]` int32: query i at i + (S − T), key j at j."""
    q_pos = np.broadcast_to(np.arange(t, dtype=np.int32) + (s - t), (b, t))
    k_pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    return jnp.asarray(q_pos), jnp.asarray(k_pos)


def _grids(b, n, t, s, q_pos, k_pos):
    """Every coordinate of the [B, N, T, S] grid, each as a rank-4 int32 array."""
    return dict(
        b=jnp.arange(b, dtype=jnp.int32).reshape(b, 1, 1, 1),
        n=jnp.arange(n, dtype=jnp.int32).reshape(1, n, 1, 1),
        i=jnp.arange(t, dtype=jnp.int32).reshape(1, 1, t, 1),
        j=jnp.arange(s, dtype=jnp.int32).reshape(1, 1, 1, s),
        q_pos=jnp.asarray(q_pos, jnp.int32).reshape(b, 1, t, 1),
        k_pos=jnp.asarray(k_pos, jnp.int32).reshape(b, 1, 1, s),
    )


def _per_example(x, b):
    """An int, or int [B], as [B, 1, 1, 1] int32."""
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32).reshape(-1, 1, 1, 1), (b, 1, 1, 1))


def visible(tree, b, n, t, s, q_pos=None, k_pos=None):
    """`[B, N, T, S]` bool: may query i of example b, head n see key j?"""
    if q_pos is None:
        q_pos, k_pos = default_positions(b, t, s)
    g = _grids(b, n, t, s, q_pos, k_pos)
    shape = (b, n, t, s)

    def evaluate(node):
        kind = node[0]
        if kind == "everything":
            out = jnp.ones(shape, bool)
        elif kind == "causal":
            out = g["k_pos"] <= g["q_pos"]
        elif kind == "window":
            _, left, right = node
            out = (g["q_pos"] - left <= g["k_pos"]) & (g["k_pos"] <= g["q_pos"] + right)
        elif kind == "chunked_causal":
            size = node[1]
            same = jnp.floor_divide(g["k_pos"], size) == jnp.floor_divide(g["q_pos"], size)
            out = same & (g["k_pos"] <= g["q_pos"])
        elif kind == "prefix":
            out = g["k_pos"] < _per_example(node[1], b)
        elif kind == "lengths":
            _, query, key = node
            out = jnp.ones(shape, bool)
            if query is not None:
                out = out & (g["i"] < _per_example(query, b))
            if key is not None:
                out = out & (g["j"] < _per_example(key, b))
        elif kind == "segments":
            _, query_ids, key_ids = node
            query_ids = jnp.broadcast_to(jnp.asarray(query_ids), (b, t))
            key_ids = jnp.broadcast_to(jnp.asarray(key_ids), (b, s))
            out = query_ids[:, None, :, None] == key_ids[:, None, None, :]
        elif kind == "array":
            array = jnp.asarray(node[1])
            out = array.reshape((1,) * (4 - array.ndim) + array.shape)
        elif kind == "fn":
            out = node[1](g["b"], g["n"], g["q_pos"], g["k_pos"])
        elif kind == "and":
            out = evaluate(node[1]) & evaluate(node[2])
        elif kind == "or":
            out = evaluate(node[1]) | evaluate(node[2])
        else:
            raise ValueError(f"unknown mask node {kind!r}")
        return jnp.broadcast_to(out, shape)

    return evaluate(tree)


def t5_bucket(relative_position, num_buckets: int, max_distance: int, bidirectional: bool):
    """T5's bucket of relative_position = k_pos − q_pos (Raffel et al., as in
    mesh-tensorflow): distances below half the buckets (per direction) each get their
    own, longer ones share logarithmically spaced buckets up to max_distance, and the
    last bucket holds everything beyond. NumPy float64, on concrete positions."""
    distance = -np.asarray(relative_position, np.int64)
    bucket = np.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + np.where(distance < 0, num_buckets, 0)
        distance = np.abs(distance)
    else:
        distance = np.maximum(distance, 0)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore"):
        ratio = np.log(np.maximum(distance, 1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + np.floor(ratio * (num_buckets - max_exact)).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return bucket + np.where(distance < max_exact, distance, large)


def apply_score_mod(spec, score, b, n, q_pos, k_pos):
    """The score modification `spec` on `score [B, N, T, S]`."""
    if spec is None:
        return score
    g = _grids(b, n, score.shape[2], score.shape[3], q_pos, k_pos)
    kind = spec[0]
    if kind == "soft_cap":
        cap = spec[1]
        return cap * jnp.tanh(score / cap)
    if kind == "alibi":
        slopes = spec[1]
        distance = jnp.abs(g["q_pos"] - g["k_pos"]).astype(score.dtype)
        return score - slopes.astype(score.dtype).reshape(1, n, 1, 1) * distance
    if kind == "t5":
        _, table, num_buckets, max_distance, bidirectional = spec
        q_pos, k_pos = np.asarray(q_pos), np.asarray(k_pos)
        # [B, T, S]
        bucket = t5_bucket(k_pos[:, None, :] - q_pos[:, :, None], num_buckets, max_distance,
                           bidirectional)
        # [B, N, T, S]: table[bucket[b, i, j], n]
        per_head = jnp.moveaxis(table.astype(score.dtype)[jnp.asarray(bucket)], -1, 1)
        return score + per_head
    if kind == "custom":
        return spec[1](score, g["b"], g["n"], g["q_pos"], g["k_pos"])
    if kind == "chain":
        score = apply_score_mod(spec[1], score, b, n, q_pos, k_pos)
        return apply_score_mod(spec[2], score, b, n, q_pos, k_pos)
    raise ValueError(f"unknown score_mod {kind!r}")


def attention(query, key, value, see, *, scale=None, bias=None, score_mod=None, sinks=None,
              q_pos=None, k_pos=None, empty=-np.inf):
    """Output `[B, T, N, V]` and log-sum-exp `[B, T, N]` of softmax(score_mod(q kᵀ·scale
    + bias)) v over the keys `see [B, N, T, S]` lets each query see.

    `sinks [N]` join every row's denominator as one more column whose value is zero. A
    row with nothing visible gives zeros, and log-sum-exp `empty` (log 0 = −inf unless
    told otherwise; its sink, if it has one).
    Gradients are finite everywhere: masked entries are selected away before the
    exponential, never multiplied by a zero weight.
    """
    b, t, n, h = query.shape
    s, kv_heads = key.shape[1], key.shape[2]
    if q_pos is None:
        q_pos, k_pos = default_positions(b, t, s)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    # [B, S, N, ·]: query head n reads key/value head n // (N / K)
    key = jnp.repeat(key, n // kv_heads, axis=2)
    value = jnp.repeat(value, n // kv_heads, axis=2)
    # [B, N, T, S]
    score = jnp.einsum("btnh,bsnh->bnts", query, key) * scale
    if bias is not None:
        score = score + bias
    score = apply_score_mod(score_mod, score, b, n, q_pos, k_pos)
    see = jnp.broadcast_to(see, score.shape)
    # [B, N, T, 1]: the largest visible logit (or sink) shifts the exponent for range
    top = jnp.max(jnp.where(see, score, -jnp.inf), axis=-1, keepdims=True)
    if sinks is not None:
        top = jnp.maximum(top, sinks.reshape(1, n, 1, 1))
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    shifted = jnp.where(see, score, top) - top
    # [B, N, T, S]
    weights = jnp.where(see, jnp.exp(shifted), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks.reshape(1, n, 1, 1) - top)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    out = jnp.einsum("bnts,bsnv->btnv", weights / safe_total, value)
    lse = jnp.where(seen, top + jnp.log(safe_total), empty)[..., 0]
    return out, jnp.moveaxis(lse, 1, 2)
