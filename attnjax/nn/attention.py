"""`MultiHeadDotProductAttention`: flax.linen's multi-head attention on attnjax's functions.

A drop-in for `flax.linen.MultiHeadDotProductAttention` (and `MultiHeadAttention`): the
same fields, call arguments, defaults, errors, parameter tree, auto-name and KV cache.
The module holds the parameters and the cache; projections and attention are
`attnjax.multi_head.project` and `attnjax.dot_product_attention`, the cache's logic is
`attnjax.kv_cache`. `engine_attention` and the helpers below it are what this module and
`attnjax.nnx.MultiHeadAttention` share.
"""

import contextlib
import contextvars
import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import errors as flax_errors
from jax import lax

from attnjax import _checks, kv_cache, masks, multi_head, scores
from attnjax.attention import dot_product_attention

SCORES = ("scaled_dot", "dot", "general", "additive")
# the alignments with parameters of their own: the dense kernel runs them
LEARNED_SCORES = ("general", "additive")


def check_score(score: str, implementation: str | None, name: str = "score") -> None:
    """A ValueError unless `score` is one of SCORES, and a learned one is asked of the
    dense kernel (implementation None, jax.nn's "xla" or "dense"); name: the score's."""
    if score not in SCORES:
        raise ValueError(f"{name} must be one of {SCORES}; got {score!r}")
    if score in LEARNED_SCORES and implementation not in (None, "xla", "dense"):
        raise ValueError(f"{name}={score!r} is a learned alignment, which runs on "
                         f"implementation='dense' (or None); got "
                         f"implementation={implementation!r}")

# attnjax's own fields of both module APIs, at their defaults: what attention_fn (flax's
# signature) cannot take.
_ENGINE_FIELDS = {"is_causal": False, "window": None, "score_mod": None, "use_sinks": False,
                  "implementation": None, "score": "scaled_dot"}


class _Projection(nn.Module):
    """One projection as flax's DenseGeneral holds and applies it (its params
    {"kernel", "bias"}, initialised on the flattened shapes, and its dot_general); the
    maths is `attnjax.multi_head.project`."""

    features: tuple[int, ...]
    fan_in_axes: int
    use_bias: bool
    kernel_init: Callable
    bias_init: Callable
    param_dtype: Any
    precision: Any
    dot_general: Callable | None
    dot_general_cls: Any

    @nn.compact
    def __call__(self, x):
        fan_in = x.shape[x.ndim - self.fan_in_axes:]
        if self.has_variable("params", "kernel"):
            _check_input_width(self.name, x, nn.unbox(self.get_variable("params", "kernel")),
                               self.fan_in_axes)
        params = {"kernel": self.param(
            "kernel", multi_head.flat_fan_in_init(self.kernel_init, self.fan_in_axes),
            fan_in + self.features, self.param_dtype)}
        if self.use_bias:
            params["bias"] = self.param("bias", multi_head.flat_fan_in_init(self.bias_init, 0),
                                        self.features, self.param_dtype)
        # Instantiated here, as DenseGeneral does, so a module-valued dot_general (AQT)
        # lives in this projection's scope.
        if self.dot_general_cls is not None:
            dot_general = self.dot_general_cls()
        else:
            dot_general = self.dot_general or lax.dot_general
        return multi_head.project(params, x, self.fan_in_axes, precision=self.precision,
                                  dot_general=dot_general)


# The "cache" entries of a cache_key_value module: its projected keys and values.
PROJECTED_KEY_VALUE = ("projected_key", "projected_value")


def _kept(x):
    """`[batch..., S, K, H]` projected memory as kept, `[batch..., K, H, S]`: the layout
    the products read on a CPU, so XLA cancels this move against the kernel's and no
    step copies the memory.

    The barrier keeps XLA from carrying the old layout through a decoding loop
    instead, to transpose it at every step (it lifts no transpose out of a loop). It
    holds the array flattened: a reshape to one axis fixes the transposed order in
    memory, where a barrier on `[K, H, S]` left XLA free to keep `[S, K, H]` and copy
    it a second time for the cache (the dates model's first step: 23 -> 10 ms).
    """
    x = jnp.moveaxis(x, -3, -1)
    flat = lax.optimization_barrier(x.reshape(x.shape[:-3] + (-1,)))
    return flat.reshape(x.shape)


_PROJECTED = {"query": "inputs_q", "key": "inputs_k", "value": "inputs_v", "out": "the heads"}


class _InputWidthError(ValueError, flax_errors.ScopeParamShapeError):
    """A ValueError that names the input whose width the parameters do not take, and the
    error flax raises there (a parameter of another shape), for code that catches that."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)


def _check_input_width(name: str, x, kernel, fan_in_axes: int) -> None:
    """An input whose width does not match parameters that exist is named as the mistake
    (flax would blame the parameter's shape)."""
    width, got = tuple(kernel.shape[:fan_in_axes]), tuple(x.shape[x.ndim - fan_in_axes:])
    if got != width:
        given = _PROJECTED.get(name, f"the input of {name}")
        features = ("features" if fan_in_axes == 1 else
                    f"as its last {fan_in_axes} axes")
        show = (lambda d: str(d[0])) if fan_in_axes == 1 else _checks.shape_str  # noqa: E731
        raise _InputWidthError(
            f"{given} has {show(got)} {features}; the parameters of {name!r} take "
            f"{show(width)} (kernel {_checks.shape_str(kernel.shape)}). Pass {given} with "
            f"{show(width)}, or init the module on inputs with {show(got)}")


class MultiHeadDotProductAttention(nn.Module):
    """Multi-head attention with flax's fields, parameters, cache and auto-name.

    Every field of `flax.linen.MultiHeadDotProductAttention` (flax 0.12), with flax's
    meaning and default: num_heads, dtype (None: the promoted dtype of the inputs and
    param_dtype), param_dtype, qkv_features, out_features, broadcast_dropout,
    dropout_rate, deterministic, precision (the projections' and the attention's
    matmuls), kernel_init, out_kernel_init, bias_init, out_bias_init, use_bias,
    attention_fn, decode, normalize_qk (LayerNorms "query_ln" and "key_ln" without
    bias), force_fp32_for_softmax, qkv_dot_general, out_dot_general,
    qkv_dot_general_cls, out_dot_general_cls, qk_attn_weights_einsum_cls,
    attn_weights_value_einsum_cls.

    attention_fn=None (the default) runs attnjax's engine. Given an attention_fn, or
    either einsum class (which replace the engine's own products: they run in
    `flax.linen.dot_product_attention`), the attention is that function called as flax
    calls it, `attention_fn(query, key, value, mask=..., dropout_rng=...,
    dropout_rate=..., broadcast_dropout=..., deterministic=..., dtype=...,
    precision=..., force_fp32_for_softmax=..., qk_attn_weights_einsum=...,
    attn_weights_value_einsum=...)` filtered by its signature, plus module=self with
    sow_weights; attnjax's own fields below and attnjax.Mask masks are then errors.
    force_fp32_for_softmax is accepted: attnjax's softmax always runs in float32 for
    half-precision inputs; with it, as in flax, sown weights are float32 whatever
    dtype is (they carry the precision of dtype's weights).

    attnjax's own: num_kv_heads (K < N: grouped-query, 1: multi-query attention),
    is_causal (bottom-right aligned) and window (both read positions), score_mod
    (applied to every call's logits, see `attnjax.scores`), use_sinks (a learned `[N]`
    sink logit per head, parameter "sinks", drawn by sinks_init: zeros when None; wrap
    it in `nn.with_partitioning` to name its axis), implementation, and score:
    "scaled_dot" (default), "dot" (unscaled), "general" (q W_n kᵀ with a learned `[N, H, H]` W) or
    "additive" (v_nᵀ tanh(W_q q + W_k k) with learned `[N, H, H]`, `[N, H, H]`, `[N, H]`),
    and projection_activation: φ in q = φ_Q(X W^Q + b^Q) (likewise k, v), one callable
    for all three or a (φ_Q, φ_K, φ_V) triple (None: the identity), applied before
    normalize_qk and the cache.

    Where it differs from flax: a query that sees no key gets zeros (flax averages
    every value), dropout draws its masks differently (same distribution), and option
    errors are ValueErrors (flax asserts).

    With decode=True, `init` on a full-length input sizes the cache (flax's
    cached_key, cached_value `[batch..., L, K, H|V]` and cache_index), and each
    `apply(..., mutable=["cache"])` appends the new tokens: one at a time as in flax,
    or any number (a chunked prefill) that attend to everything cached so far
    (causally when is_causal). The cache describes itself by positions and its filled
    length, so a long cache decodes on the chunked kernel too.

    With cache_key_value=True (cross-attention to a fixed memory while decoding), the
    projected keys and values are kept in the "cache" collection as projected_key and
    projected_value `[batch..., K, H|V, S]` by the first call that may write it (not
    `init`, whose inputs only size the cache); a call that finds them there reuses them
    and does not read inputs_v (inputs_k of another shape is an error). The
    encoder–decoder's decoding (`attnjax.nn.greedy_decode`) projects its memory once
    this way. Their layout, the memory's positions last, is the one XLA's CPU products
    read, so that a decoding step does not copy them.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> mha = nn.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=2, is_causal=True)
        >>> x = jnp.ones((2, 6, 32))                                       # [B, T, D]
        >>> mha.apply(mha.init(jax.random.key(0), x), x).shape
        (2, 6, 32)
    """

    num_heads: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    qkv_features: int | None = None
    out_features: int | None = None
    broadcast_dropout: bool = True
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    precision: Any = None
    kernel_init: Callable = nn.initializers.lecun_normal()
    out_kernel_init: Callable | None = None
    bias_init: Callable = nn.initializers.zeros_init()
    out_bias_init: Callable | None = None
    use_bias: bool = True
    attention_fn: Callable | None = None
    decode: bool = False
    normalize_qk: bool = False
    force_fp32_for_softmax: bool = False
    qkv_dot_general: Callable | None = None
    out_dot_general: Callable | None = None
    qkv_dot_general_cls: Any = None
    out_dot_general_cls: Any = None
    qk_attn_weights_einsum_cls: Callable | None = None
    attn_weights_value_einsum_cls: Callable | None = None
    num_kv_heads: int | None = None
    is_causal: bool = False
    window: int | tuple[int, int] | None = None
    score_mod: Callable | None = None
    use_sinks: bool = False
    sinks_init: Callable | None = None
    implementation: str | None = None
    score: str = "scaled_dot"
    projection_activation: Callable | tuple | None = None
    cache_key_value: bool = False

    @nn.compact
    def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, inputs_kv=None, mask=None,
                 deterministic=None, dropout_rng=None, sow_weights=False,
                 **attention_options):
        """inputs_q `[batch..., T, D]`, inputs_k `[batch..., S, Dk]` (default inputs_q),
        inputs_v `[batch..., S, Dv]` (default inputs_k) -> `[batch..., T, F]`.

        inputs_kv: flax's deprecated name for inputs_k = inputs_v (not with either).
        mask: broadcastable to `[batch..., N, T, S]`, bool or flax's float/int 0/1
        (nonzero = attend), or an `attnjax.Mask`; combined with is_causal and window.
        sow_weights: store the `[batch..., N, T, S]` weights in the "intermediates"
        collection as "attention_weights", as flax does. attention_options: any other
        keyword of `attnjax.dot_product_attention` (bias, query_lengths, positions,
        score_mod, sinks, causal_alignment, ...), but one the module's fields set
        (score_mod, sinks with use_sinks, scale with score="dot"): a ValueError; with
        several batch axes its per-example arrays (and a Mask's) are laid out over their
        flattened product."""
        _checks.check_flags(
            broadcast_dropout=self.broadcast_dropout, use_bias=self.use_bias,
            decode=self.decode, normalize_qk=self.normalize_qk,
            force_fp32_for_softmax=self.force_fp32_for_softmax, is_causal=self.is_causal,
            use_sinks=self.use_sinks, cache_key_value=self.cache_key_value)
        _checks.check_sinks_init(self.use_sinks, self.sinks_init)
        inputs_q, inputs_k, inputs_v = _inputs(inputs_q, inputs_k, inputs_v, inputs_kv)
        # flax's dtype=None promotes with the parameters held (bfloat16 ones loaded into
        # a module declaring float32 compute in bfloat16, as flax's), else param_dtype
        held = [x.dtype for x in jax.tree.leaves(self.variables.get("params", {}))]
        dtype = self.dtype or _promoted_dtype((inputs_q, inputs_k, inputs_v),
                                              *(held or [self.param_dtype]))
        inputs_q, inputs_k, inputs_v = (x.astype(dtype) for x in (inputs_q, inputs_k, inputs_v))
        shapes = self._shapes(inputs_q.shape[-1], inputs_k.shape[-1], inputs_v.shape[-1])
        qkv = functools.partial(self._projection, dot_general=self.qkv_dot_general,
                                dot_general_cls=self.qkv_dot_general_cls)
        # [batch..., T, N, H]
        query = qkv(shapes["query"], name="query")(inputs_q)
        implementation = self.implementation
        if self.cache_key_value and self.has_variable("cache", PROJECTED_KEY_VALUE[0]):
            # [batch..., K, H, S], [batch..., K, V, S]: projected by an earlier call
            kept = [self.get_variable("cache", name) for name in PROJECTED_KEY_VALUE]
            if (inputs_k.shape[:-2], inputs_k.shape[-2]) != (kept[0].shape[:-3],
                                                             kept[0].shape[-1]):
                raise ValueError(
                    f"inputs_k {_checks.shape_str(inputs_k.shape)} is not the memory the "
                    f"cache keeps projected (batch {_checks.shape_str(kept[0].shape[:-3])}, "
                    f"S={kept[0].shape[-1]}): another memory is decoded from a cache "
                    f"without projected_key and projected_value")
            key, value = (jnp.moveaxis(x, -1, -3) for x in kept)
            query, _, _ = multi_head.activate_projections(
                self.projection_activation, query, key, value)
            if (implementation is None and query.shape[-3] == 1
                    and "block_sizes" not in attention_options):
                # One query reads the kept memory in place on the dense kernel; the
                # chunked kernel would copy it into blocks (2-7x slower on a CPU).
                implementation = "dense"
        else:
            # [batch..., S, K, H], [batch..., S, K, V]
            key = qkv(shapes["key"], name="key")(inputs_k)
            value = qkv(shapes["value"], name="value")(inputs_v)
            query, key, value = multi_head.activate_projections(
                self.projection_activation, query, key, value)
            if (self.cache_key_value and self.is_mutable_collection("cache")
                    and not self.is_initializing()):
                # kept [batch..., K, H|V, S] (see _kept); this call reads them too. Not
                # by init, which sizes the cache with a stand-in memory: the first call
                # that decodes projects the memory it is given.
                kept = [_kept(x) for x in (key, value)]
                for name, x in zip(PROJECTED_KEY_VALUE, kept):
                    self.put_variable("cache", name, x)
                key, value = (jnp.moveaxis(x, -1, -3) for x in kept)
        if self.normalize_qk:
            # Normalised queries and keys train stably at higher learning rates (ViT-22B).
            ln = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype,
                                   param_dtype=self.param_dtype)
            query = ln(name="query_ln")(query).astype(dtype)
            key = ln(name="key_ln")(key).astype(dtype)

        cached = self._update_cache(key, value) if self.decode else None
        if cached is not None:  # not the sizing call of `init`
            key, value = cached[:2]

        _checks.check_dropout_rate(self.dropout_rate, module=True)
        dropout_rate = 0.0
        if self.dropout_rate > 0.0 and not nn.merge_param(
                "deterministic", self.deterministic, deterministic):
            dropout_rate = _checks.check_module_dropout(self.dropout_rate)
            if dropout_rng is None:
                dropout_rng = self.make_rng("dropout")

        replaced_by = flax_attention_reason(
            dtype, self.attention_fn is not None or self._einsum_classes(),
            "attention_fn and qk_attn_weights_einsum_cls/attn_weights_value_einsum_cls "
            "replace")
        if replaced_by is None:
            heads = self._engine(query, key, value, mask, cached, dropout_rate, dropout_rng,
                                 sow_weights, dtype, implementation, attention_options)
            if (self.force_fp32_for_softmax and self.dtype is None
                    and heads.dtype in (jnp.bfloat16, jnp.float16)):
                # flax's float32 weights promote its weighted sum, and with dtype=None
                # its out projection: the output is float32 where the inputs are halves
                heads = heads.astype(jnp.float32)
        else:
            heads = self._flax_attention(query, key, value, mask, cached, dropout_rate,
                                         dropout_rng, sow_weights, attention_options,
                                         replaced_by)
        # [batch..., T, F]
        return self._projection(
            shapes["out"], dot_general=self.out_dot_general,
            dot_general_cls=self.out_dot_general_cls,
            kernel_init=self.out_kernel_init or self.kernel_init,
            bias_init=self.out_bias_init or self.bias_init, name="out")(heads)

    def _shapes(self, d_q: int, d_k: int, d_v: int):
        check_score(self.score, self.implementation)
        shapes = multi_head.projection_shapes(
            d_q, self.num_heads, qkv_features=self.qkv_features, out_features=self.out_features,
            num_kv_heads=self.num_kv_heads, kv_features=d_k)
        shapes["value"] = ((d_v,), shapes["value"][1])  # inputs_v may be narrower or wider
        return shapes

    def _projection(self, shape, *, dot_general, dot_general_cls, name, kernel_init=None,
                    bias_init=None) -> _Projection:
        fan_in, fan_out = shape
        return _Projection(fan_out, len(fan_in), self.use_bias, kernel_init or self.kernel_init,
                           bias_init or self.bias_init, self.param_dtype, self.precision,
                           dot_general, dot_general_cls, name=name)

    def _einsum_classes(self) -> bool:
        return (self.qk_attn_weights_einsum_cls is not None
                or self.attn_weights_value_einsum_cls is not None)

    def _engine(self, query, key, value, mask, cached, dropout_rate, dropout_rng,
                sow_weights, dtype, implementation, attention_options):
        """attnjax's engine on the module's parameters and fields."""
        sinks = None
        if self.use_sinks:
            sinks = self.param("sinks", self.sinks_init or nn.initializers.zeros_init(),
                               (self.num_heads,), self.param_dtype)
        alignment = None
        if self.score in ("general", "additive"):
            alignment = alignment_of(self.score, {
                name: self.param(name, init, shape, self.param_dtype) for name, (init, shape)
                in alignment_params(self.score, self.num_heads, query.shape[-1]).items()}, dtype)
        heads, weights = engine_attention(
            query, key, value, mask, cached, is_causal=self.is_causal, window=self.window,
            score=self.score, alignment=alignment, sinks=sinks, score_mod=self.score_mod,
            dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            broadcast_dropout=self.broadcast_dropout, return_weights=sow_weights,
            implementation=implementation, precision=self.precision,
            attention_options=attention_options)
        if sow_weights:
            if self.force_fp32_for_softmax and dtype != jnp.float32:
                weights = weights.astype(jnp.float32)  # flax's weights are float32 then
            self.sow("intermediates", "attention_weights", weights)
        return heads

    def _flax_attention(self, query, key, value, mask, cached, dropout_rate, dropout_rng,
                        sow_weights, attention_options, replaced_by: str):
        """flax's attention call: attention_fn (or flax's own, for the einsum classes and
        complex inputs) with flax's keywords, filtered by its signature."""
        check_flax_signature(self, attention_options, mask, replaced_by)
        if key.shape[-2] != query.shape[-2]:
            raise ValueError(f"{replaced_by} attnjax's engine with flax's attention signature, "
                             f"which takes as many key/value heads as query heads; got "
                             f"num_kv_heads={self.num_kv_heads} for num_heads={self.num_heads}")
        if cached is not None:
            mask = nn.combine_masks(mask, kv_cache.filled_slots(cached, query.shape[:-3]))
        attention_fn = self.attention_fn or nn.dot_product_attention
        kwargs = dict(
            mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
            broadcast_dropout=self.broadcast_dropout, deterministic=dropout_rate == 0.0,
            dtype=self.dtype, precision=self.precision,
            force_fp32_for_softmax=self.force_fp32_for_softmax,
            qk_attn_weights_einsum=(self.qk_attn_weights_einsum_cls()
                                    if self.qk_attn_weights_einsum_cls else None),
            attn_weights_value_einsum=(self.attn_weights_value_einsum_cls()
                                       if self.attn_weights_value_einsum_cls else None))
        accepted = inspect.signature(attention_fn).parameters
        kwargs = {name: x for name, x in kwargs.items() if name in accepted}
        if sow_weights:
            return attention_fn(query, key, value, **kwargs, module=self)
        return attention_fn(query, key, value, **kwargs)

    def _update_cache(self, key, value) -> kv_cache.Appended | None:
        """Append the new keys/values `[batch..., T, K, ·]` to the "cache" collection
        (`attnjax.kv_cache.append`); None on the call that creates the cache."""
        initialised = self.has_variable("cache", "cached_key")
        # (zeros like the keys: sharded as they are where that is in their type)
        cached_key = self.variable("cache", "cached_key", jnp.zeros_like, key)
        cached_value = self.variable("cache", "cached_value", jnp.zeros_like, value)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not initialised:
            return None
        appended = kv_cache.append(cached_key.value, cached_value.value, index.value, key, value)
        cached_key.value, cached_value.value, index.value = appended[:3]
        return appended


class MultiHeadAttention(MultiHeadDotProductAttention):
    """`MultiHeadDotProductAttention` under flax's other name.

    `MultiHeadDotProductAttention` under flax's other name: identical, but
    auto-named `MultiHeadAttention_{i}` inside a parent, as flax's
    `nn.MultiHeadAttention` is, so either flax class swaps for its namesake here.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> mha = nn.MultiHeadAttention(num_heads=4)
        >>> x = jnp.ones((2, 6, 32))                                       # [B, T, D]
        >>> mha.apply(mha.init(jax.random.key(0), x), x).shape
        (2, 6, 32)
    """


class SelfAttention(MultiHeadDotProductAttention):
    """flax's deprecated `SelfAttention`: attention of inputs_q to itself.

    `MultiHeadDotProductAttention` called on inputs_q alone, whose keys and values come
    from it too; auto-named `SelfAttention_{i}`, with flax's DeprecationWarning at each
    call. New code calls `MultiHeadDotProductAttention(...)(inputs_q)`.

    Examples:
        >>> import warnings
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> layer = nn.SelfAttention(num_heads=4, is_causal=True)
        >>> x = jnp.ones((2, 6, 32))                                       # [B, T, D]
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", DeprecationWarning)
        ...     layer.apply(layer.init(jax.random.key(0), x), x).shape
        (2, 6, 32)
    """

    @nn.compact
    def __call__(self, inputs_q, mask=None, deterministic=None,  # type: ignore[override]
                 dropout_rng=None, sow_weights=False, **attention_options):
        """inputs_q `[batch..., T, D]` -> `[batch..., T, F]`; mask and the rest as
        `MultiHeadDotProductAttention.__call__`'s (flax's order: mask may come second)."""
        warnings.warn("SelfAttention will be deprecated soon. Use "
                      "`MultiHeadDotProductAttention.__call__(inputs_q)` instead. See "
                      "https://github.com/google/flax/discussions/3389 for more information.",
                      DeprecationWarning, stacklevel=2)
        return super().__call__(inputs_q, mask=mask, deterministic=deterministic,
                                dropout_rng=dropout_rng, sow_weights=sow_weights,
                                **attention_options)


def _inputs(inputs_q, inputs_k, inputs_v, inputs_kv):
    """The three inputs by flax's rules for the key and value inputs, their shapes
    checked."""
    if inputs_kv is not None:
        if inputs_k is not None or inputs_v is not None:
            raise ValueError(
                "If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be None "
                "(flax's rule; inputs_kv is deprecated: pass inputs_k, and inputs_v if it "
                f"differs); got inputs_kv and {'inputs_k' if inputs_k is not None else 'inputs_v'}")
        warnings.warn("The inputs_kv arg will be deprecated soon. Use inputs_k and inputs_v "
                      "instead. See https://github.com/google/flax/discussions/3389 for "
                      "more information.", DeprecationWarning, stacklevel=3)
        inputs_k = inputs_v = inputs_kv
    elif inputs_k is None:
        if inputs_v is not None:
            raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None "
                             "(flax's rule): pass the keys as inputs_k, or inputs_k alone "
                             "for keys = values; got inputs_v only")
        inputs_k = inputs_q
    elif inputs_v is not None and inputs_v.shape[-1] == inputs_v.shape[-2]:
        warnings.warn(
            f"You are passing an array of shape {inputs_v.shape} to the `inputs_v` arg, "
            "when you may have intended to pass it to the `mask` arg. As of Flax version "
            "0.7.4, the function signature of MultiHeadDotProductAttention's `__call__` "
            "method has changed to `__call__(inputs_q, inputs_k=None, inputs_v=None, *, "
            "inputs_kv=None, mask=None, deterministic=None)`. Use the kwarg `mask` "
            "instead.", DeprecationWarning, stacklevel=3)
        # flax's old positional mask: left to fail where flax's does, in the value
        # projection's parameter shape or in the attention's shapes
        return tuple(jnp.asarray(x) for x in (inputs_q, inputs_k, inputs_v))
    inputs_v = inputs_k if inputs_v is None else inputs_v
    inputs = [jnp.asarray(x) for x in (inputs_q, inputs_k, inputs_v)]
    for name, x in zip(("inputs_q", "inputs_k", "inputs_v"), inputs):
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape [batch..., length, features]; got "
                             f"{_checks.shape_str(x.shape)}")
    q, k, v = inputs
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            "inputs_q [batch..., T, D], inputs_k [batch..., S, Dk] and inputs_v "
            "[batch..., S, Dv] must share the batch axes, and inputs_k and inputs_v S; "
            f"got {_checks.shape_str(q.shape)}, {_checks.shape_str(k.shape)}, "
            f"{_checks.shape_str(v.shape)}")
    return q, k, v


def _promoted_dtype(arrays, *param_dtypes):
    """flax's dtype=None: the inputs' and the parameters' dtypes promoted together, by
    jax's standard rules (flax's promote_dtype) whatever the caller's promotion mode."""
    with jax.numpy_dtype_promotion("standard"):
        return functools.reduce(jnp.promote_types,
                                [x.dtype for x in arrays] + list(param_dtypes))


def _flat_mask(mask, batch: tuple[int, ...]):
    """A flax mask broadcastable to `[batch..., N, T, S]` (bool, or float/int where
    nonzero attends) as attnjax's bool mask over one batch axis `[B|1, N|1, T|1, S|1]`."""
    mask = _checks.nonzero_attends("mask", jnp.asarray(mask))
    if len(batch) <= 1 or mask.ndim <= 3:
        return mask
    leading = mask.shape[:-3]
    if len(leading) > len(batch) or any(
            d not in (1, b) for d, b in zip(leading[::-1], batch[::-1])):
        raise ValueError(
            f"mask must be broadcastable to [batch..., N, T, S] with batch axes "
            f"{_checks.shape_str(batch)}; got {_checks.shape_str(mask.shape)}")
    mask = mask.reshape((1,) * (len(batch) - len(leading)) + mask.shape)
    # [batch..., N|1, T|1, S|1] -> [B, N|1, T|1, S|1]
    mask = jnp.broadcast_to(mask, batch + mask.shape[-3:])
    return mask.reshape((-1,) + mask.shape[-3:])


def _precision_name(precision) -> str:
    """The name `jax.default_matmul_precision` takes for one of flax's precisions: a
    `lax.Precision` or any string it takes ("fastest", "bfloat16", ...: its name), or a
    `DotAlgorithmPreset` (or a preset's name)."""
    if isinstance(precision, lax.Precision):
        return precision.name.lower()
    if isinstance(precision, lax.DotAlgorithmPreset):
        return "default" if precision == lax.DotAlgorithmPreset.DEFAULT else precision.name
    if isinstance(precision, str):
        if precision in lax.DotAlgorithmPreset.__members__:
            return _precision_name(lax.DotAlgorithmPreset[precision])
        try:
            return lax.Precision(precision).name.lower()
        except ValueError:
            raise ValueError(f"precision must name a jax.lax.Precision or a DotAlgorithmPreset; "
                             f"got {precision!r}") from None
    raise TypeError(f"precision must be None, a string, a jax.lax.Precision or a "
                    f"DotAlgorithmPreset; got {precision!r}")


def _matmul_precision(precision):
    """flax's `precision` for the engine's products, which run at jax's default matmul
    precision: a context that sets it (nothing when None)."""
    if precision is None:
        return contextlib.nullcontext()
    if isinstance(precision, (tuple, list)):
        names = [_precision_name(p) for p in precision]
        if len(names) != 2 or names[0] != names[1]:
            raise ValueError(
                "precision as a pair must name one precision twice for attnjax's engine "
                "(its products take one); got " + repr(precision))
        return jax.default_matmul_precision(names[0])
    return jax.default_matmul_precision(_precision_name(precision))


def flax_attention_reason(dtype, replaced: bool, replacer: str) -> str | None:
    """Why flax's attention call runs instead of attnjax's engine (the start of
    check_flax_signature's message), or None when the engine runs: the module's own
    replacement (replaced, described by replacer), or complex inputs, which attnjax's
    real kernels do not take and flax's attention does."""
    if replaced:
        return replacer
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return f"complex inputs ({jnp.dtype(dtype).name}) run in flax's attention instead of"
    return None


def check_flax_signature(module, attention_options, mask, replaced_by: str) -> None:
    """An attention function with flax's signature takes a mask array only: a module
    field of attnjax's own not at its default, any engine keyword or a Mask is an error."""
    engine_only = [f"{name}={getattr(module, name)!r}" for name, default in
                   _ENGINE_FIELDS.items() if getattr(module, name) != default]
    engine_only += [f"{name}=" for name in attention_options]
    if isinstance(mask, masks.Mask):
        engine_only.append(f"mask={mask!r}")
    if engine_only:
        raise ValueError(f"{replaced_by} attnjax's engine with flax's attention signature, "
                         "which takes a mask array only; got " + ", ".join(engine_only))


def alignment_params(score: str, num_heads: int, head_dim: int) -> dict:
    """{parameter name: (initialiser, shape)} of a learned score: "general" q W_n kᵀ, or
    "additive" v_nᵀ tanh(W_q q + W_k k), each per head; {} for the dot scores."""
    n, h = num_heads, head_dim
    init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    if score == "general":
        return {"score_w": (init, (n, h, h))}
    if score == "additive":
        return {"score_w_q": (init, (n, h, h)), "score_w_k": (init, (n, h, h)),
                "score_v": (nn.initializers.normal(1.0 / math.sqrt(h)), (n, h))}
    return {}


def alignment_of(score: str, params: dict, dtype):
    """The engine's (score_fn, per-head parameters) from `alignment_params`' values."""
    params = {name.removeprefix("score_"): p.astype(dtype) for name, p in params.items()}
    return (scores.general_score if score == "general" else scores.additive_score), params


def module_mask(mask, batch: tuple[int, ...], is_causal: bool, window) -> masks.Mask:
    """A module's is_causal and window and its call's mask (a flax array or a Mask), as
    one Mask over the flattened batch."""
    _checks.check_flag("is_causal", is_causal)
    visible = masks.everything()
    if isinstance(mask, masks.Mask):
        visible = mask
    elif mask is not None:
        visible = masks.from_array(_flat_mask(mask, batch))
    if is_causal:
        visible = visible & masks.causal()
    if window is not None:
        visible = visible & masks.window(*_checks.resolve_window(window))
    return visible


# What engine_attention calls: attnjax.dot_product_attention, or the function of an
# enclosing `attention_engine` (ring attention over a sequence-sharded mesh).
_ENGINE = contextvars.ContextVar("attnjax.nn engine", default=dot_product_attention)


@contextlib.contextmanager
def attention_engine(fn: Callable):
    """Within the block, every module's attention (linen and nnx, on attnjax's engine)
    calls `fn(query, key, value, **keywords)` with `attnjax.dot_product_attention`'s
    signature in its place. It applies when a model is traced: put it inside the
    function that jax.jit compiles, e.g.
    `with attention_engine(attnjax.parallel.context.ring_engine(mesh)): model.apply(...)`.
    """
    token = _ENGINE.set(fn)
    try:
        yield
    finally:
        _ENGINE.reset(token)


def engine_attention(query, key, value, mask, cached: kv_cache.Appended | None, *,
                     is_causal: bool, window, score: str, alignment, sinks, score_mod,
                     dropout_rate: float, dropout_rng, broadcast_dropout: bool,
                     return_weights: bool, implementation, precision, attention_options):
    """attnjax's engine as both module APIs call it, on `[batch..., ·, ·, ·]` projections
    with any number of batch axes (flattened into B for the engine): the heads
    `[batch..., T, N, V]` and, with return_weights, the weights `[batch..., N, T, S]`
    (else None). cached: the KV cache after this call's append."""
    batch = query.shape[:-3]
    visible = module_mask(mask, batch, is_causal, window)
    attention_options = dict(attention_options)
    if cached is not None:
        if attention_options.get("positions") is not None:
            raise ValueError("positions= cannot be given with decode=True: the "
                             "cache places new tokens at its own index")
        new = cached.positions[0].shape[-1]
        if query.shape[-3] != new:
            # (the queries are placed at the new keys' positions)
            raise ValueError(
                f"with decode=True, inputs_q and inputs_k hold the same new tokens: T="
                f"{query.shape[-3]} queries and S={new} keys appended to the cache (a "
                f"cross-attention to a fixed memory takes decode=False, and "
                f"cache_key_value=True to keep the memory projected)")
        visible = kv_cache.visible(visible, cached)
        attention_options["positions"] = cached.positions
    # the module's own options; the same option given at the call too is an error
    own = {"score_mod": (score_mod, f"score_mod={score_mod!r}"),
           "sinks": (sinks, "use_sinks=True"),
           "scale": (1.0 if score == "dot" else None, "score='dot'"),
           "alignment": (None if score == "dot" else alignment, f"score={score!r}")}
    for name, (setting, field) in own.items():
        if setting is None:
            continue
        if name in attention_options:
            raise ValueError(f"{name}= was given at the call of a module whose {field} "
                             f"sets it; give it in one place")
        attention_options[name] = setting
    if len(batch) > 1:
        # [B, T, N, H], [B, S, K, H], [B, S, K, V]
        query, key, value = (x.reshape((-1,) + x.shape[len(batch):])
                             for x in (query, key, value))
    with _matmul_precision(precision):
        result = _ENGINE.get()(
            query, key, value, mask=visible, dropout_rate=dropout_rate,
            dropout_rng=dropout_rng, dropout_broadcast=broadcast_dropout,
            return_weights=return_weights, implementation=implementation,
            **attention_options)
    heads, weights = result if return_weights else (result, None)
    if len(batch) > 1:
        # [batch..., T, N, V], weights [batch..., N, T, S]
        heads = heads.reshape(batch + heads.shape[1:])
        weights = None if weights is None else weights.reshape(batch + weights.shape[1:])
    return heads, weights
