"""`MultiHeadAttention`: flax.linen's multi-head attention on attnjax's functions.

The module holds the parameters (the tree of `flax.linen.MultiHeadDotProductAttention`)
and the KV cache; projections and attention are `attnjax.multi_head` and
`attnjax.dot_product_attention`.
"""

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from attnjax import _checks, masks, multi_head, scores
from attnjax.attention import dot_product_attention

SCORES = ("scaled_dot", "dot", "general", "additive")


class _Projection(nn.Module):
    """Holds one projection's {"kernel", "bias"}; the maths is in `attnjax.multi_head`."""

    fan_in: tuple[int, ...]
    fan_out: tuple[int, ...]
    use_bias: bool
    kernel_init: Callable
    bias_init: Callable
    param_dtype: Any

    @nn.compact
    def __call__(self) -> dict:
        init = multi_head.flat_fan_in_init(self.kernel_init, len(self.fan_in))
        params = {"kernel": self.param("kernel", init, self.fan_in + self.fan_out, self.param_dtype)}
        if self.use_bias:
            params["bias"] = self.param("bias", self.bias_init, self.fan_out, self.param_dtype)
        return params


class MultiHeadAttention(nn.Module):
    """Multi-head attention with flax's names, parameters and KV-cache convention.

    Attributes shared with `flax.linen.MultiHeadDotProductAttention`: num_heads, dtype,
    param_dtype, qkv_features, out_features, broadcast_dropout, dropout_rate,
    deterministic, kernel_init, bias_init, use_bias, decode. attnjax's own:
    num_kv_heads (K < N: grouped-query, 1: multi-query attention), is_causal
    (bottom-right aligned) and window (both read positions), score_mod (applied to
    every call's logits, see `attnjax.scores`), use_sinks (a learned `[N]` sink logit
    per head, parameter "sinks"), implementation, and score: "scaled_dot" (default),
    "dot" (unscaled), "general" (q W_n kᵀ with a learned `[N, H, H]` W) or "additive"
    (v_nᵀ tanh(W_q q + W_k k) with learned `[N, H, H]`, `[N, H, H]`, `[N, H]`).

    With decode=True, `init` on a full-length input sizes the cache, and each
    `apply(..., mutable=["cache"])` appends any number of new tokens (a chunked prefill,
    then one at a time) that attend to everything cached so far (causally when
    is_causal). The cache holds the K key/value heads and describes itself by positions
    and its filled length, so a long cache decodes on the chunked kernel too.
    """

    num_heads: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    use_bias: bool = True
    decode: bool = False
    num_kv_heads: int | None = None
    is_causal: bool = False
    window: int | tuple[int, int] | None = None
    score_mod: Callable | None = None
    use_sinks: bool = False
    implementation: str | None = None
    score: str = "scaled_dot"

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
                 deterministic=None, dropout_rng=None, sow_weights=False,
                 **attention_options):
        """inputs_q `[B, T, D]`, inputs_k `[B, S, Dk]` (default inputs_q), inputs_v
        `[B, S, Dv]` (default inputs_k) -> `[B, T, F]`.

        mask: a bool array broadcastable to `[B, N, T, S]` or an `attnjax.Mask`, combined
        with the module's is_causal and window. attention_options: any other keyword of
        `attnjax.dot_product_attention` (bias, query_lengths, key_lengths, positions,
        score_mod, sinks, ...)."""
        inputs_k = inputs_q if inputs_k is None else inputs_k
        inputs_v = inputs_k if inputs_v is None else inputs_v
        dtype = self.dtype or inputs_q.dtype
        inputs_q, inputs_k, inputs_v = (jnp.asarray(x, dtype) for x in (inputs_q, inputs_k, inputs_v))
        params, head_dim = self._parameters(inputs_q.shape[-1], inputs_k.shape[-1], inputs_v.shape[-1])
        # [B, T, N, H]
        query = multi_head.project_query(params, inputs_q)
        # [B, S, K, H], [B, S, K, V]
        key, value = multi_head.project_key_value(params, inputs_k, inputs_v)

        visible = self._mask(mask)
        if self.decode:
            cached = self._update_cache(key, value)
            if cached is not None:  # not the sizing call of `init`
                if attention_options.get("positions") is not None:
                    raise ValueError("positions= cannot be given with decode=True: the "
                                     "cache places new tokens at its own index")
                key, value, filled, positions = cached
                visible = visible & masks.lengths(key=filled)
                attention_options["positions"] = positions

        rate = 0.0
        if self.dropout_rate > 0.0 and not nn.merge_param(
                "deterministic", self.deterministic, deterministic):
            rate = self.dropout_rate
        if rate > 0.0 and dropout_rng is None:
            dropout_rng = self.make_rng("dropout")
        if self.score_mod is not None:
            attention_options["score_mod"] = self.score_mod
        if self.use_sinks:
            attention_options["sinks"] = self.param(
                "sinks", nn.initializers.zeros_init(), (self.num_heads,), self.param_dtype)
        if self.score == "dot":
            attention_options["scale"] = 1.0
        elif self.score in ("general", "additive"):
            attention_options["alignment"] = self._alignment(head_dim, dtype)
        result = dot_product_attention(
            query, key, value, mask=visible, dropout_rate=rate, dropout_rng=dropout_rng,
            dropout_broadcast=self.broadcast_dropout, return_weights=sow_weights,
            implementation=self.implementation, **attention_options)
        heads, weights = result if sow_weights else (result, None)
        if sow_weights:
            self.sow("intermediates", "attention_weights", weights)
        # [B, T, F]
        return multi_head.combine_heads(params, heads)

    def _mask(self, mask) -> masks.Mask:
        """The module's is_causal and window and the call's mask, as one Mask."""
        visible = masks.everything()
        if mask is not None:
            visible = mask if isinstance(mask, masks.Mask) else masks.from_array(mask)
        if self.is_causal:
            visible = visible & masks.causal()
        if self.window is not None:
            visible = visible & masks.window(*_checks.resolve_window(self.window))
        return visible

    def _parameters(self, d_q: int, d_k: int, d_v: int):
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}; got {self.score!r}")
        shapes = multi_head.projection_shapes(
            d_q, self.num_heads, qkv_features=self.qkv_features, out_features=self.out_features,
            num_kv_heads=self.num_kv_heads, kv_features=d_k)
        shapes["value"] = ((d_v,), shapes["value"][1])  # inputs_v may be narrower or wider
        params = {
            name: _Projection(fan_in, fan_out, self.use_bias, self.kernel_init, self.bias_init,
                              self.param_dtype, name=name)()
            for name, (fan_in, fan_out) in shapes.items()
        }
        return params, shapes["query"][1][1]

    def _alignment(self, h: int, dtype):
        """(score_fn, per-head parameters) of the learned general or additive score."""
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        n = self.num_heads
        if self.score == "general":
            w = self.param("score_w", init, (n, h, h), self.param_dtype)
            return scores.general_score, {"w": w.astype(dtype)}
        params = {
            "w_q": self.param("score_w_q", init, (n, h, h), self.param_dtype),
            "w_k": self.param("score_w_k", init, (n, h, h), self.param_dtype),
            "v": self.param("score_v", nn.initializers.normal(1.0 / math.sqrt(h)), (n, h),
                            self.param_dtype),
        }
        return scores.additive_score, {k: p.astype(dtype) for k, p in params.items()}

    def _update_cache(self, key, value):
        """Append the new keys/values at the cache index: the cached keys and values,
        the filled length, and the (query, key) positions — the new queries at
        start..start+T−1, the cache slots at 0..S_cache−1; None on the call that
        creates the cache."""
        initialised = self.has_variable("cache", "cached_key")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialised:
            return None
        capacity, new = cached_key.value.shape[1], key.shape[1]
        start = index.value
        _check_room(start, new, capacity)
        zero = jnp.int32(0)
        cached_key.value = lax.dynamic_update_slice(cached_key.value, key.astype(cached_key.value.dtype),
                                                    (zero, start, zero, zero))
        cached_value.value = lax.dynamic_update_slice(
            cached_value.value, value.astype(cached_value.value.dtype), (zero, start, zero, zero))
        index.value = start + new
        positions = (start + jnp.arange(new, dtype=jnp.int32),
                     jnp.arange(capacity, dtype=jnp.int32))
        return cached_key.value, cached_value.value, start + new, positions


def _check_room(start, new: int, capacity: int) -> None:
    """Appending past the cache is an error: at trace time when the index is known,
    otherwise when the computation runs."""
    message = "KV cache overrun: {} new tokens at position {} exceed the cache length {}"
    if isinstance(start, jax.core.Tracer):
        def check(position):
            if int(position) + new > capacity:
                raise ValueError(message.format(new, int(position), capacity))
        jax.debug.callback(check, start)
    elif int(start) + new > capacity:
        raise ValueError(message.format(new, int(start), capacity))
