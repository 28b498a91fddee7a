"""Bounded score modifications in the chunked kernel: soft_cap's fixed row shift and its
division-free form on the blocks whose logits lie within ±cap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax import chunked, masks, scores
from attnjax.core import MASKED
from tests import draws
from tests.numerics import relative_error

B, T, N, K, H = 2, 200, 4, 2, 16
BLOCKS = (64, 64)


def _ulps(actual, exact):
    """|actual − exact| in float32 ulps of the exact value."""
    exact = np.asarray(exact, np.float64)
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return np.abs(np.asarray(actual, np.float64) - exact) / ulp


@pytest.mark.parametrize("cap", [0.001, 1.0, 30.0, 1000.0])
def test_soft_cap_near_zero_form_is_tanh_within_2_5_ulp(cap):
    limit, near = scores.soft_cap(cap).near_zero
    assert limit == cap
    rs = np.random.RandomState(int(cap * 1000) % 2**31)
    s = (rs.uniform(-1.0, 1.0, 200_000) * cap).astype(np.float32)
    exact = cap * np.tanh(s.astype(np.float64) / cap)
    values = np.asarray(jax.jit(near)(jax.device_put(s)))
    nonzero = s != 0
    assert _ulps(values, exact)[nonzero].max() <= 2.5
    # its derivative is 1 − tanh², as autodiff of the exact form gives
    slopes = np.asarray(jax.jit(jax.vmap(jax.grad(near)))(jax.device_put(s[:2000])))
    np.testing.assert_allclose(slopes, 1 - np.tanh(s[:2000].astype(np.float64) / cap) ** 2,
                               rtol=0, atol=3e-7)


def _heads_first(q, scale, block_q):
    """q `[B, T, N, H]` as the kernel holds it: pre-scaled, `[B, K, G, Tp, H]`."""
    b, t, n, h = q.shape
    q = (q * scale).reshape(b, t, K, n // K, h).transpose(0, 2, 3, 1, 4)
    padded = -(-t // block_q) * block_q
    return jnp.pad(q, ((0, 0),) * 3 + ((0, padded - t), (0, 0)))


def _inputs(seed):
    generator = draws.host(seed)
    q = generator.standard_normal((B, T, N, H)).astype(np.float32)
    # the second and the fourth query block far larger: their logits pass ±cap
    q[:, (np.arange(T) // BLOCKS[0]) % 2 == 1] *= 8.0
    k, v, d_out, sinks = draws.normals(generator, (B, T, K, H), (B, T, K, H), (B, T, N, H),
                                       (N,))
    return jax.device_put(q), k, v, d_out, sinks


def test_near_zero_blocks_are_sound_and_both_kinds_occur():
    cap = 30.0
    q, k, *_ = _inputs(0)
    scale = H ** -0.5
    q_hf = _heads_first(q, scale, BLOCKS[0])
    plan = chunked._Plan(T, T, *BLOCKS)
    norms = chunked.row_norms(q.reshape(B, T, K, N // K, H), k)
    # keys head-major, [B, K, 1, S, H], as ring attention carries them: the same norms
    head_major = chunked.row_norms(q.reshape(B, T, K, N // K, H),
                                   jnp.moveaxis(k, 1, 2)[:, :, None])
    np.testing.assert_array_equal(head_major[1], norms[1])
    near = np.asarray(chunked._near_table(plan, norms, scale, cap))
    k = jnp.pad(k, ((0, 0), (0, plan.padded_s - T), (0, 0), (0, 0)))
    assert near.shape == (plan.num_q_blocks, plan.num_k_blocks)
    # [B, K, G, Tp, Sp]: every head's logits, and their largest magnitude per block
    logits = jnp.einsum("bkgth,bskh->bkgts", q_hf, k)
    largest = np.abs(np.asarray(logits)).reshape(
        logits.shape[:3] + (near.shape[0], BLOCKS[0], near.shape[1], BLOCKS[1])
    ).max(axis=(0, 1, 2, 4, 6))
    assert np.all(largest[near] <= cap)
    assert near.any() and not near.all()
    # the large query blocks are the ones left out
    assert not near[1].any() and near[0].all()


def _dense_and_chunked(q, k, v, d_out, sinks, mask, mod):
    results = []
    for implementation, blocks in (("dense", None), ("chunked", BLOCKS)):
        def loss(q, k, v, sinks, implementation=implementation, blocks=blocks):
            out = attnjax.dot_product_attention(
                q, k, v, mask=mask, score_mod=mod, sinks=sinks,
                implementation=implementation, block_sizes=blocks)
            return jnp.sum(out * d_out), out
        grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sinks)
        results.append((out, grads))
    return results


@pytest.mark.parametrize("causal, cap", [(False, 30.0), (True, 30.0), (True, 40.0)])
def test_soft_cap_on_mixed_blocks_equals_dense(causal, cap):
    """Blocks within ±cap take the polynomial, the others tanh: outputs and gradients
    (q, k, v, sinks) equal dense attention's in float32. cap 40: the range 80 is too
    wide for a fixed shift, so rows keep a running maximum (taken before squashing)."""
    q, k, v, d_out, sinks = _inputs(1)
    mask = masks.causal() if causal else None
    mod = scores.soft_cap(cap)
    facts = chunked._facts(mod, [], None, jnp.float32, jnp.float32)
    assert (facts.ceiling is None) == (cap == 40.0)
    run = jax.jit(lambda *a: _dense_and_chunked(*a, mask, mod))
    (dense_out, dense_grads), (out, grads) = run(q, k, v, d_out, sinks)
    assert relative_error(out, dense_out) < 2e-5
    for name, got, want in zip("qkv", grads[:3], dense_grads[:3]):
        assert relative_error(got, want) < 2e-5, name
    assert relative_error(grads[3], dense_grads[3]) < 2e-5


def test_bounded_shift_keeps_rows_of_very_negative_logits():
    """With every logit of a row at about −cap (range 2·cap = 64, BOUNDED_RANGE), the
    weights exp(−2·cap) stay normal floats: the row averages its values instead of
    seeing nothing."""
    cap = chunked.BOUNDED_RANGE / 2
    generator = draws.host(2)
    k = generator.standard_normal((1, 40, 1, H)).astype(np.float32)
    k[..., 0] = 3.0 + np.abs(k[..., 0])
    # every query −100·e₀: q·k·H^−½ ≤ −75 < −cap for every key
    q = np.zeros((1, 24, 1, H), np.float32)
    q[..., 0] = -100.0
    q, k = jax.device_put((q, k))
    assert float(jnp.max(jnp.einsum("bth,bsh->bts", q[:, :, 0], k[:, :, 0]))) * H ** -0.5 < -cap
    v = draws.normal(generator, (1, 40, 1, H))
    mod = scores.soft_cap(cap)
    dense, out = jax.jit(lambda q, k, v: [
        attnjax.dot_product_attention(q, k, v, score_mod=mod, implementation=implementation,
                                      block_sizes=blocks)
        for implementation, blocks in (("dense", None), ("chunked", (8, 16)))])(q, k, v)
    assert chunked._facts(mod, [], None, jnp.float32, jnp.float32).ceiling == cap
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), rtol=0, atol=2e-5)


def test_bounded_shift_with_large_sinks_and_rows_that_see_nothing():
    """A sink above the cap becomes the shift; a row that sees no key gives zeros and
    the log-sum-exp MASKED without a sink, the sink's own logit with one."""
    q, k, v = draws.normals(3, (1, 30, 2, H), (1, 30, 2, H), (1, 30, 2, H))
    mod = scores.soft_cap(10.0)
    # the first three queries see no key
    lengths = masks.lengths(query=jnp.array([27]))
    hidden = masks.from_fn(lambda b, n, q_pos, k_pos: q_pos >= 3)
    mask = lengths & hidden
    def both(q, k, v, sinks):
        return [attnjax.dot_product_attention(
                    q, k, v, mask=mask, score_mod=mod, sinks=sinks, return_residual=True,
                    implementation=implementation, block_sizes=blocks)
                for implementation, blocks in (("dense", None), ("chunked", (8, 8)))]

    # (a sink far below the cap, -100: exp(sink − cap) is 0 in float32, yet a row that
    # sees no key keeps its sink, and the sink its gradient)
    for sinks in (None, jnp.array([40.0, -3.0], jnp.float32),
                  jnp.array([-100.0, -3.0], jnp.float32)):
        (dense_out, dense_lse), (out, lse) = jax.jit(both)(q, k, v, sinks)
        if sinks is not None:
            dense_d_sinks, d_sinks = jax.jit(jax.jacrev(
                lambda sinks: [lse.sum() for _, lse in both(q, k, v, sinks)]))(sinks)
            np.testing.assert_allclose(np.asarray(d_sinks), np.asarray(dense_d_sinks),
                                       rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense_out), rtol=0, atol=2e-5)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(dense_lse), rtol=2e-6,
                                   atol=2e-5)
        assert np.all(np.asarray(out[:, :3]) == 0)
        expected = MASKED if sinks is None else np.asarray(sinks)[None, None]
        np.testing.assert_allclose(np.asarray(lse[:, :3]),
                                   np.broadcast_to(expected, lse[:, :3].shape), rtol=1e-6)


def test_only_narrow_bounds_and_float32_take_the_fast_paths():
    wide = scores.soft_cap(chunked.BOUNDED_RANGE)          # range 2·64 > 64
    facts = chunked._facts(wide, [], None, jnp.float32, jnp.float32)
    assert facts.ceiling is None and facts.near_zero is not None
    narrow = scores.soft_cap(20.0)
    assert chunked._facts(narrow, [], None, jnp.float32, jnp.float32).ceiling == 20.0
    # float64 logits, or a bias: no near-zero form (its accuracy is float32's; the
    # Cauchy–Schwarz bound covers q·k alone)
    assert chunked._facts(narrow, [], None, jnp.float64, jnp.float64).near_zero is None
    assert chunked._facts(narrow, [], jnp.ones((1, 1, 1, 1)), jnp.float32,
                          jnp.float32).near_zero is None
    # chain() keeps the last modification's bounds
    chained = scores.chain(scores.alibi(scores.alibi_slopes(2)), narrow)
    assert chained.bounds == (-20.0, 20.0)


@pytest.mark.parametrize("cap", [4.0, 20.0, 30.0])
def test_float16_soft_cap_rows_are_not_shifted_past_float16_s_range(cap):
    """float16 weights meet v in float16, whose smallest normal is e^−9.7: rows of
    ordinary logits shifted by a cap of 20 or 30 (the fixed shift) weighed e^−20 to
    e^−30, zero in float16, and the chunked output was all zeros (its gradients wrong
    too). A cap of 4 keeps the fixed shift. Output and gradients are dense's, within
    float16's rounding."""
    generator = draws.host(int(cap))
    q, k, v, d_out = draws.normals(generator, (1, 40, 2, H), (1, 40, 2, H), (1, 40, 2, H),
                                   (1, 40, 2, H), dtype=jnp.float16)
    mod = scores.soft_cap(cap)
    assert (chunked._facts(mod, [], None, jnp.float32, jnp.float16).ceiling is None) == (
        cap > 9.0)

    def loss(q, k, v, implementation, blocks):
        out = attnjax.dot_product_attention(q, k, v, is_causal=True, score_mod=mod,
                                            implementation=implementation, block_sizes=blocks)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    run = jax.jit(lambda q, k, v: [
        jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, implementation, blocks)
        for implementation, blocks in (("dense", None), ("chunked", (8, 16)))])
    (dense_grads, dense), (grads, out) = run(q, k, v)
    assert relative_error(out, dense) < 5e-3
    for name, got, want in zip("qkv", grads, dense_grads):
        assert relative_error(got, want) < 5e-3, name
