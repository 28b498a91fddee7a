"""No NaN anywhere: empty rows, padded queries, half precision, huge logits."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from tests import draws
from tests.numerics import as_users_run, softmax_float64

B, T, S, N, H, V = 2, 5, 7, 3, 4, 6
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _qkv(rng, dtype, scale=1.0):
    generator = draws.host(rng)
    return (draws.normal(generator, (B, T, N, H), dtype, scale),
            draws.normal(generator, (B, S, N, H), dtype, scale),
            draws.normal(generator, (B, S, N, V), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_and_padded_rows_are_zero_with_zero_finite_gradients(rng, dtype):
    q, k, v = _qkv(rng, dtype)
    # Row 1 of example 0 sees no key (mask); rows ≥ 3 of example 1 are padding.
    mask = jnp.ones((B, 1, T, S), bool).at[0, 0, 1].set(False)
    q_len = jnp.array([T, 3], jnp.int32)

    def run(q, k, v):
        return attnjax.dot_product_attention(q, k, v, mask=mask, query_lengths=q_len)

    out = run(q, k, v)
    chex.assert_type(out, dtype)
    assert jnp.all(out[0, 1] == 0)
    assert jnp.all(out[1, 3:] == 0)
    assert jnp.all(out[0, 0] != 0)

    def loss(q, k, v):
        return jnp.sum(run(q, k, v).astype(jnp.float32) ** 2)

    gq, gk, gv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    chex.assert_tree_all_finite((gq, gk, gv))
    assert jnp.all(gq[0, 1] == 0)
    assert jnp.all(gq[1, 3:] == 0)
    assert jnp.any(gq[0, 0] != 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_keys_masked_everywhere_gives_zeros_not_nan(rng, dtype):
    q, k, v = _qkv(rng, dtype)
    mask = jnp.zeros((1, 1, 1, S), bool)
    out, weights = attnjax.dot_product_attention(q, k, v, mask=mask, return_weights=True)
    assert jnp.all(out == 0) and jnp.all(weights == 0)
    grads = jax.grad(lambda q: attnjax.dot_product_attention(
        q, k, v, mask=mask).astype(jnp.float32).sum())(q)
    assert jnp.all(grads == 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_logits_of_magnitude_1e4_stay_finite_and_close_to_float32(rng, dtype):
    # Entries near 70 with H = 4 and scale 1/2 give logits of order 1e4, past float16's
    # range once squared but fine when accumulated in float32.
    q, k, v = _qkv(rng, dtype, scale=70.0)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    logits = jnp.einsum("btnh,bsnh->bnts", q32, k32) / 2.0
    assert float(jnp.max(jnp.abs(logits))) > 1e4
    out = attnjax.dot_product_attention(q, k, v, is_causal=True)
    chex.assert_type(out, dtype)
    chex.assert_tree_all_finite(out)
    expected = attnjax.dot_product_attention(q32, k32, v32, is_causal=True)
    np.testing.assert_allclose(out.astype(jnp.float32), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_16_bit_queries_are_not_rounded_again_by_the_scale(rng, dtype, implementation):
    """1/√32 is no power of two: scaling bfloat16 or float16 queries by it rounded each
    again, twice jax.nn's error (which scales the float32 logits); a scale of 1e-7
    became float16's 1.19e-7, and 2⁻³⁰, a power of two, made float16 queries of 1e4
    subnormal. Against float64 on the same rounded inputs, attnjax's error is at most
    jax.nn's, for a number and for a scale traced under jit."""
    generator = draws.host(rng)
    h = 32
    q = draws.normal(generator, (4, 32, 2, h), dtype, 6.0)
    k, v = (draws.normal(generator, (4, 32, 2, h), dtype) for _ in range(2))
    for scale, q_, k_ in ((h ** -0.5, q, k), (1e-7, q * 300, k * 300),
                          (2.0 ** -30, q * 1000, k * 1000)):
        expected = np.asarray(softmax_float64(q_, k_, v, scale))
        error = lambda out: np.abs(np.asarray(out, np.float64) - expected).mean()  # noqa: E731
        with as_users_run():
            theirs = error(jax.nn.dot_product_attention(q_, k_, v, scale=scale))
        ours = error(attnjax.dot_product_attention(q_, k_, v, scale=scale,
                                                   implementation=implementation))
        traced = error(jax.jit(lambda s: attnjax.dot_product_attention(
            q_, k_, v, scale=s, implementation=implementation))(jnp.float32(scale)))
        assert ours <= theirs and traced <= theirs, (scale, ours, traced, theirs)


def _float64_grads(f, q, k, v, d_out):
    """The vjp of f at (q, k, v) for the float32 d_out, on the host in float64."""
    _, vjp = jax.vjp(lambda *x: f(*x).astype(jnp.float32), q, k, v)
    return [np.asarray(g, np.float64) for g in vjp(d_out)]


def _exact_grads(q, k, v, d_out, scale, causal=False):
    """_float64_grads of `softmax_float64` at the inputs' values, in float64."""
    wide = [x.astype(jnp.float64) for x in (q, k, v)]
    return _float64_grads(lambda *x: softmax_float64(*x, scale, causal=causal), *wide,
                          d_out)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_16_bit_gradients_where_keys_share_a_large_part_are_as_exact_as_jax_nn_s(
        rng, dtype, implementation):
    """Keys with a common part far above their differences (as trained models' keys
    have): d_q = Σ ds·k cancels it, so any inconsistency between the weights and the
    output the backward pass reads comes back times |k|. Both kernels' derivatives read
    an output that was not P v: the dense one's rounded to 16 bits, the chunked one's
    made of weights rounded to 16 bits (rowsum(dO ∘ O) is not rowsum(dP ∘ P) then):
    d_q's error 7-40 times jax.nn's (float64 on the rounded inputs the yardstick); now
    at most twice it (as often below it)."""
    generator = draws.host(rng)
    q = draws.normal(generator, (2, 24, 2, 16), dtype, 2.0)
    k = (draws.normal(generator, (2, 1, 2, 16), jnp.float32, 30.0)
         + draws.normal(generator, (2, 24, 2, 16), jnp.float32, 2.0)).astype(dtype)
    v = draws.normal(generator, (2, 24, 2, 16), dtype)
    d_out = draws.normal(generator, (2, 24, 2, 16), jnp.float32)
    want = _exact_grads(q, k, v, d_out, 16 ** -0.5, causal=True)

    def errors(f):
        return np.array([np.abs(g - w).max() / np.abs(w).max()
                         for g, w in zip(_float64_grads(f, q, k, v, d_out), want)])

    with as_users_run():
        theirs = errors(lambda *x: jax.nn.dot_product_attention(*x, is_causal=True))
    ours = errors(lambda *x: attnjax.dot_product_attention(*x, is_causal=True,
                                                           implementation=implementation))
    assert np.all(ours <= 3 * theirs), (ours, theirs)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_bfloat16_alibi_slopes_gradient_is_float32_exact(rng, implementation):
    """A score_mod's parameters in bfloat16 (ALiBi's slopes, float32): their gradient
    sums dS over the grid, which the dense kernel's dP = dO·vᵀ, rounded to bfloat16,
    had left 4e-3 off (relative); float32-exact now in both kernels."""
    from attnjax import scores

    generator = draws.host(rng)
    q = draws.normal(generator, (2, 24, 4, 16), jnp.bfloat16, 2.0)
    k = draws.normal(generator, (2, 32, 2, 16), jnp.bfloat16, 2.0)
    v = draws.normal(generator, (2, 32, 2, 16), jnp.bfloat16)
    d_out = draws.normal(generator, (2, 24, 4, 16), jnp.bfloat16).astype(jnp.float64)
    # [1, 1, T, S]: bottom-right positions, query i at i + S − T
    distance = jnp.abs(jnp.arange(24)[:, None] + 8 - jnp.arange(32)[None]).astype(
        jnp.float64)[None, None]

    def exact(slopes):
        out = softmax_float64(q, k, v, 16 ** -0.5,
                              bias=-slopes[None, :, None, None] * distance)
        return jnp.sum(out * d_out)

    def ours(slopes):
        out = attnjax.dot_product_attention(q, k, v, score_mod=scores.alibi(slopes),
                                            implementation=implementation)
        return jnp.sum(out.astype(jnp.float64) * d_out)

    slopes = scores.alibi_slopes(4)
    want = np.asarray(jax.grad(exact)(slopes.astype(jnp.float64)))
    got = np.asarray(jax.grad(ours)(slopes), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_bfloat16_query_gradient_of_two_alike_keys_is_exact(implementation):
    """One query, two keys along it of logits 100 and 97: d_q = ds₀·(k₀ − k₁), the
    difference of two products of 100 and 97. The dense kernel's came out −0.867 (the
    exact value +0.379: its derivative read the rounded output), the chunked one's
    +0.186 (it read it too, and rounded ds to bfloat16 for the product with k); jax.nn's:
    +0.379."""
    h = 64
    e0 = jnp.zeros(h, jnp.float32).at[0].set(1.0)
    q = e0.reshape(1, 1, 1, h).astype(jnp.bfloat16)
    logits = jnp.asarray([100.0, 97.0], jnp.float32)[:, None]
    k = (logits * e0[None]).reshape(1, 2, 1, h).astype(jnp.bfloat16)
    v = draws.normal(0, (1, 2, 1, h), jnp.bfloat16)
    d_out = draws.normal(1, (1, 1, 1, h), jnp.float32)

    want = _exact_grads(q, k, v, d_out, 1.0)
    got = _float64_grads(lambda *x: attnjax.dot_product_attention(
        *x, scale=1.0, implementation=implementation), q, k, v, d_out)
    for g, w in zip(got, want):   # bfloat16's rounding of the results: 2⁻⁸ relative
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_float16_query_gradient_that_fits_float16_is_finite(implementation):
    """The scale 1/8 of H = 64 had scaled the float16 queries, so their gradient came
    back as the logits' in float16 times 8, past 65504 (inf) where d_q itself, 41,831,
    fits; the float32 logits take every scale of float16 queries now."""
    h = 64
    e0 = jnp.zeros(h, jnp.float32).at[0].set(1.0)
    q = (1e-3 * e0).reshape(1, 1, 1, h).astype(jnp.float16)
    signs = jnp.asarray([1.0, -1.0], jnp.float32)[:, None]
    k = (3000 * signs * e0[None]).reshape(1, 2, 1, h).astype(jnp.float16)
    v = (2 * signs * jnp.ones((1, h), jnp.float32)).reshape(1, 2, 1, h).astype(jnp.float16)
    d_out = jnp.ones((1, 1, 1, h), jnp.float32)
    want = _exact_grads(q, k, v, d_out, h ** -0.5)
    got = _float64_grads(lambda *x: attnjax.dot_product_attention(
        *x, implementation=implementation), q, k, v, d_out)
    assert want[0][0, 0, 0, 0] > 4e4
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-3 * np.abs(w).max())


def test_float16_logits_of_a_scale_above_1_stay_finite_in_the_2d_functions():
    """attnjax.attention and attention_weights on float16 with scale=1000: q·scale was
    inf in float16 (then NaN); the float32 logits take the scale, as in float32."""
    q = jnp.full((4, 16), 100.0, jnp.float16)
    k = (draws.normal(0, (6, 16), jnp.float16) * jnp.float16(0.01)).astype(jnp.float16)
    v = draws.normal(1, (6, 16), jnp.float16)
    for fn, args in ((attnjax.attention, (q, k, v)), (attnjax.attention_weights, (q, k))):
        out = fn(*args, scale=1000.0)
        expected = fn(*(x.astype(jnp.float32) for x in args), scale=1000.0)
        chex.assert_type(out, jnp.float16)
        chex.assert_tree_all_finite(out)
        np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=1e-2, atol=1e-2)
