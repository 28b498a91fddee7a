"""No NaN anywhere: empty rows, padded queries, half precision, huge logits."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from tests import draws
from tests.numerics import as_users_run

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


def _float64_attention(q, k, v, scale):
    """softmax(q·kᵀ·scale) v in float64 on the host, of the inputs as they are rounded."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnv->btnv", weights, v)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_16_bit_queries_are_not_rounded_again_by_the_scale(rng, dtype, implementation):
    """1/√32 is no power of two: scaling bfloat16 or float16 queries by it rounded each
    again, twice jax.nn's error (which scales the float32 logits); a scale of 1e-7
    became float16's 1.19e-7. Against float64 on the same rounded inputs, attnjax's error
    is at most jax.nn's, for a number and for a scale traced under jit."""
    generator = draws.host(rng)
    h = 32
    q = draws.normal(generator, (4, 32, 2, h), dtype, 6.0)
    k, v = (draws.normal(generator, (4, 32, 2, h), dtype) for _ in range(2))
    for scale, q_, k_ in ((h ** -0.5, q, k), (1e-7, q * 300, k * 300)):
        expected = _float64_attention(q_, k_, v, scale)
        error = lambda out: np.abs(np.asarray(out, np.float64) - expected).mean()  # noqa: E731
        with as_users_run():
            theirs = error(jax.nn.dot_product_attention(q_, k_, v, scale=scale))
        ours = error(attnjax.dot_product_attention(q_, k_, v, scale=scale,
                                                   implementation=implementation))
        traced = error(jax.jit(lambda s: attnjax.dot_product_attention(
            q_, k_, v, scale=s, implementation=implementation))(jnp.float32(scale)))
        assert ours <= theirs and traced <= theirs, (scale, ours, traced, theirs)


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
