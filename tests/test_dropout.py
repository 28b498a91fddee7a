"""Inverted dropout on the attention weights."""

import jax
import numpy as np

import attnjax
from tests import draws

B, T, S, N, K, H, V = 2, 5, 7, 4, 2, 3, 6


def _qkv(rng):
    return draws.normals(rng, (B, T, N, H), (B, S, K, H), (B, S, K, V))


def test_rate_zero_is_the_identity(rng):
    q, k, v = _qkv(rng)
    plain = attnjax.dot_product_attention(q, k, v, is_causal=True)
    with_rng = attnjax.dot_product_attention(
        q, k, v, is_causal=True, dropout_rate=0.0, dropout_rng=jax.random.key(3))
    np.testing.assert_array_equal(plain, with_rng)


def test_same_rng_same_output_and_rate_changes_output(rng):
    q, k, v = _qkv(rng)
    run = lambda key: attnjax.dot_product_attention(  # noqa: E731
        q, k, v, dropout_rate=0.3, dropout_rng=key)
    np.testing.assert_array_equal(run(jax.random.key(5)), run(jax.random.key(5)))
    assert not np.allclose(run(jax.random.key(5)), run(jax.random.key(6)))
    assert not np.allclose(run(jax.random.key(5)), attnjax.dot_product_attention(q, k, v))


def test_mean_over_many_rngs_is_preserved(rng):
    generator = draws.host(rng)
    q, k, v = _qkv(generator)
    rate, samples = 0.4, 4000
    expected = np.asarray(attnjax.dot_product_attention(q, k, v), np.float64)
    sample = jax.jit(jax.vmap(lambda key: attnjax.dot_product_attention(
        q, k, v, dropout_rate=rate, dropout_rng=key)))
    outs = np.asarray(sample(jax.random.split(jax.random.fold_in(rng, 1), samples)), np.float64)
    mean, sem = outs.mean(0), outs.std(0) / np.sqrt(samples)
    # Every element within 5 standard errors (3σ would fail ~0.3% of 480 elements
    # by chance), and a fixed random projection of all of them within 3σ.
    assert np.all(np.abs(mean - expected) <= 5 * sem + 1e-6)
    w = generator.standard_normal(expected.shape)
    proj = (outs * w).sum(axis=(1, 2, 3, 4))
    assert abs(proj.mean() - (expected * w).sum()) <= 3 * proj.std() / np.sqrt(samples)


def test_masks_differ_across_examples_and_heads(rng):
    # Identical data in every example and head: only the dropout masks can tell them apart.
    one = draws.normals(rng, (1, T, 1, H), (1, S, 1, H), (1, S, 1, V))
    q, k, v = (jax.device_put(np.broadcast_to(x, shape)) for x, shape in
               zip(one, ((B, T, N, H), (B, S, K, H), (B, S, K, V))))
    plain = attnjax.dot_product_attention(q, k, v)
    np.testing.assert_allclose(plain[0], plain[1], rtol=1e-6)
    np.testing.assert_allclose(plain[:, :, 0], plain[:, :, 3], rtol=1e-6)
    out = attnjax.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(1))
    assert not np.allclose(out[0], out[1])
    for a in range(N):
        for b in range(a + 1, N):
            assert not np.allclose(out[:, :, a], out[:, :, b]), (a, b)
