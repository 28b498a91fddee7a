"""Layer 4: pure multi-head attention with flax's parameter tree.

    head_i = Attention(X_q W_i^Q, X_k W_i^K, X_v W_i^V),   MultiHead = Concat(head_1..h) W^O

The per-head W_i are held as one kernel with a head axis, exactly as
`flax.linen.MultiHeadDotProductAttention` holds them, so its checkpoints load unchanged:

    query: {kernel [D, N, H],  bias [N, H]}     key:   {kernel [Dk, K, H], bias [K, H]}
    value: {kernel [Dv, K, V], bias [K, V]}     out:   {kernel [N, V, F],  bias [F]}
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, ArrayLike, Float

from attnjax import _checks, heads
from attnjax.attention import dot_product_attention

Params = dict[str, dict[str, Array]]


def init_multi_head_attention(
    rng: Array,
    in_features: int,
    num_heads: int,
    *,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    kv_features: int | None = None,
    use_bias: bool = True,
    dtype=jnp.float32,
) -> Params:
    """Parameters for `multi_head_attention`, initialised as flax initialises its MHA.

    Args:
      rng: a `jax.random` key.
      in_features: D, the width of inputs_q.
      num_heads: N, the query heads.
      qkv_features: N·H, the width of the projected queries, keys and values; defaults
        to in_features and must be divisible by num_heads.
      out_features: F, the output width; defaults to in_features.
      num_kv_heads: K, the key/value heads (grouped-query attention); must divide
        num_heads; defaults to num_heads.
      kv_features: the width of inputs_k and inputs_v; defaults to in_features.
      use_bias: give every projection a bias.
      dtype: parameter dtype.

    Returns:
      `{"query", "key", "value", "out"}`, each `{"kernel", "bias"}` (`{"kernel"}` with
      use_bias=False; LeCun-normal kernels over the flattened fan-in, zero biases).

    Examples:
        >>> import jax, attnjax
        >>> params = attnjax.init_multi_head_attention(jax.random.key(0), 64, 8, num_kv_heads=2)
        >>> params["query"]["kernel"].shape, params["key"]["kernel"].shape   # [D, N, H], [D, K, H]
        ((64, 8, 8), (64, 2, 8))
    """
    _checks.check_flags(use_bias=use_bias)
    shapes = projection_shapes(
        in_features, num_heads, qkv_features=qkv_features, out_features=out_features,
        num_kv_heads=num_kv_heads, kv_features=kv_features)
    params = {}
    for rng_i, (name, (fan_in, fan_out)) in zip(jax.random.split(rng, 4), shapes.items()):
        params[name] = {"kernel": flat_fan_in_init(jax.nn.initializers.lecun_normal(), len(fan_in))(
            rng_i, fan_in + fan_out, dtype)}
        if use_bias:
            params[name]["bias"] = jnp.zeros(fan_out, dtype)
    return params


def projection_shapes(
    in_features: int,
    num_heads: int,
    *,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    kv_features: int | None = None,
) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(fan-in axes, fan-out axes) of each projection kernel, the options validated."""
    in_features = _checks.positive_int("in_features", in_features)
    num_heads = _checks.positive_int("num_heads", num_heads)
    qkv_features = _checks.positive_int(
        "qkv_features", in_features if qkv_features is None else qkv_features)
    out_features = _checks.positive_int(
        "out_features", in_features if out_features is None else out_features)
    kv_features = _checks.positive_int(
        "kv_features", in_features if kv_features is None else kv_features)
    num_kv_heads = _checks.positive_int(
        "num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads)
    if qkv_features % num_heads:
        raise ValueError(
            f"qkv_features must be divisible by num_heads; got qkv_features={qkv_features}, "
            f"num_heads={num_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads must divide num_heads; got num_kv_heads={num_kv_heads}, "
            f"num_heads={num_heads}"
        )
    head_dim = qkv_features // num_heads
    return {
        "query": ((in_features,), (num_heads, head_dim)),
        "key": ((kv_features,), (num_kv_heads, head_dim)),
        "value": ((kv_features,), (num_kv_heads, head_dim)),
        "out": ((num_heads, head_dim), (out_features,)),
    }


def flat_fan_in_init(init, fan_in_axes: int):
    """Initialise the flattened [fan_in, fan_out] matrix, as flax's DenseGeneral does, so
    variance-scaling initialisers see the true fan-in of a kernel with a head axis.
    fan_in_axes=0 flattens everything (a bias)."""
    def flat_init(key, shape, dtype):
        fan_in, fan_out = math.prod(shape[:fan_in_axes]), math.prod(shape[fan_in_axes:])
        flat = (fan_in, fan_out) if fan_in_axes else (fan_out,)
        value = init(key, flat, dtype)
        # A boxed value (flax's nn.with_partitioning) keeps its metadata, as in flax;
        # duck-typed so that this pure layer does not import flax. Its sharding is
        # the kernel's, not the flat matrix's: unboxed without it (flax's DenseGeneral
        # applies it to the matrix, which fails under jax.set_mesh for a kernel with
        # a head axis).
        if hasattr(value, "replace_boxed"):
            try:
                flat_value = value.unbox(apply_constraint=False)
            except TypeError:   # metadata whose unbox applies no constraint
                flat_value = value.unbox()
            return value.replace_boxed(jnp.reshape(flat_value, shape))
        return jnp.reshape(value, shape)
    return flat_init


def _check_params(params, inputs_q, inputs_k, inputs_v) -> dict:
    """The four projections' kernels and biases, checked, as arrays."""
    if not isinstance(params, Mapping) or not all(
        isinstance(params.get(name), Mapping) and "kernel" in params[name]
        for name in ("query", "key", "value", "out")
    ):
        got = list(params) if isinstance(params, Mapping) else type(params).__name__
        raise ValueError(
            "params must be {'query', 'key', 'value', 'out'}, each {'kernel'[, 'bias']} "
            f"(see init_multi_head_attention); got {got}"
        )
    params = {name: {leaf: _checks.as_array(f"params['{name}']['{leaf}']", x, required=True)
                     for leaf, x in params[name].items() if leaf in ("kernel", "bias")}
              for name in ("query", "key", "value", "out")}
    q_kernel = params["query"]["kernel"]
    for name in ("query", "key", "value", "out"):
        _checks.check_rank(f"params['{name}']['kernel']", params[name]["kernel"], (3,),
                           "[N, V, F]" if name == "out" else "[D, heads, head_dim]")
    for name, arg, x in (("query", "inputs_q", inputs_q), ("key", "inputs_k", inputs_k),
                         ("value", "inputs_v", inputs_v)):
        width = params[name]["kernel"].shape[0]
        if x.shape[-1] != width:  # the input is the likelier mistake: say so first
            raise ValueError(
                f"{arg} has {x.shape[-1]} features (its last axis, D); these parameters "
                f"project {width}: params['{name}']['kernel'] is "
                f"{_checks.shape_str(params[name]['kernel'].shape)} [D, heads, head_dim]. "
                f"Pass {arg} of shape [..., {width}], or parameters made for {x.shape[-1]} "
                f"features (init_multi_head_attention)")
    n, h = q_kernel.shape[1:]
    k = params["key"]["kernel"].shape[1]
    v = params["value"]["kernel"].shape[2]
    f = params["out"]["kernel"].shape[2]
    expected = {
        "query": ((inputs_q.shape[-1], n, h), "[D, N, H]", (n, h), "[N, H]"),
        "key": ((inputs_k.shape[-1], k, h), "[Dk, K, H]", (k, h), "[K, H]"),
        "value": ((inputs_v.shape[-1], k, v), "[Dv, K, V]", (k, v), "[K, V]"),
        "out": ((n, v, f), "[N, V, F]", (f,), "[F]"),
    }
    for name, (kernel_shape, kernel_layout, bias_shape, bias_layout) in expected.items():
        _checks.check_param_shape(f"params['{name}']['kernel']", params[name]["kernel"],
                                  kernel_shape, kernel_layout)
        if "bias" in params[name]:
            _checks.check_param_shape(f"params['{name}']['bias']", params[name]["bias"],
                                      bias_shape, bias_layout)
    return params


def _check_inputs(inputs_q, inputs_k, inputs_v) -> None:
    named = (("inputs_q", inputs_q), ("inputs_k", inputs_k), ("inputs_v", inputs_v))
    for name, x in named:
        _checks.check_rank(name, x, (2, 3), "[B, L, D] or [L, D]")
        _checks.check_floating(name, x)
        if x.ndim != inputs_q.ndim:
            raise ValueError(
                f"{name} must have the rank of inputs_q, {inputs_q.ndim}; got shape "
                f"{_checks.shape_str(x.shape)}"
            )
    _checks.check_same_dtype(inputs_q=inputs_q, inputs_k=inputs_k, inputs_v=inputs_v)
    if inputs_k.shape[:-1] != inputs_v.shape[:-1] or inputs_q.shape[:-2] != inputs_k.shape[:-2]:
        raise ValueError(
            "inputs_q [B, T, D], inputs_k [B, S, Dk] and inputs_v [B, S, Dv] must share B, "
            f"and inputs_k and inputs_v S; got {_checks.shape_str(inputs_q.shape)}, "
            f"{_checks.shape_str(inputs_k.shape)}, {_checks.shape_str(inputs_v.shape)}"
        )


def project(p: Mapping[str, ArrayLike], x: ArrayLike, fan_in_axes: int, *,
            precision=None, dot_general=lax.dot_general) -> Array:
    """x · kernel (+ bias), contracting x's last `fan_in_axes` axes with the kernel's
    first ones, in x's dtype: flax's DenseGeneral, whose `precision` and `dot_general`
    it takes. On a CPU, with lax.dot_general, the kernel's gradient is the plain product
    xᵀ · g over a held copy of xᵀ (`_product_read_transposed`)."""
    x = jnp.asarray(x)
    kernel = jnp.asarray(p["kernel"]).astype(x.dtype)
    # inputs made without the mesh in their type beside a kernel on it (Megatron's
    # layout, without jax.set_mesh): on the mesh, replicated, so that the inputs'
    # gradient, a sum over the kernel's split axes, has a sharding to take
    x = heads.on_mesh_of(x, kernel)
    if dot_general is lax.dot_general and _reads_transposed(x):
        y = _product_read_transposed(x, kernel, fan_in_axes, precision)
    else:
        y = _product(x, kernel, fan_in_axes, precision, dot_general)
    if "bias" in p:
        bias = jnp.asarray(p["bias"]).astype(x.dtype)
        y = y + bias.reshape((1,) * (y.ndim - bias.ndim) + bias.shape)
    return y


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **kwargs) -> Array:
    """`lax.dot_general` for flax's Dense layers, `nn.Dense(...,
    dot_general=multi_head.dot_general)`: on a CPU, a Dense that widens or keeps the
    width (fan-in <= fan-out) takes `project`'s kernel gradient, copying x transposed,
    where autodiff's form copies the wider cotangent; a narrowing one keeps autodiff's
    form, which copies the narrower side. Any other product is lax.dot_general's. The
    copy model's training step (its feed-forward layers, 128 -> 512 -> 128; 2-core CPU):
    37.5 -> 35.6 ms with the first layer's, 36.3 ms with both layers'."""
    (lhs_contract, rhs_contract), batch = dimension_numbers
    if (tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,)
            and batch == ((), ()) and rhs.ndim == 2 and rhs.shape[0] <= rhs.shape[1]
            and not kwargs
            and preferred_element_type in (None, lhs.dtype) and lhs.dtype == rhs.dtype
            and _reads_transposed(lhs)):
        return _product_read_transposed(lhs, rhs, 1, precision)
    return _dot(lhs, rhs, dimension_numbers, precision,
                preferred_element_type=preferred_element_type, **kwargs)


def _reads_transposed(x) -> bool:
    """Whether a product of x takes `_product_read_transposed`'s kernel gradient: on a
    CPU, in float32 or float64. In half precision XLA's CPU products run faster in
    autodiff's own form: one attention layer's bfloat16 training step at (B, T, D, N) =
    (32, 64, 128, 4), 9.8 -> 6.1 ms, 0.88-0.92x -> 1.16x flax's speed (2-core CPU)."""
    return jax.default_backend() == "cpu" and x.dtype not in (jnp.float16, jnp.bfloat16)


def _product(x, kernel, fan_in_axes: int, precision, dot_general=lax.dot_general):
    contract = tuple(range(x.ndim - fan_in_axes, x.ndim))
    dims = ((contract, tuple(range(fan_in_axes))), ((), ()))
    if dot_general is lax.dot_general:
        return _dot(x, kernel, dims, precision)
    return dot_general(x, kernel, dims, precision=precision)


def summed_sharding(lhs, rhs, lhs_contract, rhs_contract):
    """Where a product of no batch axes goes where contracted axes are sharded in their
    types (a mesh of Explicit axes: the output projection's heads and kernel split by
    heads, Megatron's layout), which jax asks: sharded as lhs's free axes and then rhs's
    (each mesh axis once), summed over the others. None where no contracted axis of lhs
    is sharded in its type (jax's own choice stands)."""
    specs = [heads.explicit_spec(x) for x in (lhs, rhs)]
    if None in specs:
        return None
    lhs_spec, rhs_spec = (tuple(spec) + (None,) * (x.ndim - len(spec))
                          for spec, x in zip(specs, (lhs, rhs)))
    if all(lhs_spec[a] is None for a in lhs_contract):
        return None
    entries, used = [], set()
    for spec, contract in ((lhs_spec, lhs_contract), (rhs_spec, rhs_contract)):
        for a, entry in enumerate(spec):
            names = set(entry if isinstance(entry, tuple) else (entry,)) - {None}
            if a not in contract:
                entries.append(None if names & used else entry)
                used |= names
    return heads.sharding(entries, lhs)


def _dot(lhs, rhs, dims, precision, **kwargs):
    """lax.dot_general(lhs, rhs, dims), the sum over sharded contracted axes going where
    `summed_sharding` says."""
    (lhs_contract, rhs_contract), batch = dims
    if batch == ((), ()) and "out_sharding" not in kwargs:
        out_sharding = summed_sharding(lhs, rhs, lhs_contract, rhs_contract)
        if out_sharding is not None:
            kwargs["out_sharding"] = out_sharding
    return lax.dot_general(lhs, rhs, dims, precision=precision, **kwargs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _product_read_transposed(x, kernel, fan_in_axes: int, precision):
    """x · kernel, whose kernel gradient reads x transposed, `[fan-in, rows]`, held as
    it is by a barrier: the kernel's cotangent is then a plain product xᵀ · g. Autodiff's
    own form contracts the rows, the leading axis of both operands, which XLA's CPU
    backend runs by copying g transposed for every projection and the product back; the
    projections of one x (self-attention's query, key and value) share the one copy of
    xᵀ. A causal training step at (B, T, D, N) = (32, 64, 128, 4), 2-core CPU: its
    copies and transposes 1.5 -> 0.75 ms of the 7.3 ms its operations take, flax / attnjax
    1.11-1.16x -> 1.15-1.21x (benchmarks/train_step.py's step, one shape per process).
    """
    return _product(x, kernel, fan_in_axes, precision)


def _product_read_transposed_jvp(fan_in_axes, precision, primals, tangents):
    x, kernel = primals
    d_x, d_kernel = tangents
    y = _product(x, kernel, fan_in_axes, precision)
    terms = []
    if not isinstance(d_x, SymbolicZero):
        terms.append(_product(d_x, kernel, fan_in_axes, precision))
    if not isinstance(d_kernel, SymbolicZero):  # a frozen kernel costs no copy of x
        fan_in = math.prod(kernel.shape[:fan_in_axes])
        # [fan-in, rows]. Each reshape here merges or splits the axes of one side only:
        # one of both is ambiguous to jax where x's batch is sharded in its type.
        rows = x.shape[:x.ndim - fan_in_axes]
        x_t = lax.optimization_barrier(x.reshape(rows + (fan_in,)).reshape(-1, fan_in).T)
        # [rows, fan-out], then its rows split, then its fan-out
        d_y = _dot(x_t, d_kernel.reshape(fan_in, -1), (((0,), (0,)), ((), ())), precision)
        terms.append(d_y.reshape(rows + d_y.shape[-1:]).reshape(y.shape))
    return y, sum(terms[1:], terms[0]) if terms else jnp.zeros_like(y)


_product_read_transposed.defjvp(_product_read_transposed_jvp, symbolic_zeros=True)


def project_query(params: Mapping[str, Mapping[str, ArrayLike]], inputs_q: ArrayLike) -> Array:
    """`[B, T, D]` -> queries `[B, T, N, H]` with params["query"]."""
    return project(params["query"], inputs_q, 1)


def project_key_value(
    params: Mapping[str, Mapping[str, ArrayLike]], inputs_k: ArrayLike, inputs_v: ArrayLike
) -> tuple[Array, Array]:
    """`[B, S, Dk]`, `[B, S, Dv]` -> keys `[B, S, K, H]` and values `[B, S, K, V]`."""
    return project(params["key"], inputs_k, 1), project(params["value"], inputs_v, 1)


def combine_heads(params: Mapping[str, Mapping[str, ArrayLike]], heads: ArrayLike) -> Array:
    """Concat(head_1..h) W^O: `[B, T, N, V]` -> `[B, T, F]` with params["out"]."""
    return project(params["out"], heads, 2)


def projection_activations(projection_activation) -> tuple[Callable, Callable, Callable]:
    """(φ_Q, φ_K, φ_V) from one callable (all three), a triple of callables or None
    (each None is the identity)."""
    if projection_activation is None or callable(projection_activation):
        return (projection_activation or _identity,) * 3
    if (isinstance(projection_activation, (tuple, list)) and len(projection_activation) == 3
            and all(phi is None or callable(phi) for phi in projection_activation)):
        return tuple(phi or _identity for phi in projection_activation)
    raise TypeError("projection_activation must be None, a callable or a (phi_q, phi_k, "
                    f"phi_v) triple of callables or None; got {projection_activation!r}")


def _identity(x):
    return x


def activate_projections(projection_activation, query, key, value) -> tuple[Array, Array, Array]:
    """q = φ_Q(query), k = φ_K(key), v = φ_V(value): the projections as time-distributed
    feed-forward layers with their own activations (see `projection_activations`)."""
    phi_q, phi_k, phi_v = projection_activations(projection_activation)
    return phi_q(query), phi_k(key), phi_v(value)


def multi_head_attention(
    params: Mapping[str, Mapping[str, ArrayLike]],
    inputs_q: Float[ArrayLike, "*B T D"],
    inputs_k: Float[ArrayLike, "*B S Dk"] | None = None,
    inputs_v: Float[ArrayLike, "*B S Dv"] | None = None,
    *,
    projection_activation: Callable | tuple | None = None,
    **attention_options,
) -> Float[ArrayLike, "*B T F"] | tuple[Array, ...]:
    """Multi-head attention: project per head, attend, mix the heads with W^O.

    Args:
      params: from `init_multi_head_attention`, or a flax
        `MultiHeadDotProductAttention`'s `variables["params"]`.
      inputs_q: `[B, T, D]` (or `[T, D]`).
      inputs_k: `[B, S, Dk]`; defaults to inputs_q (self-attention).
      inputs_v: `[B, S, Dv]`; defaults to inputs_k.
      projection_activation: φ in q = φ_Q(X_q W^Q + b^Q), k = φ_K(X_k W^K + b^K),
        v = φ_V(X_v W^V + b^V): one callable for all three, or a (φ_Q, φ_K, φ_V) triple
        (None entries: the identity); default None, the identity (plain linear maps).
      **attention_options: any keyword of `attnjax.dot_product_attention` (mask — a
        bool array or an `attnjax.Mask` —, bias, is_causal, query_lengths, key_lengths,
        window, positions, score_mod, sinks, dropout_rate, dropout_rng, return_weights,
        implementation, scale, ...), passed through.

    Returns:
      `[B, T, F]` in inputs_q's dtype (parameters are cast to it); with
      return_weights / return_residual, followed by the weights `[B, N, T, S]` / the
      log-sum-exp `[B, T, N]`, as `dot_product_attention` returns them.

    Examples:
        >>> import jax, jax.numpy as jnp, attnjax
        >>> params = attnjax.init_multi_head_attention(jax.random.key(0), 64, 8)
        >>> x = jnp.ones((2, 10, 64))                                      # [B, T, D]
        >>> attnjax.multi_head_attention(params, x, is_causal=True).shape   # [B, T, F]
        (2, 10, 64)
    """
    inputs_q = _checks.as_array("inputs_q", inputs_q, required=True)
    inputs_k = inputs_q if inputs_k is None else _checks.as_array("inputs_k", inputs_k, True)
    inputs_v = inputs_k if inputs_v is None else _checks.as_array("inputs_v", inputs_v, True)
    _check_inputs(inputs_q, inputs_k, inputs_v)
    params = _check_params(params, inputs_q, inputs_k, inputs_v)
    # [B, T, N, H]
    query = project_query(params, inputs_q)
    # [B, S, K, H], [B, S, K, V]
    key, value = project_key_value(params, inputs_k, inputs_v)
    query, key, value = activate_projections(projection_activation, query, key, value)
    result = dot_product_attention(query, key, value, **attention_options)
    # weights and log-sum-exp, when asked for, follow the heads
    heads, *extras = result if isinstance(result, tuple) else (result,)
    # [B, T, F]
    out = combine_heads(params, heads)
    return (out, *extras) if extras else out
