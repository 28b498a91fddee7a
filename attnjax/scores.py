"""Scores: alignment functions, score modifications, and the score spec of one call.

Alignment functions say how much query i attends to key j, before the softmax.

Each takes one example and one head, q `[T, H]` and k `[S, H]` (the additive and
bilinear forms allow different query and key widths), and returns logits `[T, S]`.
Learned parameters are bound with `functools.partial`, so every alignment function
fits the `score_fn(q, k)` slot of `attnjax.attention`:

    score_fn = functools.partial(attnjax.general_score, w=w)   # w [Hq, Hk]

Logits are accumulated in float32 (float64 for float64 inputs), whatever the input dtype.

Score modifications (`soft_cap`, `alibi`, `relative_position_bias`, or any
`score_mod(score, b, n, q_pos, k_pos)`, FlexAttention's signature) change the scaled
logits elementwise before masking; `Score` gathers what one call does to its logits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from attnjax import _checks, _pytree


def _logits_dtype(dtype) -> jnp.dtype:
    # float16/bfloat16 products are accumulated in float32; float64 stays float64.
    return jnp.dtype(jnp.float64 if dtype == jnp.float64 else jnp.float32)


def split_scale(scale, dtype) -> tuple[Any, float]:
    """(the queries' factor, the logits'): the scale as the kernels apply it.

    Scaling the `[T, H]` queries costs T·H multiplies instead of T·S on the logits, and
    is exact in float32 (one rounding of q, below the logits' own) and, in bfloat16, for
    a power of two at most 1. Any other scale of bfloat16 queries rounded every q to 8
    bits again (twice jax.nn's error at H = 32 or 128, which scales the float32 logits):
    the float32 logits take it instead, as they take every scale of float16 queries,
    whose exponents' range is narrow: a scale above 1 could overflow, and even a power
    of two below 1 made small queries subnormal (2⁻³⁰ of 1e4 kept 5 bits) and their
    gradient, the logits' times 1/scale, overflow (d_q inf at the default 1/8 where
    the exact d_q, 41,831, is a float16)."""
    if isinstance(scale, (int, float)) and (jnp.dtype(dtype) == jnp.float16 or (
            jnp.dtype(dtype) == jnp.bfloat16
            and not (scale <= 1 and math.frexp(scale)[0] == 0.5))):
        return 1.0, float(scale)
    return scale, 1.0


def dot_score(q: Float[ArrayLike, "T H"], k: Float[ArrayLike, "S H"]) -> Float[ArrayLike, "T S"]:
    """Luong's "dot" alignment: q kᵀ, unscaled.

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax import scores
        >>> scores.dot_score(jnp.ones((5, 16)), jnp.ones((7, 16))).shape  # [T, S]
        (5, 7)
    """
    _checks.check_same_last_dim("q", q, "k", k)
    # [T, S]
    return jnp.einsum("TH,SH->TS", q, k, preferred_element_type=_logits_dtype(q.dtype))


def scaled_dot_score(
    q: Float[ArrayLike, "T H"], k: Float[ArrayLike, "S H"], *, scale: float | None = None
) -> Float[ArrayLike, "T S"]:
    """The Transformer's alignment: q kᵀ · scale, with scale = 1/√H by default.

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax import scores
        >>> logits = scores.scaled_dot_score(jnp.ones((5, 16)), jnp.ones((7, 16)))   # [T, S]
        >>> logits.shape, float(logits[0, 0])                          # 16 / √16
        ((5, 7), 4.0)
    """
    _checks.check_same_last_dim("q", q, "k", k)
    q_scale, logit_scale = split_scale(_checks.resolve_scale(scale, q.shape[-1]), q.dtype)
    q = q * jnp.asarray(q_scale, dtype=q.dtype)
    # [T, S]
    logits = jnp.einsum("TH,SH->TS", q, k, preferred_element_type=_logits_dtype(q.dtype))
    return logits if logit_scale == 1.0 else logits * logit_scale


def general_score(
    q: Float[ArrayLike, "T _Hq"], k: Float[ArrayLike, "S _Hk"], *, w: Float[ArrayLike, "_Hq _Hk"]
) -> Float[ArrayLike, "T S"]:
    """Luong's "general" (bilinear) alignment: q W kᵀ with a learned W `[Hq, Hk]`.

    Examples:
        >>> import functools, jax.numpy as jnp, attnjax
        >>> general = functools.partial(attnjax.general_score, w=jnp.eye(16))   # q W kᵀ
        >>> attnjax.attention(jnp.ones((5, 16)), jnp.ones((7, 16)), jnp.ones((7, 4)),
        ...                   score_fn=general).shape
        (5, 4)
    """
    w = _checks.as_array("w", w)
    _checks.check_param_shape("w", w, (q.shape[-1], k.shape[-1]), "[Hq, Hk]")
    acc = _logits_dtype(q.dtype)
    # [T, Hk]
    qw = jnp.einsum("TI,IJ->TJ", q, w.astype(q.dtype), preferred_element_type=acc)
    # [T, S]
    return jnp.einsum("TJ,SJ->TS", qw, k.astype(acc), preferred_element_type=acc)


def additive_score(
    q: Float[ArrayLike, "T _Hq"],
    k: Float[ArrayLike, "S _Hk"],
    *,
    w_q: Float[ArrayLike, "_Hq A"],
    w_k: Float[ArrayLike, "_Hk A"],
    v: Float[ArrayLike, " A"],
) -> Float[ArrayLike, "T S"]:
    """Bahdanau's additive alignment: vᵀ tanh(W_q q + W_k k), for every (i, j).

    Materialises a `[T, S, A]` tensor: meant for the small models it was designed for.

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax import scores
        >>> w_q, w_k, v = jnp.ones((16, 8)), jnp.ones((12, 8)), jnp.ones((8,))   # A = 8
        >>> scores.additive_score(jnp.ones((5, 16)), jnp.ones((7, 12)), w_q=w_q, w_k=w_k, v=v).shape
        (5, 7)
    """
    w_q, w_k, v = (_checks.as_array(name, x) for name, x in (("w_q", w_q), ("w_k", w_k),
                                                              ("v", v)))
    if np.ndim(w_q) != 2 or np.ndim(w_k) != 2 or np.ndim(v) != 1:
        raise ValueError(
            "additive_score expects w_q [Hq, A], w_k [Hk, A] and v [A]; got "
            f"w_q {_checks.shape_str(np.shape(w_q))}, w_k {_checks.shape_str(np.shape(w_k))}, "
            f"v {_checks.shape_str(np.shape(v))}"
        )
    _checks.check_param_shape("w_q", w_q, (q.shape[-1], w_q.shape[1]), "[Hq, A]")
    _checks.check_param_shape("w_k", w_k, (k.shape[-1], w_k.shape[1]), "[Hk, A]")
    if not w_q.shape[1] == w_k.shape[1] == v.shape[0]:
        raise ValueError(f"additive_score's w_q [Hq, A], w_k [Hk, A] and v [A] must have one "
                         f"A; got A = {w_q.shape[1]}, {w_k.shape[1]} and {v.shape[0]}")
    acc = _logits_dtype(q.dtype)
    # [T, A]
    qa = jnp.einsum("TI,IA->TA", q, w_q.astype(q.dtype), preferred_element_type=acc)
    # [S, A]
    ka = jnp.einsum("SJ,JA->SA", k, w_k.astype(k.dtype), preferred_element_type=acc)
    # [T, S, A]
    hidden = jnp.tanh(qa[:, None, :] + ka[None, :, :])
    # [T, S]
    return jnp.einsum("TSA,A->TS", hidden, v.astype(acc))


# --------------------------------------------------------------------------------------
# Score modifications: score_mod(score, b, n, q_pos, k_pos) -> score, elementwise on the
# scaled logits (plus bias) of one head, before masking. b and n are int32 scalars (the
# example and the query head), q_pos `[T, 1]` and k_pos `[1, S]` int32 positions (see
# attnjax.masks), score float32 (float64 for float64 inputs). Arrays a score_mod closes
# over receive gradients in every implementation. A score_mod that depends on the score
# alone, through a non-decreasing function f, may set `score_mod.monotone = f`: the
# chunked kernel then takes row maxima before the modification. One whose values always
# lie in [lo, hi] may set `score_mod.bounds = (lo, hi)`: where hi − lo is small enough
# (`attnjax.chunked.BOUNDED_RANGE`; for float16 values, 9.7, as e^−(hi − lo) must stay a
# normal float16), the chunked kernel shifts every row by hi instead of by a running
# maximum. One that, on float32 scores no larger than `limit` in magnitude,
# equals a cheaper function g of the score alone may set `score_mod.near_zero = (limit,
# g)`: the chunked kernel uses g on every block whose logits (of every head) all lie
# within ±limit. One that holds a value per query head (alibi's slopes, a relative
# position bias's table) sets `score_mod.num_heads = N`: a call with other than N query
# heads is refused (indexing past the last head reads its values).

ScoreMod = Callable[[Array, Array, Array, Array, Array], Array]


def soft_cap(cap: float) -> ScoreMod:
    """cap · tanh(score / cap): logits squashed into (−cap, cap) (Gemma 2, Grok).

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import scores
        >>> q = k = v = jnp.ones((1, 6, 2, 8))                             # [B, T, N, H]
        >>> attnjax.dot_product_attention(q, k, v, score_mod=scores.soft_cap(30.0)).shape
        (1, 6, 2, 8)
    """
    # a Python, numpy or concrete jax number, compiled into the kernel as a constant
    number = (isinstance(cap, (int, float, np.integer, np.floating))
              or isinstance(cap, (np.ndarray, jax.Array)) and np.ndim(cap) == 0
              and not isinstance(cap, jax.core.Tracer))
    if isinstance(cap, (bool, np.bool_)) or not number or np.asarray(cap).dtype == bool:
        raise TypeError(f"soft_cap's cap must be a number (known when the call is traced); "
                        f"got {type(cap).__name__}")
    if not (math.isfinite(float(cap)) and float(cap) > 0):
        raise ValueError(f"soft_cap needs a positive finite cap; got {float(cap)!r}")
    if not MIN_CAP <= float(cap) <= MAX_CAP:
        raise ValueError(f"soft_cap's cap must lie in [{MIN_CAP:.3g}, {MAX_CAP:g}] (beyond, "
                         f"float32 flushes logits · 1/cap, or the cap's gradients, to 0); "
                         f"got {float(cap):g}")
    return _soft_cap(float(cap))


# The squash computes score · (1/cap) in float32 (for 16-bit inputs too), where a CPU
# flushes a product below float32's smallest normal number to 0: with cap ≤ 1e30 only
# logits under 1.2e-8 are, off by less than that (at cap 8.5e37, 1/cap itself the
# smallest normal, logits under 1 were: attention weights 4e-4 off). Below the smallest
# normal cap, its gradients are NaN.
MIN_CAP = float(np.finfo(np.float32).tiny)
MAX_CAP = 1e30


# One function per cap: a call that writes soft_cap(30.0) each time passes the same
# score_mod, which an eager call then compiles for once (attnjax.attention).
@functools.lru_cache(maxsize=64)
def _soft_cap(cap: float) -> ScoreMod:
    def squash(score):
        return cap * jnp.tanh(score * (1.0 / cap))

    def mod(score, b, n, q_pos, k_pos):
        return squash(score)

    # A non-decreasing function of the score alone: the chunked kernel may take a row's
    # maximum before squashing (one pass less over each block of logits).
    mod.monotone = squash
    # Every value lies in (−cap, cap).
    mod.bounds = (-cap, cap)
    # For |score| ≤ cap, the same values without tanh's division.
    mod.near_zero = (cap, lambda score: _soft_cap_near_zero(score, cap))
    return mod


# tanh(y) = y + y·z·Q(z), z = y², on |y| ≤ 1: Q's coefficients, lowest first (a
# minimax fit of the relative error of tanh, by Lawson's iteration). In float32,
# evaluated as below, cap·tanh(s/cap) comes within 2.2 ulp of the exact value there
# (XLA's own float32 tanh: 4.2 ulp).
_TANH_Q = (-0.3333301697427798, 0.13326833055786888, -0.0535181096402869,
           0.020398548972084485, -0.006294578089752825, 0.001070182145903452)


def _polynomial(x, coefficients):
    """Σ c_k x^k, in pairs c_k + c_{k+1}·x joined by powers of x²: short dependency
    chains, which vectorise well."""
    c = [jnp.asarray(value, x.dtype) for value in coefficients]
    pairs = [c[k] + c[k + 1] * x if k + 1 < len(c) else c[k] for k in range(0, len(c), 2)]
    x2 = x * x
    total = pairs[-1]
    for pair in reversed(pairs[:-1]):
        total = pair + x2 * total
    return total


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _soft_cap_near_zero(score, cap: float):
    """cap·tanh(score/cap) for float32 |score| ≤ cap (elsewhere meaningless), without
    tanh's division: score + score·z·Q(z), z = (score/cap)². For caps in [2⁻⁸, 2⁸] as
    score + score·w·Q(w/cap²)/cap², w = score², with the 1/cap² powers folded into the
    coefficients (one product fewer; outside that range they leave float32's range)."""
    if not 2.0 ** -8 <= cap <= 2.0 ** 8:
        z = jnp.square(score * (1.0 / cap))
        return score + score * (z * _polynomial(z, _TANH_Q))
    w = score * score
    scaled = [c * cap ** (-2 * (k + 1)) for k, c in enumerate(_TANH_Q)]
    return score + score * (w * _polynomial(w, scaled))


@_soft_cap_near_zero.defjvp
def _soft_cap_near_zero_jvp(cap, primals, tangents):
    out = _soft_cap_near_zero(primals[0], cap)
    t = out * (1.0 / cap)
    return out, (1 - t * t) * tangents[0]


def alibi_slopes(num_heads: int) -> Array:
    """The ALiBi paper's head slopes, `[N]`.

    `[N]` the ALiBi paper's head slopes, as its reference code (and BLOOM's) gives them:
    for N a power of two, 2^(−8·(n+1)/N); otherwise the P slopes of the power of two P
    below N, then every other slope of 2P (the odd n), N − P of them.

    Examples:
        >>> from attnjax import scores
        >>> scores.alibi_slopes(4).tolist()                                 # [N]
        [0.25, 0.0625, 0.015625, 0.00390625]
        >>> scores.alibi_slopes(6).tolist()               # 4's slopes, then 8's n = 0, 2
        [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    """
    num_heads = _checks.positive_int("num_heads", num_heads)
    below = 1 << (num_heads.bit_length() - 1)   # the power of two P ≤ N

    def geometric(count, step=1):   # [count] 2^(−8·(n+1)/P'), n = 0, step, 2·step, ...
        return 2.0 ** (-8.0 * (np.arange(0, count, step) + 1) / count)

    slopes = np.concatenate([geometric(below), geometric(2 * below, 2)[:num_heads - below]])
    return jnp.asarray(slopes, jnp.float32)


def alibi(slopes: Float[ArrayLike, " N"]) -> ScoreMod:
    """ALiBi: a linear penalty on the distance, one slope per head.

    ALiBi: score − slopes[n] · |q_pos − k_pos| (with a causal mask, the paper's
    m·(j − i)). slopes `[N]`, one per query head; learnable (gradients reach it).

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import scores
        >>> q = k = v = jnp.ones((1, 6, 4, 8))                             # N = 4 heads
        >>> mod = scores.alibi(scores.alibi_slopes(4))
        >>> attnjax.dot_product_attention(q, k, v, is_causal=True, score_mod=mod).shape
        (1, 6, 4, 8)
    """
    slopes = jnp.asarray(slopes)
    if slopes.ndim != 1 or not jnp.issubdtype(slopes.dtype, jnp.floating):
        raise ValueError(f"alibi slopes must be a float array [N]; got {slopes.dtype} "
                         f"{_checks.shape_str(slopes.shape)}")
    # (at distance 0 an infinite slope's product is NaN)
    _checks.check_finite_or_minus_inf("alibi slopes", slopes, None)

    def mod(score, b, n, q_pos, k_pos):
        distance = jnp.abs(q_pos - k_pos).astype(score.dtype)
        return score - slopes[n].astype(score.dtype) * distance

    mod.num_heads = slopes.shape[0]
    return mod


def relative_position_bucket(relative_position, *, num_buckets: int, max_distance: int,
                             bidirectional: bool):
    """T5's relative-position bucket of k_pos − q_pos.

    T5's bucket of k_pos − q_pos: exact below half of a direction's buckets
    (num_buckets/4 with bidirectional, where each direction takes half of them;
    num_buckets/2 without), then logarithmic up to max_distance, and the direction's
    last bucket beyond; exact where the logarithm's quotient is a whole number (T5's
    bucket, which float32 logarithms can round a bucket short of).

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax import scores
        >>> scores.relative_position_bucket(jnp.array([-3, 0, 3]), num_buckets=8, max_distance=16,
        ...                                 bidirectional=True).tolist()   # [T, S] alike
        [2, 0, 6]
    """
    _check_buckets(num_buckets, max_distance, bidirectional)
    relative_position = jnp.asarray(relative_position)
    if not jnp.issubdtype(relative_position.dtype, jnp.integer):
        raise TypeError(f"relative_position must be an integer array (k_pos − q_pos); got "
                        f"{relative_position.dtype}")
    bucket = jnp.zeros_like(relative_position)
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0).astype(bucket.dtype) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    exact = num_buckets // 2
    spread = num_buckets - exact
    # log of at least `exact`, so that no log(0) is ever formed; at most one bucket off
    far = jnp.maximum(n, exact)
    k = jnp.log(far.astype(jnp.float32) / exact) / math.log(max_distance / exact) * spread
    k = jnp.clip(k.astype(jnp.int32), 0, spread - 1)
    # made exact by the distances where each bucket starts (where float32 logarithms
    # rounded below an integer, as at n = 10 for 3 buckets and max_distance 100, it
    # was a bucket short of T5's); compared unsigned, in 32 bits at least, so that a
    # start past the positions' range stays out of reach
    wide = np.dtype(np.uint64 if n.dtype.itemsize == 8 else np.uint32)
    starts = jnp.asarray([min(start, np.iinfo(wide).max)
                          for start in _bucket_starts(num_buckets, max_distance)], wide)
    far = far.astype(wide)
    k = k + (far >= starts[k + 1]).astype(k.dtype) - (far < starts[k]).astype(k.dtype)
    log_bucket = (exact + jnp.minimum(k, spread - 1)).astype(bucket.dtype)
    return bucket + jnp.where(n < exact, n, log_bucket)


@functools.lru_cache(maxsize=64)
def _bucket_starts(buckets: int, max_distance: int) -> tuple[int, ...]:
    """The first distance of each of a direction's logarithmic buckets, then
    max_distance (from where the last one holds every distance), for `buckets` a
    direction with exact = buckets // 2 distances of their own: the k-th is the least d
    with k ≤ (buckets − exact)·log(d / exact) / log(max_distance / exact), in integers
    max_distance^k · exact^(buckets − exact) ≤ d^(buckets − exact) · exact^k."""
    exact = buckets // 2
    spread = buckets - exact
    step = math.log(max_distance / exact)

    def reaches(d, k):
        # float64 where it tells, the integers where d is within rounding of the start
        gap = spread * math.log(d / exact) - k * step
        if abs(gap) > 1e-6:
            return gap > 0
        return max_distance ** k * exact ** spread <= d ** spread * exact ** k

    starts = []
    for k in range(spread + 1):
        d = max(exact, math.ceil(exact * math.exp(k * step / spread)))
        while d > exact and reaches(d - 1, k):
            d -= 1
        while not reaches(d, k):
            d += 1
        starts.append(d)
    return tuple(starts)


def _check_buckets(num_buckets, max_distance, bidirectional) -> None:
    """At least one exact bucket per direction, and room for the logarithmic ones."""
    if not (isinstance(bidirectional, (bool, np.bool_)) or (
            _checks.is_int(bidirectional) and bidirectional in (0, 1))):
        raise TypeError(f"bidirectional must be a bool (True or False); got {bidirectional!r}")
    fewest = 4 if bidirectional else 2   # half of a direction's buckets are exact
    if not (_checks.is_int(num_buckets) and num_buckets >= fewest):
        raise ValueError(f"num_buckets must be an int ≥ {fewest} "
                         f"{'(2 a direction) ' if bidirectional else ''}with "
                         f"bidirectional={bidirectional}; got {num_buckets!r}")
    if not (_checks.is_int(max_distance) and max_distance >= 2):
        raise ValueError(f"max_distance must be an int ≥ 2; got {max_distance!r}")
    if max_distance <= num_buckets // fewest:
        raise ValueError(f"max_distance={max_distance} must exceed the exact range "
                         f"{num_buckets // fewest} of num_buckets={num_buckets}")


def relative_position_bias(table: Float[ArrayLike, "buckets N"], *, num_buckets: int = 32,
                           max_distance: int = 128, bidirectional: bool = True) -> ScoreMod:
    """T5's relative position bias: score + table[bucket(k_pos − q_pos), n].

    table `[num_buckets, N]`, learnable; buckets as in T5 (`relative_position_bucket`).

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import scores
        >>> table = jnp.zeros((32, 2))                                      # [buckets, N]
        >>> q = k = v = jnp.ones((1, 6, 2, 8))
        >>> mod = scores.relative_position_bias(table)
        >>> attnjax.dot_product_attention(q, k, v, score_mod=mod).shape
        (1, 6, 2, 8)
    """
    _check_buckets(num_buckets, max_distance, bidirectional)
    table = jnp.asarray(table)
    if table.ndim != 2 or table.shape[0] != num_buckets or not jnp.issubdtype(
            table.dtype, jnp.floating):
        raise ValueError(f"relative_position_bias table must be a float array "
                         f"[num_buckets={num_buckets}, N]; got {table.dtype} "
                         f"{_checks.shape_str(table.shape)}")
    _checks.check_finite_or_minus_inf("relative_position_bias table", table,
                                      "those buckets masked")

    def mod(score, b, n, q_pos, k_pos):
        bucket = relative_position_bucket(k_pos - q_pos, num_buckets=num_buckets,
                                          max_distance=max_distance,
                                          bidirectional=bidirectional)
        return score + table[bucket, n].astype(score.dtype)

    mod.num_heads = table.shape[1]
    return mod


def chain(*mods: ScoreMod) -> ScoreMod:
    """One score_mod applying each of `mods` in turn: `chain(alibi(m), soft_cap(30))`.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import scores
        >>> mod = scores.chain(scores.alibi(scores.alibi_slopes(2)), scores.soft_cap(20.0))
        >>> q = k = v = jnp.ones((1, 6, 2, 8))                             # [B, T, N, H]
        >>> attnjax.dot_product_attention(q, k, v, score_mod=mod).shape
        (1, 6, 2, 8)
    """
    for i, fn in enumerate(mods):
        if not callable(fn):
            raise TypeError(f"chain's argument {i} must be a score_mod; got {type(fn).__name__}")
        _checks.check_arguments(f"chain's argument {i}", fn,
                                "score_mod(score, b, n, q_pos, k_pos)", 5)
    heads = {getattr(fn, "num_heads") for fn in mods if getattr(fn, "num_heads", None)}
    if len(heads) > 1:
        raise ValueError(f"chain's score_mods hold values for different numbers of query "
                         f"heads: {sorted(heads)}")

    def mod(score, b, n, q_pos, k_pos):
        for fn in mods:
            score = fn(score, b, n, q_pos, k_pos)
        return score

    # The last modification bounds the chain's values (chain(alibi(m), soft_cap(30))).
    if mods and hasattr(mods[-1], "bounds"):
        mod.bounds = mods[-1].bounds
    if heads:
        (mod.num_heads,) = heads
    return mod


# --------------------------------------------------------------------------------------
# The score spec of one call.


@_pytree.dataclass(data=("bias", "sinks", "align_params"), meta=("scale", "mod", "align"))
class Score:
    """How one attention call turns q and k into logits, and what joins its softmax.

    logits = score_mod(align(q, k) + bias), where align is the scaled dot product
    q·kᵀ·scale (or a learned alignment function with per-head parameters, dense only);
    then masking; `sinks` (one logit per query head) join every row's softmax
    denominator with a zero value vector. After binding, arrays are laid out per head
    as `[B|1, N|1, ...]` like the Mask's.
    """

    scale: float | None = None
    mod: ScoreMod | None = None
    align: Callable | None = None
    bias: Any = None
    sinks: Any = None
    align_params: Any = None

    def modify(self, logits, at):
        """logits + nothing else: the score_mod applied at the coordinates `at`."""
        if self.mod is None:
            return logits
        return apply_score_mod(self.mod, logits, (at.b, at.n, at.q_pos, at.k_pos),
                               self.bias is not None)


def check_alignment(out, t: int, s: int):
    """A learned alignment's logits, as they are; a ValueError unless they are `[T, S]`
    (a `[T, 1]` would broadcast over the keys: every output the sum of all values), a
    TypeError unless floating (a bool would be cast to logits of 0 and 1)."""
    if tuple(np.shape(out)) != (t, s):
        raise ValueError(f"the alignment score_fn(q, k) must return logits [T, S] = "
                         f"{_checks.shape_str((t, s))}; got {_checks.shape_str(np.shape(out))}")
    dtype = jnp.result_type(out)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"the alignment score_fn(q, k) must return floating logits; got "
                        f"{jnp.dtype(dtype).name}")
    return out


def apply_score_mod(mod, logits, args, biased: bool, block: bool = False):
    """`mod(logits, *args)` in the logits' dtype; a ValueError unless it has their shape
    (a broadcastable one would silently give every row the same scores), a TypeError
    unless it is floating (a bool or int one would be cast to scores silently).

    biased: the logits include a bias, whose −inf entries are a mask: they stay −inf,
    whatever score_mod makes of them (a soft cap would make −cap of them, a weight),
    and score_mod sees 0 there, so its derivative is not taken at −inf.

    block: the logits are a block of the chunked kernel's (its errors say so)."""
    hidden = (logits == -jnp.inf) if biased else None
    out = mod(logits if hidden is None else jnp.where(hidden, 0, logits), *args)
    if not isinstance(out, (jax.Array, np.ndarray, np.generic)):   # a Python number, say
        raise TypeError(f"score_mod must return an array of scores, the score's shape "
                        f"{_checks.shape_str(logits.shape)}; got {type(out).__name__}")
    if out.shape != logits.shape:
        where = (" (a block of the scores, which the chunked kernel gives score_mod: it "
                 "works elementwise on the scores and indices it is given; fixed [T, S] "
                 "logits are a bias=)") if block else ""
        raise ValueError(f"score_mod must return the score's shape "
                         f"{_checks.shape_str(logits.shape)}{where}; got "
                         f"{_checks.shape_str(out.shape)}")
    if not jnp.issubdtype(out.dtype, jnp.floating):
        # a mask written as a score_mod (j <= i), say: scores of 0 and 1, not a mask
        hint = (": a rule of which keys a query sees is a mask (masks.from_fn)"
                if out.dtype == jnp.bool_ else "")
        raise TypeError(f"score_mod must return floating scores (the score's dtype "
                        f"{jnp.dtype(logits.dtype).name}); got {jnp.dtype(out.dtype).name}"
                        f"{hint}")
    out = out.astype(logits.dtype)
    return out if hidden is None else jnp.where(hidden, logits, out)
