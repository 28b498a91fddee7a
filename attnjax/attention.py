"""Layer 2: batched, multi-head `dot_product_attention` on `[B, T, N, H]` arrays.

The single-head implementations (`attnjax.dense`, ...) are vmapped over query heads
within a key/value group (G), over key/value heads (K) and over the batch (B). Masks,
lengths, windows, dropout and the choice of implementation are resolved here, once.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnjax import _checks, cudnn
from attnjax.chunked import chunked_attention
from attnjax.dense import dense_attention

# name -> (single-head function, can it return weights?)
_VMAPPED = {"dense": (dense_attention, True), "chunked": (chunked_attention, False)}
IMPLEMENTATIONS = ("dense", "chunked", "cudnn")

# implementation=None runs dense while T·S is at most this, chunked above it. Measured
# with benchmarks/attention.py on a 2-core CPU: below it the dense weights fit in cache
# and the blocked loop only adds overhead.
AUTO_CHUNKED_ABOVE = 512 * 512


def _select_implementation(implementation, return_weights: bool, t: int, s: int) -> str:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS} or None; got {implementation!r}"
        )
    name = implementation
    if name is None:
        name = "dense" if return_weights or t * s <= AUTO_CHUNKED_ABOVE else "chunked"
    if return_weights and not _VMAPPED.get(name, (None, False))[1]:
        raise ValueError(
            f"return_weights=True needs implementation='dense' (the only one that "
            f"materialises the [B, N, T, S] weights); got implementation={implementation!r}"
        )
    return name


def _to_rank4(x):
    """Left-pad a mask or bias with unit axes to `[B, N, T, S]`."""
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _group_heads(x, num_heads: int, num_kv_heads: int):
    """`[b, n, t, s]` -> `[b, k, g, t, s]` with n = k·g, or unit axes when n = 1.

    Returns the array with its unit leading axes dropped, and for each of (B, K, G)
    whether the array has that axis (vmap in_axes 0) or is shared along it (None).
    """
    b, n, t, s = x.shape
    grouped = (num_kv_heads, num_heads // num_kv_heads) if n == num_heads else (1, 1)
    x = x.reshape((b,) + grouped + (t, s))
    has_axis = tuple(d != 1 for d in x.shape[:3])
    kept = [d for d in x.shape[:3] if d != 1]
    return x.reshape(tuple(kept) + (t, s)), has_axis


def _axes(flag: bool | None):
    return 0 if flag else None


def _map_axis(fn, size: int, in_axes: tuple, out_axes: tuple):
    """`jax.vmap(fn, in_axes, out_axes)` over an axis of `size`; a unit axis is indexed
    away and re-inserted instead, which keeps unit dims out of every intermediate (XLA
    otherwise copies whole blocks of logits to move them)."""
    if size > 1:
        return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes)

    def squeezed(*args):
        args = [x if axis is None else jax.tree.map(lambda a: jnp.take(a, 0, axis=axis), x)
                for x, axis in zip(args, in_axes)]
        outs = fn(*args)
        return tuple(None if x is None else jnp.expand_dims(x, axis)
                     for x, axis in zip(outs, out_axes))

    return squeezed


def _vmapped(fn, sizes, bias_axes, mask_axes, has_lengths, has_keys, has_score_params):
    """Map a single-head `fn(q, k, v, bias, mask, q_len, k_len, key, score_params)` over
    G, K and B."""
    def level(index, q_axis, kv_axis, length_axis):
        # out [T, ..., V] keeps T first; weights [..., T, S] stack heads in front.
        in_axes = (
            q_axis,
            kv_axis,
            kv_axis,
            _axes(bias_axes and bias_axes[index]),
            _axes(mask_axes and mask_axes[index]),
            length_axis[0],
            length_axis[1],
            _axes(has_keys),
            _axes(has_score_params and index > 0),  # per head, shared by the batch
        )
        return lambda f: _map_axis(f, sizes[index], in_axes, (q_axis, 0))

    fn = level(2, 1, None, (None, None))(fn)  # G: q [T, G, H]; k, v shared
    fn = level(1, 1, 1, (None, None))(fn)  # K: q [T, K, G, H]; k [S, K, H]
    lengths = tuple(0 if has else None for has in has_lengths)
    return level(0, 0, 0, lengths)(fn)  # B


def dot_product_attention(
    query: Float[ArrayLike, "*B T N H"],
    key: Float[ArrayLike, "*B S K H"],
    value: Float[ArrayLike, "*B S K V"],
    bias: Float[ArrayLike, "..."] | None = None,
    mask: Bool[ArrayLike, "..."] | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_lengths: Int[ArrayLike, "*B"] | None = None,
    key_lengths: Int[ArrayLike, "*B"] | None = None,
    window: int | tuple[int, int] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    dropout_broadcast: bool = False,
    return_weights: bool = False,
    implementation: str | None = None,
    block_sizes: tuple[int, int] | None = None,
) -> Float[ArrayLike, "*B T N V"] | tuple[Float[ArrayLike, "*B T N V"], Float[ArrayLike, "*B N T S"]]:
    """Scaled dot-product attention over a batch and several heads.

    softmax(Q Kᵀ · scale + bias) V per example and head, over the keys each query may
    see. Axis letters: B batch, T query length, S key length, N query heads, K key/value
    heads (N = K·G: grouped-query attention when K < N), H query/key head dim, V value
    head dim.

    Args:
      query: `[B, T, N, H]`, or `[T, N, H]` for one unbatched example.
      key: `[B, S, K, H]` (or `[S, K, H]`); K must divide N.
      value: `[B, S, K, V]` (or `[S, K, V]`); same dtype as query and key.
      bias: float, broadcastable to `[B, N, T, S]` (`[N, T, S]` unbatched); added to
        the logits. Use it for additive masks and relative-position biases.
      mask: bool, broadcastable to `[B, N, T, S]` (`[N, T, S]` unbatched);
        True = may attend. A float mask is a TypeError: pass additive values as bias.
      scale: logit scale; 1/√H when None.
      is_causal: key j is visible to query i when j ≤ i + (S − T): the *last* query
        sees every key. The usual triangle when T = S, and right for a KV-cache step or
        chunked prefill (T < S). `jax.nn.dot_product_attention` aligns top-left
        (j ≤ i) instead.
      query_lengths: int `[B]` (`[]` unbatched), the valid query lengths; query rows at
        or past the length are padding and give zeros.
      key_lengths: int `[B]` (`[]` unbatched), the valid key lengths; keys at or past
        the length are never attended to.
      window: `(left, right)` or an int w for `(w, w)`: query i sees key j when
        i' − left ≤ j ≤ i' + right, with i' = i + (S − T).
      dropout_rate: inverted dropout on the attention weights, in [0, 1); independent
        per example and head.
      dropout_rng: a `jax.random` key; required when dropout_rate > 0.
      dropout_broadcast: share one dropout mask across the batch and the heads
        (flax's `broadcast_dropout=True`) instead of drawing one per example and head.
      return_weights: also return the `[B, N, T, S]` weights (before dropout); only
        the dense implementation can.
      implementation: "dense" (materialises the `[T, S]` weights of each head),
        "chunked" (online softmax over key blocks: O(T + S) memory forward and
        backward, fully masked blocks skipped) or "cudnn" (delegates to
        `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only). None picks
        dense for T·S ≤ 512², or when weights are asked for, and chunked above.
      block_sizes: `(block_q, block_k)` for the chunked implementation; chosen per
        shape when None. Lengths need not be multiples of them.

    Returns:
      `[B, T, N, V]` (or `[T, N, V]`) in the input dtype; with return_weights, the pair
      (output, weights `[B, N, T, S]`). A query that sees no key gets zeros, and zero
      gradients, in every dtype. Softmax and accumulation run in float32 for
      float16/bfloat16 inputs.
    """
    return _attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_lengths=query_lengths, key_lengths=key_lengths, window=window,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        dropout_broadcast=dropout_broadcast, return_weights=return_weights,
        implementation=implementation, block_sizes=block_sizes, score=None,
    )


def score_attention(
    query: Float[ArrayLike, "*B T N Hq"],
    key: Float[ArrayLike, "*B S K Hk"],
    value: Float[ArrayLike, "*B S K V"],
    score_fn,
    score_params,
    bias: Float[ArrayLike, "..."] | None = None,
    mask: Bool[ArrayLike, "..."] | None = None,
    *,
    is_causal: bool = False,
    query_lengths: Int[ArrayLike, "*B"] | None = None,
    key_lengths: Int[ArrayLike, "*B"] | None = None,
    window: int | tuple[int, int] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    dropout_broadcast: bool = False,
    return_weights: bool = False,
):
    """Batched multi-head attention with any alignment function and per-head parameters.

    The dense implementation with `score_fn(q [T, Hq], k [S, Hk], **params) -> [T, S]`
    (e.g. `attnjax.general_score`, `attnjax.additive_score`) in place of the scaled dot
    product, vmapped over heads and batch like `dot_product_attention`.

    Args:
      query: `[B, T, N, Hq]` (or `[T, N, Hq]`).
      key: `[B, S, K, Hk]` (or `[S, K, Hk]`).
      value: `[B, S, K, V]` (or `[S, K, V]`).
      score_fn: the alignment function.
      score_params: a dict of its keyword parameters, each with a leading axis of size N
        (one set per query head).
      bias: as for `dot_product_attention`, broadcastable to `[B, N, T, S]`.
      mask: as for `dot_product_attention`, broadcastable to `[B, N, T, S]`.
      is_causal: as for `dot_product_attention` (bottom-right alignment).
      query_lengths: int `[B]`, as for `dot_product_attention`.
      key_lengths: int `[B]`, as for `dot_product_attention`.
      window: as for `dot_product_attention`.
      dropout_rate: as for `dot_product_attention`.
      dropout_rng: as for `dot_product_attention`.
      dropout_broadcast: as for `dot_product_attention`.
      return_weights: also return the `[B, N, T, S]` weights.

    Returns:
      `[B, T, N, V]`, or (output, weights `[B, N, T, S]`) with return_weights.
    """
    return _attention(
        query, key, value, bias, mask, scale=None, is_causal=is_causal,
        query_lengths=query_lengths, key_lengths=key_lengths, window=window,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        dropout_broadcast=dropout_broadcast, return_weights=return_weights,
        implementation="dense", block_sizes=None, score=(score_fn, score_params),
    )


def _attention(
    query, key, value, bias, mask, *, scale, is_causal, query_lengths, key_lengths, window,
    dropout_rate, dropout_rng, dropout_broadcast, return_weights, implementation,
    block_sizes, score,
):
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _checks.check_rank("query", query, (3, 4), "[B, T, N, H] or [T, N, H]")
    unbatched = query.ndim == 3
    layouts = {
        "query": "[T, N, H]" if unbatched else "[B, T, N, H]",
        "key": "[S, K, H]" if unbatched else "[B, S, K, H]",
        "value": "[S, K, V]" if unbatched else "[B, S, K, V]",
    }
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            raise ValueError(
                f"{name} must have the rank of query, {layouts[name]}; got shape "
                f"{_checks.shape_str(x.shape)} for query {_checks.shape_str(query.shape)}"
            )
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.check_floating(name, x)
    _checks.check_same_dtype(query=query, key=key, value=value)
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    _check_shapes(query, key, value, layouts, same_head_dim=score is None)
    b, t, n, h = query.shape
    s = key.shape[1]

    target = (b, n, t, s)
    bias_layout = "[N, T, S]" if unbatched else "[B, N, T, S]"
    rank = 3 if unbatched else 4
    if bias is not None:
        _checks.check_bias("bias", bias, target[4 - rank:], bias_layout)
        bias = _to_rank4(bias)
    if mask is not None:
        _checks.check_mask("mask", mask, target[4 - rank:], bias_layout)
        mask = _to_rank4(mask)
    lengths = []
    for name, x in (("query_lengths", query_lengths), ("key_lengths", key_lengths)):
        if x is not None:
            _checks.check_lengths(name, x, () if unbatched else (b,), "[]" if unbatched else "[B]")
            x = jnp.reshape(x, (b,)).astype(jnp.int32)
        lengths.append(x)
    window = _checks.resolve_window(window)
    dropout_rate = _checks.check_dropout(dropout_rate, dropout_rng)
    if score is None:
        scale = _checks.resolve_scale(scale, h)
    else:
        score = _check_score(*score, n)
    name = _select_implementation(implementation, return_weights, t, s)
    options = {}
    if block_sizes is not None:
        options = dict(zip(("block_q", "block_k"), _checks.resolve_block_sizes(block_sizes)))
        if name != "chunked":
            raise ValueError(
                f"block_sizes={block_sizes} applies to implementation='chunked'; "
                f"got implementation={implementation!r}, which runs {name!r}"
            )

    if name == "cudnn":
        out = cudnn.attention(
            query, key, value, bias, mask,
            scale=scale, is_causal=is_causal, query_lengths=lengths[0],
            key_lengths=lengths[1], window=window, dropout_rate=dropout_rate,
        )
        weights = None
    else:
        out, weights = _run_vmapped(
            functools.partial(_VMAPPED[name][0], **options), query, key, value, bias, mask, lengths,
            is_causal=is_causal, window=window, scale=scale, dropout_rate=dropout_rate,
            dropout_rng=dropout_rng, dropout_broadcast=dropout_broadcast,
            return_weights=return_weights, score=score,
        )
    if unbatched:
        out = out[0]
        weights = None if weights is None else weights[0]
    return (out, weights) if return_weights else out


def _check_score(score_fn, score_params, num_heads: int):
    if not callable(score_fn):
        raise TypeError(f"score_fn must be callable; got {type(score_fn).__name__}")
    if not isinstance(score_params, dict):
        raise TypeError(f"score_params must be a dict of arrays; got {type(score_params).__name__}")
    for name, x in score_params.items():
        if jnp.ndim(x) < 1 or jnp.shape(x)[0] != num_heads:
            raise ValueError(
                f"score_params[{name!r}] must have a leading head axis of size N={num_heads}; "
                f"got shape {_checks.shape_str(jnp.shape(x))}"
            )
    return score_fn, score_params


def _check_shapes(query, key, value, layouts, same_head_dim=True) -> None:
    b, t, n, h = query.shape
    shapes = {name: _checks.shape_str(x.shape) for name, x in
              (("query", query), ("key", key), ("value", value))}

    def fail(what: str) -> None:
        raise ValueError(
            f"{what}; got query {shapes['query']} {layouts['query']}, key {shapes['key']} "
            f"{layouts['key']}, value {shapes['value']} {layouts['value']}"
        )

    if not key.shape[0] == value.shape[0] == b:
        fail("query, key and value must share the batch size B")
    if key.shape[1] != value.shape[1]:
        fail("key and value must share the key length S")
    if key.shape[2] != value.shape[2]:
        fail("key and value must share the number of key/value heads K")
    if same_head_dim and key.shape[3] != h:
        fail("query and key must share the head dim H")
    if key.shape[2] == 0 or n % key.shape[2] != 0:
        fail(f"the number of key/value heads K={key.shape[2]} must divide the query heads N={n}")


def _run_vmapped(
    fn, query, key, value, bias, mask, lengths, *, is_causal, window, scale,
    dropout_rate, dropout_rng, dropout_broadcast, return_weights, score,
):
    b, t, n, h = query.shape
    s, k = key.shape[1], key.shape[2]
    g = n // k
    bias_axes = mask_axes = None
    if bias is not None:
        bias, bias_axes = _group_heads(bias, n, k)
    if mask is not None:
        mask, mask_axes = _group_heads(mask, n, k)
    keys = None
    if dropout_rate > 0.0:
        # One key per (example, query head): dropout masks independent across both,
        # unless one mask is to be shared by all.
        if dropout_broadcast:
            keys = jnp.broadcast_to(dropout_rng, (b * n,) + jnp.shape(dropout_rng))
        else:
            keys = jax.random.split(dropout_rng, b * n)
        keys = keys.reshape((b, k, g) + keys.shape[1:])
    score_fn, score_params = score if score is not None else (None, None)
    if score_params is not None:
        # [N, ...] -> [K, G, ...]: one parameter set per query head.
        score_params = jax.tree.map(lambda x: jnp.reshape(x, (k, g) + jnp.shape(x)[1:]),
                                    score_params)

    single = functools.partial(
        _single_head, fn, score_fn, is_causal=is_causal, window=window, scale=scale,
        dropout_rate=dropout_rate, return_weights=return_weights,
    )
    run = _vmapped(single, (b, k, g), bias_axes, mask_axes,
                   tuple(x is not None for x in lengths), keys is not None,
                   score_params is not None)
    # [B, T, K, G, H]
    grouped_query = query.reshape(b, t, k, g, h)
    # out [B, T, K, G, V], weights [B, K, G, T, S] or None
    out, weights = run(grouped_query, key, value, bias, mask, lengths[0], lengths[1], keys,
                       score_params)
    out = out.reshape(b, t, n, value.shape[-1])
    if weights is not None:
        weights = weights.reshape(b, n, t, s)
    return out, weights


def _single_head(fn, score_fn, q, k, v, bias, mask, query_length, key_length, dropout_key,
                 score_params, **options):
    if score_fn is not None:
        options["score_fn"] = functools.partial(score_fn, **score_params)
    return fn(
        q, k, v, bias=bias, mask=mask, query_length=query_length, key_length=key_length,
        dropout_key=dropout_key, **options,
    )
