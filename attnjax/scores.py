"""Alignment functions: how much query i attends to key j, before the softmax.

Each takes one example and one head, q `[T, H]` and k `[S, H]` (the additive and
bilinear forms allow different query and key widths), and returns logits `[T, S]`.
Learned parameters are bound with `functools.partial`, so every alignment function
fits the `score_fn(q, k)` slot of `attnjax.attention`:

    score_fn = functools.partial(attnjax.general_score, w=w)   # w [Hq, Hk]

Logits are accumulated in float32 (float64 for float64 inputs), whatever the input dtype.
"""

import jax.numpy as jnp
from jaxtyping import ArrayLike, Float

from attnjax import _checks


def _logits_dtype(dtype) -> jnp.dtype:
    # float16/bfloat16 products are accumulated in float32; float64 stays float64.
    return jnp.dtype(jnp.float64 if dtype == jnp.float64 else jnp.float32)


def dot_score(q: Float[ArrayLike, "T H"], k: Float[ArrayLike, "S H"]) -> Float[ArrayLike, "T S"]:
    """Luong's "dot" alignment: q kᵀ, unscaled."""
    _checks.check_same_last_dim("q", q, "k", k)
    # [T, S]
    return jnp.einsum("TH,SH->TS", q, k, preferred_element_type=_logits_dtype(q.dtype))


def scaled_dot_score(
    q: Float[ArrayLike, "T H"], k: Float[ArrayLike, "S H"], *, scale: float | None = None
) -> Float[ArrayLike, "T S"]:
    """The Transformer's alignment: q kᵀ · scale, with scale = 1/√H by default."""
    _checks.check_same_last_dim("q", q, "k", k)
    scale = _checks.resolve_scale(scale, q.shape[-1])
    # Scaling the [T, H] queries costs T·H multiplies instead of T·S on the logits.
    q = q * jnp.asarray(scale, dtype=q.dtype)
    # [T, S]
    return jnp.einsum("TH,SH->TS", q, k, preferred_element_type=_logits_dtype(q.dtype))


def general_score(
    q: Float[ArrayLike, "T _Hq"], k: Float[ArrayLike, "S _Hk"], *, w: Float[ArrayLike, "_Hq _Hk"]
) -> Float[ArrayLike, "T S"]:
    """Luong's "general" (bilinear) alignment: q W kᵀ with a learned W `[Hq, Hk]`."""
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
    """
    if w_q.ndim != 2 or w_k.ndim != 2 or v.ndim != 1:
        raise ValueError(
            "additive_score expects w_q [Hq, A], w_k [Hk, A] and v [A]; got "
            f"w_q {tuple(w_q.shape)}, w_k {tuple(w_k.shape)}, v {tuple(v.shape)}"
        )
    a = v.shape[0]
    _checks.check_param_shape("w_q", w_q, (q.shape[-1], a), "[Hq, A]")
    _checks.check_param_shape("w_k", w_k, (k.shape[-1], a), "[Hk, A]")
    acc = _logits_dtype(q.dtype)
    # [T, A]
    qa = jnp.einsum("TI,IA->TA", q, w_q.astype(q.dtype), preferred_element_type=acc)
    # [S, A]
    ka = jnp.einsum("SJ,JA->SA", k, w_k.astype(k.dtype), preferred_element_type=acc)
    # [T, S, A]
    hidden = jnp.tanh(qa[:, None, :] + ka[None, :, :])
    # [T, S]
    return jnp.einsum("TSA,A->TS", hidden, v.astype(acc))
