"""The dense kernel: one head, all T×S logits materialised.

The reference kernel, and the only one that can return the weights or use a learned
alignment function. It evaluates the Mask on the whole `[T, S]` grid. Plain scaled-dot
attention (with or without a bias; no score_mod, sinks, alignment, dropout or returned
weights) has its derivative written out, as FlashAttention's; autodiff differentiates
everything else, score_mod and sinks included. The batched API (`attnjax.attention`)
vmaps it over heads and batch.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from attnjax import core
from attnjax.masks import Mask
from attnjax.options import Options
from attnjax.scores import Score, _logits_dtype, check_alignment, split_scale


def attend(
    q: Float[Array, "T _Hq"],
    k: Float[Array, "S _Hk"],
    v: Float[Array, "S V"],
    mask: Mask,
    score: Score,
    options: Options,
    group: int = 1,
) -> tuple[Float[Array, "T V"], Float[Array, " T"], Float[Array, "T S"] | None]:
    """Output `[T, V]`, log-sum-exp `[T]` and, if asked, the weights `[T, S]` (before
    dropout) of one head, one of the `group` query heads that share k and v."""
    t, s = q.shape[0], k.shape[0]
    at = mask.coords(0, t, 0, s)
    acc = _logits_dtype(q.dtype)
    visible = None if mask.is_everything else mask.visible(at)
    rows = cols = None
    if visible is not None:
        # Rows and columns that see nothing are kept out of every product with a zero
        # weight: a NaN or inf in padding must not reach a valid output or gradient.
        # (behind a barrier: XLA would evaluate them at compile time for a mask that is
        # a constant of the program, seconds for a [512, 512] one)
        seen = jax.lax.optimization_barrier(visible)
        rows, cols = jnp.any(seen, axis=1), jnp.any(seen, axis=0)
    q_scale, logit_scale = split_scale(score.scale, q.dtype)
    if (score.align is None and score.mod is None and score.sinks is None
            and options.dropout_rate == 0.0 and not options.return_weights):
        out, lse = _plain(q * jnp.asarray(q_scale, q.dtype), k, v, score.bias,
                          visible, rows, cols, group == 1, logit_scale)
        return out, lse, None
    if visible is not None:
        v = jnp.where(cols[:, None], v, 0)
    if score.align is None:
        q = q * jnp.asarray(q_scale, q.dtype)
        # [T, S]
        logits = (core.contract_last(q, k, acc) if visible is None
                  else _seen_logits(q, k, rows, cols))
        logits = logits if logit_scale == 1.0 else logits * logit_scale
    else:
        if visible is not None:
            q, k = jnp.where(rows[:, None], q, 0), jnp.where(cols[:, None], k, 0)
        logits = check_alignment(score.align(q, k, **score.align_params), t, s).astype(acc)
    if score.bias is not None:
        logits = logits + score.bias.astype(acc)
    if score.mod is not None and visible is not None:
        # The logits of hidden entries are a NaN's product where q or k holds one there;
        # score_mod gets 0 instead, so its derivative there (0 · f'(NaN)) stays 0.
        logits = jnp.where(visible, logits, 0)
    logits = score.modify(logits, at)
    weights, lse = core.softmax_and_lse(logits, visible, score.sinks)
    mixed = weights
    if options.dropout_rate > 0.0:
        keep = jax.random.bernoulli(options.dropout_key, 1.0 - options.dropout_rate,
                                    weights.shape)
        mixed = jnp.where(keep, weights / (1.0 - options.dropout_rate), 0.0)
    out = core.mix_values(mixed, v)
    return out, lse, (weights.astype(q.dtype) if options.return_weights else None)


# Up to this many logits per head, the masked logits' backward pass copies the cotangent
# transposed for a fast product (core.contract_last); beyond, the copy costs more than
# the slow product it avoids. A causal attention training step on a 2-core CPU
# (benchmarks/train_step.py): at T=64, 0.99× flax's speed with the copy, 0.90× without;
# at T=512, 0.92× with it, 1.18× without.
_SMALL_GRID = 128 * 128

# Between these logits per head (exclusive, inclusive), the term P dv of the plain
# kernel's derivative is an einsum, whose transpose (dv's cotangent, Pᵀ dO) contracts
# the leading axis of P; outside, it is contract_last's barrier form, which copies dO
# transposed. A causal / unmasked attention training step on a 2-core CPU
# (benchmarks/train_step.py's step, flax / attnjax): at (B, T, D, N) = (128, 16, 64, 4),
# the copy model's, 0.92-0.94 / 1.00-1.08 with the einsum, 1.10-1.12 / 1.16-1.28 with
# the barrier form (the copy model's whole step 1.00-1.02 -> 1.07); at (64, 32, 64, 4)
# and (32, 64, 64, 4) the barrier form is 3-18% faster too; at (32, 64, 128, 4) the two
# are even; at (16, 128, 128, 4) the einsum is faster unmasked (1.36-1.41 against 1.25)
# and even causal; at T=512, the barrier form is faster. The small grids' form is a CPU
# one (other backends, not measured, keep the einsum there).
_MIX_EINSUM_GRIDS = (64 * 64, _SMALL_GRID)


@jax.custom_jvp
def _seen_logits(q, k, rows, cols):
    """q·kᵀ `[T, S]` whose derivatives read q only on `rows` and k only on `cols`.

    The entries of other rows and columns are masked afterwards, so their derivatives
    do not matter; reading a NaN in a hidden query or key there would still turn a zero
    gradient into NaN (0·NaN). The value itself is the plain product.
    """
    return core.contract_last(q, k, _logits_dtype(q.dtype))


@functools.partial(_seen_logits.defjvp, symbolic_zeros=True)
def _seen_logits_jvp(primals, tangents):
    q, k, rows, cols = primals
    d_q, d_k = tangents[:2]
    q_seen, k_seen = jnp.where(rows[:, None], q, 0), jnp.where(cols[:, None], k, 0)
    tangent = _logits_tangent(q_seen, k_seen, d_q, d_k, _logits_dtype(q.dtype))
    return _seen_logits(q, k, rows, cols), tangent


def _logits_tangent(q, k, d_q, d_k, acc):
    """The tangent `[T, S]` of q·kᵀ; None where d_q and d_k are both symbolic zeros
    (`core.is_zero`), whose terms are left out."""
    if core.is_zero(d_q) and core.is_zero(d_k):
        return None
    if q.shape[0] * k.shape[0] <= _SMALL_GRID:
        # contract_last's tangent: its transpose takes no product over a leading axis
        return core.sum_of([
            None if core.is_zero(d_q) else core.contract_last(d_q, k, acc),
            None if core.is_zero(d_k) else core.contract_last_tangent_in_b(q, d_k, acc)])
    return core.sum_of([
        None if core.is_zero(d_q) else jnp.einsum("TH,SH->TS", d_q, k,
                                                  preferred_element_type=acc),
        None if core.is_zero(d_k) else jnp.einsum("TH,SH->TS", q, d_k,
                                                  preferred_element_type=acc)])


@functools.partial(jax.custom_jvp, nondiff_argnums=(7, 8))
def _plain(q, k, v, bias, visible, rows, cols, alone, logit_scale):
    """(out `[T, V]`, lse `[T]`) of softmax(q·kᵀ·logit_scale + bias) v over the visible
    entries, for q already scaled by the rest of the scale (`split_scale`); v's hidden
    columns (not `cols`) count as zero. `alone`: no other query head shares k and v.

    Its derivative is written so that reverse mode computes FlashAttention's backward
    pass, dS = P ∘ (dP − rowsum(dO ∘ O) + d_lse): a row sum over `[T, V]` where
    autodiff of the softmax takes one over `[T, S]` (as it does for 16-bit inputs,
    whose O is rounded); of the `[T, S]` arrays, only the weights are kept for the
    backward pass. Forward mode and higher orders work too.
    """
    # The value alone (no derivative taken) divides by each row's sum after the
    # product, over [T, V] rather than [T, S]: one pass over the logits fewer, as
    # FlashAttention's forward does.
    # One query sums as it reads k and v: once per query head, where products read them
    # once for all the heads that share them (grouped-query attention). A group's
    # query takes the products, unless its keys are few enough that the products are
    # too small for XLA's CPU dots. Decoding steps with key lengths on a 2-core CPU,
    # against jax.nn, summed / as products: (B, S, N, K, H) = (16, 256, 8, 2, 64) 0.60x /
    # 1.10x, (16, 256, 8, 2, 32) 0.40x / 1.16x, (8, 1024, 8, 2, 64) 0.86x / 1.32x;
    # (1000, 29, 4, 2, 16) 1.46x / 0.97x, so summed.
    one_query = q.shape[0] == 1 and (alone or k.shape[0] <= core.ONE_PASS_TERMS)
    unnormalised, total, lse = core.exp_and_total(
        _logits(q, k, bias, logit_scale, one_pass=one_query), visible)
    return _weights_times_values(unnormalised, v, cols, total, one_query), lse


def _in_one_pass(terms: int) -> bool:
    """Whether one query's sum of `terms` terms is taken as they are computed
    (`core.sums_in_one_pass`): on a CPU, up to core.ONE_PASS_TERMS. Longer sums XLA
    splits anyway; other backends fuse a plain sum with its terms themselves."""
    return jax.default_backend() == "cpu" and terms <= core.ONE_PASS_TERMS


def _logits(q, k, bias, logit_scale: float, *, one_pass: bool = False):
    """q·kᵀ·logit_scale + bias `[T, S]` in float32 (float64 for float64 inputs). With
    one_pass (one query, the value alone: no derivative), the logits are summed as k is
    read."""
    acc = _logits_dtype(q.dtype)
    if one_pass and _in_one_pass(q.shape[1]):
        # A decoding step: each logit a sum over H. XLA's CPU backend runs the product
        # over 1 x S per head as many small ones, and reads a cache in flax's [S, K, H]
        # layout through a transposed copy: for the dates model's 4,000 heads of H = 16,
        # 2.4x as long.
        (logits,) = core.sums_in_one_pass((q.astype(acc) * k.astype(acc),), axis=-1)
        logits = logits[None]
    else:
        logits = core.contract_last(q, k, acc)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    return logits if bias is None else logits + bias.astype(acc)


def _plain_forward(q, k, v, bias, visible, logit_scale):
    weights, lse = core.softmax_and_lse(_logits(q, k, bias, logit_scale), visible)
    return (core.mix_values(weights, v), lse), weights


def _weights_times_values(weights, v, cols, total, one_query: bool):
    """weights · v / total (weights `[T, S]`, each row's total `[T, 1]`), the value
    where no derivative is taken, with v's hidden columns (not `cols`) selected away.

    As XLA's CPU products read v, `[S, V]` as it is (core.mix_values reads vᵀ, for its
    derivative's sake). For one_query (a decoding step's query that reads v without
    other heads: see _plain) the product is one pass over v, and zeroing the hidden
    columns first would be two more (a copy of v): the select goes into the sum
    instead, Σ_s [s seen] w_s v_s, one pass. A decoding step of the
    dates model (1,000 sequences, benchmarks/decode.py) went from 8.0-9.1 to 6.4-7.0 ms;
    one step against a cache of S = 1024, B = 8, N = K = 8, H = 64, from 11.5 to 3.2 ms.
    On a CPU, up to core.ONE_PASS_TERMS keys, the sum is taken as v is read, with the
    weights' own (`core.sums_in_one_pass`): each row is divided by the sum of the same
    weights in the same order (1 for a row that sees nothing).
    """
    acc = _logits_dtype(v.dtype)
    if cols is not None and one_query:
        # [S, V]
        spread = jnp.broadcast_to(weights.astype(acc).T, v.shape)
        terms = jnp.where(cols[:, None], spread * v.astype(acc), 0)
        if _in_one_pass(v.shape[0]):
            out, summed = core.sums_in_one_pass((terms, spread), axis=0)
            return (out / jnp.where(summed > 0, summed, 1))[None].astype(v.dtype)
        out = jnp.sum(terms, axis=0, keepdims=True)
    else:
        if cols is not None:
            v = jnp.where(cols[:, None], v, 0)
        out = jnp.einsum("TS,SV->TV", weights.astype(v.dtype), v, preferred_element_type=acc)
    return (out / total).astype(v.dtype)


@functools.partial(_plain.defjvp, symbolic_zeros=True)
def _plain_jvp(alone, logit_scale, primals, tangents):
    q, k, v, bias, visible, rows, cols = primals
    # (tangents known to be zero, `core.is_zero`, take no product)
    d_q, d_k, d_v, d_bias = tangents[:4]
    if visible is not None:
        # hidden rows and columns meet only zero weights; a NaN there must not make 0·NaN.
        # The logits read the same selected q and k as their derivatives do (a hidden
        # row's or column's logits are masked either way): one copy of each, not two.
        q, k = jnp.where(rows[:, None], q, 0), jnp.where(cols[:, None], k, 0)
        v = jnp.where(cols[:, None], v, 0)
        d_v = d_v if core.is_zero(d_v) else jnp.where(cols[:, None], d_v, 0)
    (out, lse), weights = _plain_forward(q, k, v, bias, visible, logit_scale)
    acc = weights.dtype
    d_logits = _logits_tangent(q, k, d_q, d_k, acc)
    if d_logits is not None and logit_scale != 1.0:
        d_logits = d_logits * logit_scale
    if bias is not None and not core.is_zero(d_bias):
        d_logits = core.sum_of([d_logits,
                                jnp.broadcast_to(d_bias.astype(acc), weights.shape)])
    # d softmax = P ∘ (dS − rowsum(P ∘ dS)), so d(P v) = (P ∘ dS) v − rowsum(P ∘ dS) ∘ O
    # + P dv: written with O, its transpose sums dO ∘ O over [T, V], not dP ∘ P.
    d_lse = weighted_mix = mixed_tangent = None
    if d_logits is not None:
        weighted = weights * d_logits
        d_lse = jnp.sum(weighted, axis=-1)
        if v.dtype != acc:
            # In 16 bits O, rounded, is not P v: rowsum(dO ∘ O) missed rowsum(dP ∘ P) by
            # far more than dP's rounding, and in a row of sharp weights d_q took the
            # difference times |k| (d_q of the wrong sign in bfloat16). (P ∘ dS −
            # P · rowsum(P ∘ dS)) v instead, transposed a row sum over [T, S].
            weighted = weighted - weights * d_lse[:, None]
        # (P ∘ dS) v with v in the accumulator's dtype: transposed, dP = dO vᵀ stays in
        # it. In half precision, v's dtype there rounded dP (of the weights' bfloat16
        # copy), which rowsum(dO ∘ O) then no longer cancels: a row that sees one key had
        # a bias gradient of −0.029 in bfloat16 (jax's nn_test), where the exact value is 0.
        weighted_mix = core.contract_last(weighted, v.astype(acc).T, acc)
    if not core.is_zero(d_v):
        # P dv: the barrier form (contract_last's tangent) on large grids and, on a CPU,
        # on small ones; the einsum between them (see _MIX_EINSUM_GRIDS).
        small = _MIX_EINSUM_GRIDS[0] if jax.default_backend() == "cpu" else 0
        if small < weights.size <= _MIX_EINSUM_GRIDS[1]:
            mixed_tangent = jnp.einsum("TS,SV->TV", weights.astype(v.dtype), d_v,
                                       preferred_element_type=acc)
        else:
            mixed_tangent = core.contract_last_tangent_in_b(weights.astype(v.dtype), d_v.T,
                                                            acc)
    d_mixed = core.sum_of([weighted_mix, mixed_tangent])
    if d_lse is None:
        d_lse = jnp.zeros_like(lse)
    elif v.dtype == acc:
        d_mixed = d_mixed - d_lse[:, None] * out.astype(acc)
    return (out, lse), (d_mixed.astype(out.dtype), d_lse)
