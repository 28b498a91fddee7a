"""The chunked implementation computes the dense numbers in O(T + S) memory."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnjax
from attnjax import chunked
from tests import reference

# (B, T, S, N, K, H, V, block sizes): no length a multiple of its block in most rows.
SHAPES = [
    (2, 13, 21, 4, 2, 8, 5, (4, 8)),
    (1, 16, 16, 2, 2, 4, 4, (8, 8)),
    (2, 7, 30, 3, 1, 8, 8, (8, 16)),
    (1, 19, 9, 2, 1, 4, 6, (16, 4)),
]


def _relative_error(actual, expected):
    """max |a − e| / max |e|: relative to the array's scale, so near-zero entries of a
    well-scaled array do not dominate. The scale is floored at 1, the scale of the unit
    normal inputs: when every query sees a single key, the exact query and bias
    gradients p·(dp − Σ p·dp) cancel to zero, and float32 leaves residues of about 1e-7
    from the O(1) terms that cancel; relative to zero, any residue would be infinite."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1.0)


def _inputs(seed, b, t, s, n, k, h, v, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(keys[0], (b, t, n, h), jnp.float32).astype(dtype),
        jax.random.normal(keys[1], (b, s, k, h), jnp.float32).astype(dtype),
        jax.random.normal(keys[2], (b, s, k, v), jnp.float32).astype(dtype),
        jax.random.normal(keys[3], (b, t, n, v), jnp.float32).astype(dtype),
    )


def _outputs_and_grads(implementation, q, k, v, d_out, bias, options, block_sizes=None):
    def loss(q, k, v, bias):
        out = attnjax.dot_product_attention(
            q, k, v, bias, implementation=implementation, block_sizes=block_sizes, **options)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)
    return out, grads


@st.composite
def cases(draw):
    b, t, s, n, k, h, v, blocks = draw(st.sampled_from(SHAPES))
    return dict(
        shape=(b, t, s, n, k, h, v), blocks=blocks,
        causal=draw(st.booleans()),
        window=draw(st.sampled_from([None, (3, 0), (2, 5), 6])),
        lengths=draw(st.sampled_from([None, "query", "key", "both"])),
        mask=draw(st.sampled_from([None, "rows_masked", "random"])),
        bias=draw(st.sampled_from(["full", "key_only"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=30, deadline=None, derandomize=True)
@given(cases())
def test_chunked_equals_dense_outputs_and_gradients(case):
    b, t, s, n, k, h, v = case["shape"]
    q, kk, vv, d_out = _inputs(case["seed"], *case["shape"])
    keys = jax.random.split(jax.random.key(case["seed"] + 1), 4)
    bias_shape = (b, n, t, s) if case["bias"] == "full" else (1, 1, 1, s)
    bias = jax.random.normal(keys[0], bias_shape, jnp.float32)
    options = dict(is_causal=case["causal"], window=case["window"])
    if case["lengths"] in ("query", "both"):
        options["query_lengths"] = jax.random.randint(keys[1], (b,), 1, t + 1, jnp.int32)
    if case["lengths"] in ("key", "both"):
        options["key_lengths"] = jax.random.randint(keys[2], (b,), 1, s + 1, jnp.int32)
    if case["mask"] == "rows_masked":  # rows 0 and 2 see no key at all
        options["mask"] = jnp.ones((b, 1, t, s), bool).at[:, :, 0].set(False).at[:, :, 2].set(False)
    elif case["mask"] == "random":
        options["mask"] = jax.random.bernoulli(keys[3], 0.6, (b, n, t, s))

    dense_out, dense_grads = _outputs_and_grads("dense", q, kk, vv, d_out, bias, options)
    out, grads = _outputs_and_grads("chunked", q, kk, vv, d_out, bias, options, case["blocks"])
    chex.assert_tree_all_finite((out, grads))
    assert _relative_error(out, dense_out) <= 2e-5
    for name, g, g_dense in zip(("query", "key", "value", "bias"), grads, dense_grads):
        assert _relative_error(g, g_dense) <= 2e-5, name
    # Rows that see no key are exact zeros, as in dense.
    np.testing.assert_array_equal(np.asarray(out) == 0, np.asarray(dense_out) == 0)


@pytest.mark.parametrize("t, s, causal, window", [(12, 12, True, None), (5, 23, True, None),
                                                   (17, 17, False, (4, 2)), (9, 20, True, (6, 0))])
def test_chunked_matches_float64_reference(t, s, causal, window):
    q, k, v, _ = _inputs(3, 2, t, s, 4, 2, 8, 6, jnp.float64)
    lengths = jnp.array([t, max(1, t // 2)], jnp.int32), jnp.array([max(1, s - 3), s], jnp.int32)
    out = attnjax.dot_product_attention(
        q, k, v, is_causal=causal, window=window, query_lengths=lengths[0],
        key_lengths=lengths[1], implementation="chunked", block_sizes=(4, 8))
    expected = reference.attention(q, k, v, is_causal=causal, window=window,
                                   query_lengths=lengths[0], key_lengths=lengths[1])
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_chunked_bfloat16_within_1e_2_of_dense():
    q, k, v, d_out = _inputs(5, 2, 40, 56, 4, 2, 16, 16, jnp.bfloat16)
    bias = jnp.zeros((1, 1, 1, 56), jnp.bfloat16)
    options = dict(is_causal=True)
    dense_out, dense_grads = _outputs_and_grads("dense", q, k, v, d_out, bias, options)
    out, grads = _outputs_and_grads("chunked", q, k, v, d_out, bias, options, (16, 16))
    chex.assert_type([out, *grads[:3]], jnp.bfloat16)
    assert _relative_error(out, dense_out) <= 1e-2
    for g, g_dense in zip(grads[:3], dense_grads[:3]):
        assert _relative_error(g, g_dense) <= 1e-2


def test_gradients_float64_check_grads():
    q, k, v, _ = _inputs(2, 1, 6, 9, 2, 1, 3, 4, jnp.float64)

    def fn(q, k, v):
        return attnjax.dot_product_attention(
            q, k, v, is_causal=True, implementation="chunked", block_sizes=(4, 4))

    jax.test_util.check_grads(fn, (q, k, v), order=1, modes=("rev",))


def test_dropout_is_deterministic_per_rng_and_unbiased():
    q, k, v, _ = _inputs(9, 2, 12, 20, 2, 2, 4, 5)

    def run(key):
        return attnjax.dot_product_attention(q, k, v, dropout_rate=0.3, dropout_rng=key,
                                             implementation="chunked", block_sizes=(8, 8))

    np.testing.assert_array_equal(run(jax.random.key(1)), run(jax.random.key(1)))
    assert not np.allclose(run(jax.random.key(1)), run(jax.random.key(2)))
    draws = 3000
    outs = np.asarray(jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(4), draws)))
    expected = np.asarray(attnjax.dot_product_attention(q, k, v, implementation="dense"))
    sem = outs.std(0) / np.sqrt(draws)
    assert np.all(np.abs(outs.mean(0) - expected) <= 5 * sem + 1e-6)


@pytest.mark.parametrize("is_causal, window", [(True, None), (False, (5, 2)), (True, (9, 0))])
@pytest.mark.parametrize("t, s", [(40, 40), (24, 61), (50, 17)])
def test_block_ranges_are_exactly_the_blocks_with_a_visible_pair(t, s, is_causal, window):
    """Skipped blocks are entirely masked, and every entirely masked block is skipped."""
    plan = chunked._Plan(t, s, 8, 16, is_causal, window, 1.0, 0.0)
    q_len, k_len = t - 3, s - 5
    seen = reference.visible(t, s, is_causal=is_causal, window=window,
                             query_length=q_len, key_length=k_len)
    padded = np.zeros((plan.num_q_blocks * 8, plan.num_k_blocks * 16), bool)
    padded[:t, :s] = seen
    # [nq, nk]: does block (i, j) hold any visible pair?
    live = padded.reshape(plan.num_q_blocks, 8, plan.num_k_blocks, 16).any(axis=(1, 3))
    for i in range(plan.num_q_blocks):
        lo, hi = plan.key_blocks(jnp.int32(i), jnp.int32(q_len), jnp.int32(k_len))
        np.testing.assert_array_equal(np.arange(plan.num_k_blocks)[live[i]],
                                      np.arange(int(lo), int(hi))[live[i, int(lo):int(hi)]])
        assert live[i, int(lo):int(hi)].all() or not live[i].any() or is_causal or window
    for j in range(plan.num_k_blocks):
        lo, hi = plan.query_blocks(jnp.int32(j), jnp.int32(q_len), jnp.int32(k_len))
        assert set(np.flatnonzero(live[:, j])) <= set(range(int(lo), int(hi)))
    # Blocks run without a mask really are visible whole (padded query rows aside), and
    # the interior of a causal or windowed pattern does run without one.
    real = np.zeros_like(padded)
    real[:t, :] = True
    whole = (padded | ~real).reshape(plan.num_q_blocks, 8, plan.num_k_blocks, 16).all(axis=(1, 3))
    unmasked_pairs = set()
    for i in range(plan.num_q_blocks):
        lo, hi = plan.unmasked_key_blocks(jnp.int32(i), jnp.int32(q_len), jnp.int32(k_len))
        assert whole[i, int(lo):int(hi)].all(), (i, int(lo), int(hi))
        unmasked_pairs |= {(i, j) for j in range(int(lo), int(hi))}
    for j in range(plan.num_k_blocks):
        lo, hi = plan.unmasked_query_blocks(jnp.int32(j), jnp.int32(q_len), jnp.int32(k_len))
        assert whole[int(lo):int(hi), j].all(), (j, int(lo), int(hi))
    interior = {(i, j) for i, j in zip(*np.nonzero(whole)) if (i + 1) * 8 <= q_len
                and (j + 1) * 16 <= k_len}
    assert unmasked_pairs == interior
    # Blocks skipped: causal skips about half of them.
    if is_causal and window is None and t == s:
        computed = sum(int(h) - int(l) for l, h in (
            plan.key_blocks(jnp.int32(i), None, None) for i in range(plan.num_q_blocks)))
        assert computed < 0.7 * plan.num_q_blocks * plan.num_k_blocks


def test_chunked_forward_memory_is_under_a_sixteenth_of_dense_at_8192():
    shape = jax.ShapeDtypeStruct((1, 8192, 8, 64), jnp.float32)

    def temp_bytes(implementation):
        fn = jax.jit(lambda q, k, v: attnjax.dot_product_attention(
            q, k, v, implementation=implementation))
        return fn.lower(shape, shape, shape).compile().memory_analysis().temp_size_in_bytes

    dense, chunked_bytes = temp_bytes("dense"), temp_bytes("chunked")
    assert dense >= 8 * 8192 * 8192 * 4  # at least the [N, T, S] float32 logits
    assert chunked_bytes < dense / 16


def test_auto_picks_dense_for_weights_and_rejects_them_from_chunked():
    q, k, v, _ = _inputs(1, 1, 600, 600, 1, 1, 4, 4)
    out, weights = attnjax.dot_product_attention(q, k, v, return_weights=True)
    chex.assert_shape(weights, (1, 1, 600, 600))
    np.testing.assert_allclose(out, attnjax.dot_product_attention(q, k, v), rtol=2e-5, atol=1e-6)
    with pytest.raises(ValueError, match="return_weights=True needs implementation='dense'"):
        attnjax.dot_product_attention(q, k, v, return_weights=True, implementation="chunked")
    with pytest.raises(ValueError, match="block_sizes=.* applies to implementation='chunked'"):
        attnjax.dot_product_attention(q, k, v, implementation="dense", block_sizes=(8, 8))
