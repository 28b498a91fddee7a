"""`MultiHeadAttention`: flax.nnx's multi-head attention on attnjax's engine.

A drop-in for `flax.nnx.MultiHeadAttention` (flax 0.12): the same constructor, call
signature, state (query, key, value and out `LinearGeneral`s, query_ln/key_ln, the
dropout rng stream, flax's cached_key/cached_value/cache_index), `init_cache`, decode
rules and errors. The projections are flax's `nnx.LinearGeneral`, so a fresh module
holds exactly the values flax's class draws from the same `nnx.Rngs`; the attention is
`attnjax.dot_product_attention`, called as the linen module calls it
(`attnjax.nn.attention.engine_attention`), and the KV cache is `attnjax.kv_cache`.
"""

import contextlib
import contextvars
import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import rnglib
from flax.nnx.module import first_from
from flax.nnx.nn import dtypes, initializers
from flax.nnx.nn.linear import default_kernel_init

from attnjax import _checks, kv_cache, multi_head
from attnjax.nn.attention import (
    alignment_of,
    alignment_params,
    check_flax_signature,
    check_score,
    engine_attention,
    flax_attention_reason,
)


def check_rngs(rngs) -> None:
    """A TypeError unless rngs is an nnx.Rngs (as flax's modules take it)."""
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs (nnx.Rngs(0), say); got "
                        f"{type(rngs).__name__}")


# The cache writes of the calls inside `caches_unchanged_on_error`: (variable, its value
# before), to restore if the call is refused.
_WRITES = contextvars.ContextVar("attnjax_nnx_cache_writes", default=None)


def write_cache(variable, value) -> None:
    """variable.set_value(value), noting the value before where
    `caches_unchanged_on_error` is open."""
    writes = _WRITES.get()
    if writes is not None:
        writes.append((variable, variable.get_value()))
    variable.set_value(value)


@contextlib.contextmanager
def caches_unchanged_on_error():
    """A call refused inside this block (a mask of the wrong shape for the second
    layer's cross-attention, a KV cache overrun) leaves every cache written inside it
    (`write_cache`) as it was: the position counters, which advance before the layers
    run, and the caches of the layers before the refusal (the next token was encoded at
    the wrong position and attended to the refused ones). Only what was written is
    noted: no walk over the model."""
    writes = []
    token = _WRITES.set(writes)
    try:
        yield
    except Exception:
        for variable, value in reversed(writes):
            variable.set_value(value)
        raise
    finally:
        _WRITES.reset(token)
    outer = _WRITES.get()
    if outer is not None:   # (an enclosing block restores these too)
        outer.extend(writes)


class MultiHeadAttention(nnx.Module):
    """Multi-head attention with `flax.nnx.MultiHeadAttention`'s constructor, call,
    state, cache and errors, on attnjax's engine.

    flax's arguments, with flax's meaning and defaults: num_heads, in_features,
    qkv_features, out_features, num_kv_heads, in_kv_features, dtype, param_dtype,
    broadcast_dropout, dropout_rate, deterministic, precision, kernel_init,
    out_kernel_init, bias_init, out_bias_init, use_bias, attention_fn, decode,
    normalize_qk, qkv_promote_dtype, out_promote_dtype, ln_promote_dtype,
    qkv_dot_general, out_dot_general, qkv_dot_general_cls, out_dot_general_cls, rngs,
    keep_rngs and the *_metadata mappings. attention_fn=None (the default) runs attnjax's
    engine; given (e.g. `flax.nnx.dot_product_attention`), it is called as flax calls it,
    and attnjax's own fields below are then errors.

    attnjax's own: is_causal (bottom-right aligned; or'ed with the call's is_causal),
    window (an int or (left, right), aligned like is_causal), score ("scaled_dot",
    "dot" unscaled, "general" q W_n kᵀ with state "score_w" `[N, H, H]`, "additive"
    v_nᵀ tanh(W_q q + W_k k) with "score_w_q", "score_w_k" `[N, H, H]` and "score_v"
    `[N, H]`), score_mod (`attnjax.scores`), use_sinks (a learned `[N]` sink logit per
    head, state "sinks", drawn by sinks_init: zeros when None; sinks_metadata, as flax's
    *_metadata, e.g. `{"out_sharding": ("heads",)}`), implementation, and
    projection_activation (φ in q = φ_Q(X W^Q + b^Q), likewise k and v: one callable, or
    a (φ_Q, φ_K, φ_V) triple; None is the identity). These extra parameters are drawn
    after flax's, so every parameter flax's class has gets flax's value from the same
    `nnx.Rngs`.

    The KV cache: `init_cache(input_shape)` sizes it, as in flax, and a call with decode
    appends the new keys and values: one token at a time as in flax, or several (a
    chunked prefill) that attend to everything cached before them, and to each other
    causally when is_causal.

    Where it differs from flax: is_causal aligns bottom-right (the last query sees
    every key; the same as flax's when T = S; pass causal_alignment="top_left" for
    flax's when T ≠ S), a query that sees no key gets zeros (flax averages every value),
    and dropout draws its masks differently (same distribution).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision: Any = None,
        kernel_init: Callable = default_kernel_init,
        out_kernel_init: Callable | None = None,
        bias_init: Callable = initializers.zeros_init(),
        out_bias_init: Callable | None = None,
        use_bias: bool = True,
        attention_fn: Callable | None = None,
        decode: bool | None = None,
        normalize_qk: bool = False,
        qkv_promote_dtype: Callable = dtypes.promote_dtype,
        out_promote_dtype: Callable = dtypes.promote_dtype,
        ln_promote_dtype: Callable = dtypes.promote_dtype,
        qkv_dot_general: Callable | None = None,
        out_dot_general: Callable | None = None,
        qkv_dot_general_cls: Any = None,
        out_dot_general_cls: Any = None,
        rngs: rnglib.Rngs,
        keep_rngs: bool = True,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        query_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
        key_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
        is_causal: bool = False,
        window: int | tuple[int, int] | None = None,
        score: str = "scaled_dot",
        score_mod: Callable | None = None,
        use_sinks: bool = False,
        sinks_init: Callable | None = None,
        sinks_metadata: Mapping[str, Any] = MappingProxyType({}),
        implementation: str | None = None,
        projection_activation: Callable | tuple | None = None,
    ):
        check_rngs(rngs)
        _checks.check_flags(broadcast_dropout=broadcast_dropout, use_bias=use_bias,
                            normalize_qk=normalize_qk, keep_rngs=keep_rngs,
                            is_causal=is_causal, use_sinks=use_sinks, decode=decode)
        _checks.check_sinks_init(use_sinks, sinks_init, dict(sinks_metadata))
        check_score(score, implementation)
        multi_head.projection_activations(projection_activation)  # checks it
        self.in_kv_features = in_features if in_kv_features is None else in_kv_features
        shapes = multi_head.projection_shapes(
            in_features, num_heads, qkv_features=qkv_features, out_features=out_features,
            num_kv_heads=num_kv_heads, kv_features=self.in_kv_features)
        self.num_heads = num_heads
        self.in_features = in_features
        self.num_kv_heads = shapes["key"][1][0]
        self.head_dim = shapes["query"][1][1]
        self.qkv_features = self.num_heads * self.head_dim
        self.out_features = shapes["out"][1][0]
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.broadcast_dropout = broadcast_dropout
        _checks.check_dropout_rate(dropout_rate, module=True)
        self.dropout_rate = dropout_rate
        self.deterministic = deterministic
        self.precision = precision
        self.use_bias = use_bias
        self.attention_fn = attention_fn
        self.decode = decode
        self.normalize_qk = normalize_qk
        # read back as flax's module keeps them
        self.qkv_promote_dtype = qkv_promote_dtype
        self.out_promote_dtype = out_promote_dtype
        self.ln_promote_dtype = ln_promote_dtype
        self.qkv_dot_general = qkv_dot_general
        self.out_dot_general = out_dot_general
        self.qkv_dot_general_cls = qkv_dot_general_cls
        self.out_dot_general_cls = out_dot_general_cls
        self.is_causal = is_causal
        self.window = window
        self.score = score
        self.score_mod = score_mod
        self.use_sinks = use_sinks
        self.implementation = implementation
        self.projection_activation = projection_activation

        # flax's projections, created in flax's order so that they draw flax's values.
        linear_general = functools.partial(
            nnx.LinearGeneral, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
            bias_init=bias_init, use_bias=use_bias, precision=precision,
            promote_dtype=qkv_promote_dtype, dot_general=qkv_dot_general,
            dot_general_cls=qkv_dot_general_cls, kernel_metadata=kernel_metadata,
            bias_metadata=bias_metadata, rngs=rngs)
        self.query = linear_general(in_features, out_features=(num_heads, self.head_dim))
        self.key = linear_general(self.in_kv_features,
                                  out_features=(self.num_kv_heads, self.head_dim))
        self.value = linear_general(self.in_kv_features,
                                    out_features=(self.num_kv_heads, self.head_dim))
        if normalize_qk:
            # Normalised queries and keys train stably at higher learning rates (ViT-22B).
            layer_norm = functools.partial(
                nnx.LayerNorm, self.head_dim, use_bias=False, dtype=dtype,
                param_dtype=param_dtype, promote_dtype=ln_promote_dtype, rngs=rngs)
            self.query_ln = layer_norm(scale_metadata=query_ln_scale_metadata)
            self.key_ln = layer_norm(scale_metadata=key_ln_scale_metadata)
        else:
            self.query_ln = nnx.data(None)
            self.key_ln = nnx.data(None)
        self.out = nnx.LinearGeneral(
            in_features=(num_heads, self.head_dim), out_features=self.out_features,
            axis=(-2, -1), kernel_init=out_kernel_init or kernel_init,
            bias_init=out_bias_init or bias_init, use_bias=use_bias, dtype=dtype,
            param_dtype=param_dtype, precision=precision, promote_dtype=out_promote_dtype,
            dot_general=out_dot_general, dot_general_cls=out_dot_general_cls, rngs=rngs,
            kernel_metadata=out_kernel_metadata or kernel_metadata,
            bias_metadata=out_bias_metadata or bias_metadata)
        self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None

        # attnjax's parameters, after all of flax's.
        # The default zeros draw no key: the parameters after them keep their values.
        self.sinks = (nnx.Param(jnp.zeros((num_heads,), param_dtype) if sinks_init is None
                                else sinks_init(rngs.params(), (num_heads,), param_dtype),
                                **sinks_metadata) if use_sinks else nnx.data(None))
        for name, (init, shape) in alignment_params(score, num_heads, self.head_dim).items():
            setattr(self, name, nnx.Param(init(rngs.params(), shape, param_dtype)))

        self.cached_key = nnx.data(None)
        self.cached_value = nnx.data(None)
        self.cache_index = nnx.data(None)

    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
                 deterministic: bool | None = None, rngs=None, sow_weights: bool = False,
                 decode: bool | None = None, is_causal: bool = False, out_sharding=None,
                 qkv_sharding=None, **attention_options):
        """inputs_q `[batch..., T, in_features]`, inputs_k `[batch..., S,
        in_kv_features]` (default inputs_q), inputs_v (default inputs_k) ->
        `[batch..., T, out_features]`.

        mask: broadcastable to `[batch..., N, T, S]`, bool or flax's float/int 0/1
        (nonzero = attend), or an `attnjax.Mask`. deterministic, rngs, decode: as in
        flax (the call's take precedence over the module's). is_causal: or'ed with the
        module's. sow_weights: the `[batch..., N, T, S]` weights as the nnx.Intermediate
        "attention_weights", as flax sows them (collect them with
        `nnx.capture(module, nnx.Intermediate)`). attention_options: any other keyword of
        `attnjax.dot_product_attention` (bias, query_lengths, positions, score_mod,
        sinks, causal_alignment, ...), but one the module's fields set (score_mod, sinks
        with use_sinks, scale with score="dot"): a ValueError; with several batch axes
        its per-example arrays (and a Mask's) are laid out over their flattened
        product."""
        if rngs is None:
            rngs = self.rngs
        elif isinstance(rngs, rnglib.Rngs):
            rngs = rngs.dropout
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError(
                    "`inputs_k` cannot be None if `inputs_v` is not None. To have both "
                    "`inputs_k` and `inputs_v` be the same value, pass in the value to "
                    "`inputs_k` and leave `inputs_v` as None.")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        self._check_inputs(inputs_q, inputs_k, inputs_v)

        # [batch..., T, N, H]
        query = self.query(inputs_q, out_sharding=qkv_sharding)
        # [batch..., S, K, H]
        key = self.key(inputs_k, out_sharding=qkv_sharding)
        value = self.value(inputs_v, out_sharding=qkv_sharding)
        query, key, value = multi_head.activate_projections(
            self.projection_activation, query, key, value)
        if self.normalize_qk:
            query = self.query_ln(query)
            key = self.key_ln(key)

        decode = first_from(
            decode, self.decode,
            error_msg="No `decode` argument was provided to MultiHeadAttention as either "
                      "a __call__ argument, class attribute, or nnx.flag.")
        # the cache is written once the call has run: a call refused on the way (a
        # mask of the wrong shape, say) leaves it as it was
        cached = self._append(key, value) if decode else None
        if cached is not None:
            key, value = cached.key, cached.value

        dropout_rate, dropout_rng = 0.0, None
        if self.dropout_rate > 0.0:
            deterministic = first_from(
                deterministic, self.deterministic,
                error_msg="No `deterministic` argument was provided to MultiHeadAttention "
                          "as either a __call__ argument, class attribute, or nnx.flag.")
            if not deterministic:
                _checks.check_module_dropout(self.dropout_rate)
                if rngs is None:
                    raise ValueError("'rngs' must be provided to __call__ method if "
                                     "MultiHeadAttention instance is defined with "
                                     "keep_rngs=False.")
                dropout_rate, dropout_rng = self.dropout_rate, rngs()

        replaced_by = flax_attention_reason(query.dtype, self.attention_fn is not None,
                                            "attention_fn replaces")
        if replaced_by is None:
            heads = self._engine(query, key, value, mask, cached, is_causal, dropout_rate,
                                 dropout_rng, sow_weights, attention_options)
        else:
            heads = self._flax_attention(query, key, value, mask, cached, is_causal,
                                         dropout_rate, dropout_rng, sow_weights,
                                         attention_options, replaced_by)
        if out_sharding is None:
            # heads split in their types, and the kernel with them (Megatron's layout):
            # the sum over them goes sharded as the batch (flax's is jax's error)
            out_sharding = multi_head.summed_sharding(
                heads, self.out.kernel[...], (heads.ndim - 2, heads.ndim - 1), (0, 1))
        # [batch..., T, F]
        out = self.out(heads, out_sharding=out_sharding)
        if cached is not None:
            # whole values replaced, not written into: the caches then take the keys'
            # sharding where it is in their type (`kv_cache.append`)
            for variable, value in ((self.cached_key, cached.key),
                                    (self.cached_value, cached.value),
                                    (self.cache_index, cached.index)):
                write_cache(variable, value)
        return out

    def _check_inputs(self, inputs_q, inputs_k, inputs_v) -> None:
        for name, x, features, field in (
                ("inputs_q", inputs_q, self.in_features, "in_features"),
                ("inputs_k", inputs_k, self.in_kv_features, "in_kv_features"),
                ("inputs_v", inputs_v, self.in_kv_features, "in_kv_features")):
            if jnp.ndim(x) < 2 or jnp.shape(x)[-1] != features:
                raise ValueError(
                    f"{name} must have shape [batch..., length, {field}={features}]; got "
                    f"{_checks.shape_str(jnp.shape(x))}")
        q, k, v = (jnp.shape(x) for x in (inputs_q, inputs_k, inputs_v))
        if not q[:-2] == k[:-2] == v[:-2] or k[-2] != v[-2]:
            raise ValueError(
                "inputs_q [batch..., T, D], inputs_k [batch..., S, Dk] and inputs_v "
                "[batch..., S, Dv] must share the batch axes, and inputs_k and inputs_v S; "
                f"got {_checks.shape_str(q)}, {_checks.shape_str(k)}, {_checks.shape_str(v)}")

    def _append(self, key, value) -> kv_cache.Appended:
        if self.cached_key is None or self.cached_value is None or self.cache_index is None:
            raise ValueError("Autoregressive cache not initialized, call ``init_cache`` first.")
        return kv_cache.append(self.cached_key[...], self.cached_value[...],
                               self.cache_index[...], key, value)

    def _engine(self, query, key, value, mask, cached, is_causal, dropout_rate, dropout_rng,
                sow_weights, attention_options):
        alignment = None
        if self.score in ("general", "additive"):
            alignment = alignment_of(self.score, {
                name: getattr(self, name)[...]
                for name in alignment_params(self.score, self.num_heads, self.head_dim)},
                query.dtype)
        heads, weights = engine_attention(
            query, key, value, mask, cached, is_causal=self.is_causal or is_causal,
            window=self.window, score=self.score, alignment=alignment,
            sinks=None if self.sinks is None else self.sinks[...], score_mod=self.score_mod,
            dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            broadcast_dropout=self.broadcast_dropout, return_weights=sow_weights,
            implementation=self.implementation, precision=self.precision,
            attention_options=attention_options)
        if sow_weights:
            self.sow(nnx.Intermediate, "attention_weights", weights)
        return heads

    def _flax_attention(self, query, key, value, mask, cached, is_causal, dropout_rate,
                        dropout_rng, sow_weights, attention_options, replaced_by: str):
        """attention_fn (flax's own for complex inputs) called as flax.nnx calls it."""
        check_flax_signature(self, attention_options, mask, replaced_by)
        if cached is not None:
            mask = nnx.combine_masks(mask, kv_cache.filled_slots(cached, query.shape[:-3]))
        return (self.attention_fn or nnx.dot_product_attention)(
            query, key, value, mask=mask, dropout_rng=dropout_rng,
            dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout,
            deterministic=dropout_rate == 0.0, dtype=self.dtype, precision=self.precision,
            module=self if sow_weights else None, is_causal=is_causal)

    def init_cache(self, input_shape, dtype: Any = jnp.float32):
        """Size the KV cache for inputs of `input_shape` `[batch..., L, features]`:
        cached_key and cached_value `[batch..., L, K, H]` of zeros and cache_index 0."""
        try:
            shape = tuple(int(d) for d in np.asarray(input_shape).reshape(-1))
            ints = np.issubdtype(np.asarray(input_shape).dtype, np.integer)
        except (TypeError, ValueError):
            shape, ints = (), False
        if not ints or np.ndim(input_shape) != 1 or len(shape) < 2 or min(shape) < 1:
            raise ValueError(f"input_shape must be the inputs' shape [batch..., L, features] "
                             f"(positive ints, as x.shape); got {input_shape!r}")
        cache_shape = (*shape[:-1], self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(cache_shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(cache_shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
                 batch_size: int | tuple[int, ...] | None = None,
                 max_length: int | None = None):
        """flax's hook for `nnx.view`: sets deterministic and decode; with batch_size
        and max_length, sizes a cache that `init_cache` has not."""
        sizes = decode is not None and self.cached_key is None and (
            (batch_size, max_length) != (None, None))
        if sizes and (batch_size is None or max_length is None):   # before any change
            missing = "batch_size" if batch_size is None else "max_length"
            raise TypeError(f"'{missing}' must be provided when initializing cache.")
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is not None:
            self.decode = decode
            if sizes:
                batch = (batch_size,) if np.ndim(batch_size) == 0 else tuple(batch_size)
                self.init_cache((*batch, max_length, self.in_features),
                                self.dtype or jnp.float32)
