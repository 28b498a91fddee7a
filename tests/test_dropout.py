"""Inverted dropout on the attention weights."""

import jax
import jax.numpy as jnp
import numpy as np

import attnjax

B, T, S, N, K, H, V = 2, 5, 7, 4, 2, 3, 6


def _qkv(rng):
    kq, kk, kv = jax.random.split(rng, 3)
    return (
        jax.random.normal(kq, (B, T, N, H), jnp.float32),
        jax.random.normal(kk, (B, S, K, H), jnp.float32),
        jax.random.normal(kv, (B, S, K, V), jnp.float32),
    )


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
    q, k, v = _qkv(rng)
    rate, draws = 0.4, 4000
    expected = np.asarray(attnjax.dot_product_attention(q, k, v), np.float64)
    sample = jax.jit(jax.vmap(lambda key: attnjax.dot_product_attention(
        q, k, v, dropout_rate=rate, dropout_rng=key)))
    outs = np.asarray(sample(jax.random.split(jax.random.fold_in(rng, 1), draws)), np.float64)
    mean, sem = outs.mean(0), outs.std(0) / np.sqrt(draws)
    # Every element within 5 standard errors (3σ would fail ~0.3% of 480 elements
    # by chance), and a fixed random projection of all of them within 3σ.
    assert np.all(np.abs(mean - expected) <= 5 * sem + 1e-6)
    w = np.asarray(jax.random.normal(jax.random.fold_in(rng, 2), expected.shape, jnp.float64))
    proj = (outs * w).sum(axis=(1, 2, 3, 4))
    assert abs(proj.mean() - (expected * w).sum()) <= 3 * proj.std() / np.sqrt(draws)


def test_masks_differ_across_examples_and_heads(rng):
    # Identical data in every example and head: only the dropout masks can tell them apart.
    kq, kk, kv = jax.random.split(rng, 3)
    q = jnp.broadcast_to(jax.random.normal(kq, (1, T, 1, H), jnp.float32), (B, T, N, H))
    k = jnp.broadcast_to(jax.random.normal(kk, (1, S, 1, H), jnp.float32), (B, S, K, H))
    v = jnp.broadcast_to(jax.random.normal(kv, (1, S, 1, V), jnp.float32), (B, S, K, V))
    plain = attnjax.dot_product_attention(q, k, v)
    np.testing.assert_allclose(plain[0], plain[1], rtol=1e-6)
    np.testing.assert_allclose(plain[:, :, 0], plain[:, :, 3], rtol=1e-6)
    out = attnjax.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(1))
    assert not np.allclose(out[0], out[1])
    for a in range(N):
        for b in range(a + 1, N):
            assert not np.allclose(out[:, :, a], out[:, :, b]), (a, b)
