"""Layer 1: attention for one example and one head, on 2-D arrays.

    Attention(Q, K, V) = softmax(align(Q, K)) V,   align(Q, K) = Q Kᵀ / √d_k

with the softmax taken row by row over the keys each query may see. The batched
kernels compute the same numbers from the same pieces (`softmax_and_lse`,
`contract_last`, `mix_values`): the dense kernel a head at a time, mapped over the heads
and the batch (`attnjax.dense`, `attnjax.heads`), the chunked one block by block.

Numerics: logits, the softmax and the value accumulation run in float32 for
float16/bfloat16 inputs; results come back in the input dtype. A query row that sees no
key gets weights and output of exactly zero, with zero gradients, never NaN.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float

from attnjax import _checks
from attnjax.scores import _logits_dtype, check_alignment, scaled_dot_score

ScoreFn = Callable[[ArrayLike, Array], Array]


# Masked logits take this large negative finite value, never −inf: nothing inside attnjax
# creates an inf or a NaN (users run under jax.debug_infs / debug_nans). A row's running
# maximum never starts below FLOOR, so exp(MASKED − max) is exactly 0 and masked entries
# need no second select after the exponential. It is also the log-sum-exp of a row that
# sees nothing: far enough from float32's limit that sums of many of them stay finite.
MASKED = -1e30
FLOOR = MASKED / 2


def softmax_and_lse(
    logits: Float[ArrayLike, "T S"],
    mask: Bool[ArrayLike, "#T #S"] | None = None,
    sink: Float[ArrayLike, ""] | None = None,
) -> tuple[Float[Array, "T S"], Float[Array, " T"]]:
    """Row-wise softmax over the visible entries, and each row's log-sum-exp.

    `sink` is one extra logit in every row's denominator whose value vector is zero
    (attention sinks): it takes weight without adding to the output. A row with nothing
    visible and no sink has all-zero weights and log-sum-exp MASKED.
    """
    unnormalised, total, lse = exp_and_total(logits, mask, sink)
    return unnormalised / total, lse


def exp_and_total(
    logits: Float[ArrayLike, "T S"],
    mask: Bool[ArrayLike, "#T #S"] | None = None,
    sink: Float[ArrayLike, ""] | None = None,
) -> tuple[Float[Array, "T S"], Float[Array, "T 1"], Float[Array, " T"]]:
    """softmax_and_lse before its division: `exp(logits − max)` `[T, S]`, each row's
    sum `[T, 1]` (1 for a row that sees nothing, whose exponentials are all zero) and
    its log-sum-exp. The weights are the first over the second; a product with the
    weights can divide afterwards, over its own (smaller) rows instead of `[T, S]`."""
    if mask is not None:
        logits = jnp.where(mask, logits, MASKED)
    # [T, 1]: the max only shifts the exponent for range; the softmax does not depend on it.
    row_max = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), FLOOR)
    if sink is not None:
        sink = jnp.asarray(sink, logits.dtype)
        row_max = jnp.maximum(row_max, sink)
    row_max = lax.stop_gradient(row_max)
    # [T, S]
    unnormalised = jnp.exp(logits - row_max)
    # [T, 1]
    total = jnp.sum(unnormalised, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - row_max)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    lse = jnp.where(seen, row_max + jnp.log(safe_total), MASKED)
    return unnormalised, safe_total, lse[:, 0]


def masked_softmax(
    logits: Float[ArrayLike, "T S"], mask: Bool[ArrayLike, "#T #S"] | None = None
) -> Float[ArrayLike, "T S"]:
    """Row-wise softmax over the visible entries; rows with none visible are all zero.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> mask = jnp.array([[True, True, False, False]])                 # [T, S]
        >>> attnjax.masked_softmax(jnp.zeros((1, 4)), mask).tolist()
        [[0.5, 0.5, 0.0, 0.0]]
    """
    logits, mask = _checks.as_array("logits", logits, True), _checks.as_array("mask", mask)
    if logits.ndim < 2:
        raise ValueError(f"logits must have rank 2 or more ([..., T, S]); got shape "
                         f"{_checks.shape_str(logits.shape)}")
    if mask is not None:
        try:
            np.broadcast_shapes(mask.shape, logits.shape)
        except ValueError:
            raise ValueError(f"mask must broadcast with logits "
                             f"{_checks.shape_str(logits.shape)}; got "
                             f"{_checks.shape_str(mask.shape)}") from None
        mask = _checks.nonzero_attends("mask", mask)
    return softmax_and_lse(logits, mask)[0]


def logits(
    q: Float[ArrayLike, "T _Hq"],
    k: Float[ArrayLike, "S _Hk"],
    *,
    bias: Float[ArrayLike, "#T #S"] | None = None,
    scale: float | None = None,
    score_fn: ScoreFn | None = None,
) -> Float[ArrayLike, "T S"]:
    """align(q, k) + bias in float32 (float64 for float64 inputs)."""
    if score_fn is None:
        out = scaled_dot_score(q, k, scale=scale)
    else:
        out = check_alignment(score_fn(q, k), q.shape[0], k.shape[0])
    acc = _logits_dtype(q.dtype)
    out = out.astype(acc)
    if bias is not None:
        out = out + bias.astype(acc)
    return out


def mix_values(weights: Float[ArrayLike, "T S"],
               v: Float[ArrayLike, "S V"]) -> Float[ArrayLike, "T V"]:
    """weights · v, accumulated in float32 and returned in v's dtype.

    In 16 bits the weights' derivative, dO·vᵀ, is a float32 product of float32
    operands: in float16 it passes 65504 where |v| is large (values of ±2000 over
    V = 256), while every input, output and gradient fits; in bfloat16, rounded to 8
    bits, it left a score_mod's parameters' gradients (ALiBi's slopes) 4e-3 off."""
    v = jnp.asarray(v)
    if v.dtype in (jnp.float16, jnp.bfloat16):
        return _mix_16_bit(weights, v)
    # [T, V]
    out = contract_last(weights.astype(v.dtype), v.T, _logits_dtype(v.dtype))
    return out.astype(v.dtype)


@jax.custom_jvp
def _mix_16_bit(weights, v):
    return contract_last(weights.astype(v.dtype), v.T, jnp.float32).astype(v.dtype)


@_mix_16_bit.defjvp
def _mix_16_bit_jvp(primals, tangents):
    weights, v = primals
    d_weights, d_v = tangents
    wide = jnp.float32
    tangent = (contract_last(d_weights.astype(wide), v.T.astype(wide), wide)
               + contract_last(weights.astype(v.dtype), d_v.T, wide))
    return _mix_16_bit(weights, v), tangent.astype(v.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def contract_last(a: Float[ArrayLike, "T K"], b: Float[ArrayLike, "S K"],
                  out_dtype) -> Float[Array, "T S"]:
    """a · bᵀ `[T, S]`, contracting the last axis of both, accumulated in out_dtype.

    The value is the plain product. Its derivative is written so that reverse mode
    computes b's cotangent as (gᵀ · a)ᵀ, with gᵀ materialised: a product contracting the
    leading axis of its left operand (autodiff's gᵀ-free form, g contracted over T) runs
    several times slower on XLA's CPU backend, which would also fold a plain transpose
    back into the product; the barrier keeps it. Forward mode and higher orders work as
    for any jnp product.
    """
    return jnp.einsum("TK,SK->TS", a, b, preferred_element_type=out_dtype)


def is_zero(tangent) -> bool:
    """A tangent known to be zero (`jax.custom_jvp`'s symbolic zero): its terms are
    left out. (A product of an instantiated zero tangent, of a non-default layout that
    XLA's CPU backend gives it, aborted the process: its dot emitter's layout check.)"""
    return isinstance(tangent, jax.custom_derivatives.SymbolicZero)


def sum_of(terms: list):
    """The sum of the terms that are not None (at least one is)."""
    terms = [t for t in terms if t is not None]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


@functools.partial(contract_last.defjvp, symbolic_zeros=True)
def _contract_last_jvp(out_dtype, primals, tangents):
    a, b = primals
    d_a, d_b = tangents
    # d(a·bᵀ) = d_a·bᵀ + (d_b·aᵀ)ᵀ
    tangent = sum_of([None if is_zero(d_a) else contract_last(d_a, b, out_dtype),
                      None if is_zero(d_b) else contract_last_tangent_in_b(a, d_b, out_dtype)])
    return contract_last(a, b, out_dtype), tangent


def contract_last_tangent_in_b(a, d_b, out_dtype):
    """The tangent of `contract_last(a, b)` in b alone, (d_b·aᵀ)ᵀ. Transposed, the
    barriers hold gᵀ and the product gᵀ·a `[S, K]` as they are: XLA would otherwise fold
    either transpose into the product and swap its operands back into the slow form."""
    barrier = lax.optimization_barrier
    return barrier(contract_last(barrier(d_b), a, out_dtype)).T


# XLA's CPU backend sums up to this many terms of one array in the loop that computes
# them; a longer reduction of one array it splits into windows of this size (its
# TreeReductionRewriter), writing the terms to memory first. attnjax keeps its one-pass
# sums within it, of several arrays too (their sequential sums stay short).
ONE_PASS_TERMS = 32


def sums_in_one_pass(xs: tuple[Array, ...], axis: int) -> tuple[Array, ...]:
    """`jnp.sum(x, axis)` of each of the same-shaped xs, as one reduction that XLA's CPU
    backend computes in the loop producing the xs (of one array, when the axis holds at
    most ONE_PASS_TERMS).

    That backend hands an add-reduction to its YNNPACK fusion, which writes the
    reduction's operand to memory first: for one query against a cache, the products of
    the query with every key, or of the weights with every value, as large as the cache.
    That fusion takes neither a reduction of several arrays at once nor one that adds as
    a − (−b) (the same sum exactly: IEEE 754 defines a − b as a + (−b)), the form of a
    single sum here: XLA reduces the xs where it computes them, one pass over the cache.
    (Of several arrays, the plain adds: with a − (−b) XLA's own reduction of a freshly
    projected cache ran 30% slower.) A dates decoding step (1,000 sequences,
    benchmarks/decode.py, 2-core CPU) went from 2.4-4.5 to 1.3-1.4 ms. For values only:
    the general reduction has no derivative.
    """
    zero, dims = jnp.zeros((), xs[0].dtype), (axis % xs[0].ndim,)
    if len(xs) > 1:
        return tuple(lax.reduce(tuple(xs), (zero,) * len(xs), _add_each, dims))
    return (lax.reduce(xs[0], zero, _add_as_difference, dims),)


# The reductions' computations, defined once: jax caches a reduction's traced
# computation by the function (a new lambda at each call compiled the op afresh, ~30 ms,
# at each eager call).
def _add_each(a, b):
    return tuple(x + y for x, y in zip(a, b))


def _add_as_difference(a, b):
    return a - (-b)


def _check_core(q, k, v, mask, bias, scale, score_fn) -> None:
    for name, x in (("q", q), ("k", k)) + ((("v", v),) if v is not None else ()):
        _checks.check_rank(name, x, (2,), "[T, H]" if name == "q" else "[S, H]")
        _checks.check_floating(name, x)
    _checks.check_same_dtype(q=q, k=k, **({"v": v} if v is not None else {}))
    if k.shape[0] == 0:   # nothing to attend to (a row's maximum of no logits)
        raise ValueError(f"k must hold at least one key; got S=0 in k "
                         f"{_checks.shape_str(k.shape)} [S, H]")
    if v is not None and v.shape[0] != k.shape[0]:
        raise ValueError(
            "k and v must have the same length S (axis 0); got "
            f"k {_checks.shape_str(k.shape)} and v {_checks.shape_str(v.shape)}"
        )
    if score_fn is None:
        _checks.check_same_last_dim("q", q, "k", k)
        _checks.resolve_scale(scale, q.shape[-1])
    elif scale is not None:
        raise ValueError(
            f"scale={scale} applies to the default scaled dot score only; with score_fn, "
            "put the scale inside score_fn"
        )
    target = (q.shape[0], k.shape[0])
    if mask is not None:
        _checks.check_mask("mask", mask, target, "[T, S]")
    if bias is not None:
        _checks.check_bias("bias", bias, target, "[T, S]")


def _core_arrays(q, k, v, mask, bias, scale, score_fn):
    """The arguments of `attention` / `attention_weights` checked, lists as arrays, and
    the queries, keys and values that the mask hides from every query or key as zeros:
    a NaN or inf there must not reach a valid output or gradient (0 · NaN is NaN)."""
    q, k = _checks.as_array("q", q, True), _checks.as_array("k", k, True)
    v = None if v is None else _checks.as_array("v", v, True)
    mask, bias = _checks.as_array("mask", mask), _checks.as_array("bias", bias)
    _check_core(q, k, v, mask, bias, scale, score_fn)
    if mask is not None:
        # [T, S]
        seen = jnp.broadcast_to(jnp.asarray(mask), (q.shape[0], k.shape[0]))
        # [T, 1], [S, 1]
        rows, cols = jnp.any(seen, axis=1)[:, None], jnp.any(seen, axis=0)[:, None]
        q, k = jnp.where(rows, q, 0), jnp.where(cols, k, 0)
        v = None if v is None else jnp.where(cols, v, 0)
    return q, k, v, mask, bias


def attention_weights(
    q: Float[ArrayLike, "T _Hq"],
    k: Float[ArrayLike, "S _Hk"],
    *,
    mask: Bool[ArrayLike, "#T #S"] | None = None,
    bias: Float[ArrayLike, "#T #S"] | None = None,
    scale: float | None = None,
    score_fn: ScoreFn | None = None,
) -> Float[ArrayLike, "T S"]:
    """softmax(align(q, k) + bias) over the keys that `mask` lets each query see.

    Args:
      q: queries `[T, H]`.
      k: keys `[S, H]`.
      mask: boolean, broadcastable to `[T, S]`; True = may attend.
      bias: float, broadcastable to `[T, S]`; added to the logits.
      scale: logit scale of the default score; 1/√H when None.
      score_fn: an alignment `score_fn(q, k) -> [T, S]` from `attnjax.scores`
        (parameters bound with `functools.partial`); scaled dot product when None.

    Returns:
      `[T, S]` weights in q's dtype; each row sums to 1, or is all zero when the query
      sees no key.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> w = attnjax.attention_weights(jnp.ones((5, 16)), jnp.ones((7, 16)))
        >>> w.shape, bool(jnp.allclose(w.sum(-1), 1.0))   # [T, S], rows sum to 1
        ((5, 7), True)
    """
    q, k, _, mask, bias = _core_arrays(q, k, None, mask, bias, scale, score_fn)
    weights = masked_softmax(logits(q, k, bias=bias, scale=scale, score_fn=score_fn), mask)
    return weights.astype(q.dtype)


def attention(
    q: Float[ArrayLike, "T _Hq"],
    k: Float[ArrayLike, "S _Hk"],
    v: Float[ArrayLike, "S V"],
    *,
    mask: Bool[ArrayLike, "#T #S"] | None = None,
    bias: Float[ArrayLike, "#T #S"] | None = None,
    scale: float | None = None,
    score_fn: ScoreFn | None = None,
) -> Float[ArrayLike, "T V"]:
    """softmax(align(q, k)) v for one example and one head.

    Args:
      q: queries `[T, H]`.
      k: keys `[S, H]`.
      v: values `[S, V]`.
      mask: boolean, broadcastable to `[T, S]`; True = may attend.
      bias: float, broadcastable to `[T, S]`; added to the logits.
      scale: logit scale of the default score; 1/√H when None.
      score_fn: an alignment `score_fn(q, k) -> [T, S]`; scaled dot product when None.

    Returns:
      `[T, V]` in v's dtype; zero rows for queries that see no key.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> q, k, v = jnp.ones((5, 16)), jnp.ones((7, 16)), jnp.ones((7, 32))
        >>> attnjax.attention(q, k, v).shape          # [T, V]
        (5, 32)
    """
    q, k, v, mask, bias = _core_arrays(q, k, v, mask, bias, scale, score_fn)
    weights = masked_softmax(logits(q, k, bias=bias, scale=scale, score_fn=score_fn), mask)
    return mix_values(weights, v)
