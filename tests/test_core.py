"""Layer 1: one example, one head."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import attnjax
from tests import draws

# Distinct sizes per axis, so a swapped axis cannot pass.
T, S, H, V = 5, 7, 3, 11


def _qkv(rng, dtype=jnp.float32, t=T, s=S, h=H, v=V):
    """q, k, v from rng (a key, a seed or a generator: tests.draws)."""
    return draws.normals(rng, (t, h), (s, h), (s, v), dtype=dtype)


def test_hand_computed_case():
    # Two keys, H = 4 so the scale is 1/2. Logits for query 0: [2, 0] -> softmax
    # [e²/(e²+1), 1/(e²+1)]; query 1 sees only key 0 (mask) -> weight 1.
    q = jnp.array([[2.0, 0.0, 2.0, 0.0], [1.0, 1.0, 1.0, 1.0]], jnp.float32)
    k = jnp.array([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, -1.0]], jnp.float32)
    v = jnp.array([[1.0, 10.0], [3.0, -2.0]], jnp.float32)
    mask = jnp.array([[True, True], [True, False]])
    w0 = np.exp(2.0) / (np.exp(2.0) + 1.0)
    expected_weights = np.array([[w0, 1.0 - w0], [1.0, 0.0]])
    expected_out = np.array(
        [[w0 * 1.0 + (1 - w0) * 3.0, w0 * 10.0 + (1 - w0) * -2.0], [1.0, 10.0]]
    )
    np.testing.assert_allclose(attnjax.attention_weights(q, k, mask=mask), expected_weights, rtol=1e-6)
    np.testing.assert_allclose(attnjax.attention(q, k, v, mask=mask), expected_out, rtol=1e-6)


class TestCoreVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_shapes_and_dtypes(self):
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
            q, k, v = _qkv(3, dtype)
            out = self.variant(attnjax.attention)(q, k, v)
            weights = self.variant(attnjax.attention_weights)(q, k)
            chex.assert_shape(out, (T, V))
            chex.assert_shape(weights, (T, S))
            chex.assert_type([out, weights], dtype)
            chex.assert_tree_all_finite((out, weights))


def test_weight_rows_sum_to_one(rng):
    generator = draws.host(rng)
    q, k, _ = _qkv(generator)
    mask = draws.bernoulli(generator, 0.6, (T, S), always=0)
    weights = attnjax.attention_weights(q, k, mask=mask)
    np.testing.assert_allclose(weights.sum(-1), np.ones(T), rtol=1e-6)
    assert jnp.all(jnp.where(mask, True, weights == 0))


def test_permuting_keys_and_values_together_changes_nothing(rng):
    generator = draws.host(rng)
    q, k, v = _qkv(generator)
    perm = generator.permutation(S)
    np.testing.assert_allclose(
        attnjax.attention(q, k[perm], v[perm]), attnjax.attention(q, k, v), rtol=1e-5, atol=1e-6
    )


def test_permuting_queries_permutes_the_output(rng):
    generator = draws.host(rng)
    q, k, v = _qkv(generator)
    perm = generator.permutation(T)
    np.testing.assert_allclose(
        attnjax.attention(q[perm], k, v), attnjax.attention(q, k, v)[perm], rtol=1e-5, atol=1e-6
    )


def _softmax_rows(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def test_alignment_functions_against_hand_written_numpy(rng):
    generator = draws.host(rng)
    hq, hk, a = 3, 5, 13
    q, k, v, w, w_q, w_k, v_a, k_same = draws.normals(
        generator, (T, hq), (S, hk), (S, V), (hq, hk), (hq, a), (hk, a), (a,), (S, hq),
        dtype=jnp.float64)
    qn, kn, vn = map(np.asarray, (q, k, v))

    general = np.array([[qn[i] @ np.asarray(w) @ kn[j] for j in range(S)] for i in range(T)])
    additive = np.array([
        [np.asarray(v_a) @ np.tanh(qn[i] @ np.asarray(w_q) + kn[j] @ np.asarray(w_k))
         for j in range(S)] for i in range(T)
    ])
    score = functools.partial(attnjax.general_score, w=w)
    np.testing.assert_allclose(score(q, k), general, rtol=1e-12)
    np.testing.assert_allclose(
        attnjax.attention(q, k, v, score_fn=score), _softmax_rows(general) @ vn, rtol=1e-12
    )
    score = functools.partial(attnjax.additive_score, w_q=w_q, w_k=w_k, v=v_a)
    np.testing.assert_allclose(score(q, k), additive, rtol=1e-12)
    np.testing.assert_allclose(
        attnjax.attention(q, k, v, score_fn=score), _softmax_rows(additive) @ vn, rtol=1e-12
    )
    np.testing.assert_allclose(attnjax.dot_score(q, k_same), qn @ np.asarray(k_same).T, rtol=1e-12)
    np.testing.assert_allclose(
        attnjax.scaled_dot_score(q, k_same, scale=0.3), 0.3 * qn @ np.asarray(k_same).T, rtol=1e-12
    )


def test_gradients_float64_order_2(rng):
    generator = draws.host(rng)
    q, k, v = _qkv(generator, jnp.float64)
    bias = draws.normal(generator, (T, S), jnp.float64)
    mask = draws.bernoulli(generator, 0.7, (T, S), always=2)
    fn = lambda q, k, v, bias: attnjax.attention(q, k, v, mask=mask, bias=bias)  # noqa: E731
    check_grads(jax.jit(fn), (q, k, v, bias), order=2, modes=("fwd", "rev"))
    w = draws.normal(generator, (H, H), jnp.float64)
    general = lambda q, k, v, w: attnjax.attention(  # noqa: E731
        q, k, v, score_fn=functools.partial(attnjax.general_score, w=w))
    check_grads(jax.jit(general), (q, k, v, w), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_fully_masked_row_is_exact_zero_with_zero_gradients(rng, dtype):
    q, k, v = _qkv(rng, dtype)
    mask = jnp.ones((T, S), bool).at[2].set(False)
    out = attnjax.attention(q, k, v, mask=mask)
    assert out.dtype == dtype
    assert jnp.all(out[2] == 0)
    assert jnp.all(attnjax.attention_weights(q, k, mask=mask)[2] == 0)

    def loss(q, k, v):
        return attnjax.attention(q, k, v, mask=mask).astype(jnp.float32).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    chex.assert_tree_all_finite(grads)
    assert jnp.all(grads[0][2] == 0)  # the masked query receives no gradient


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf])
@pytest.mark.parametrize("score_fn", [None, attnjax.dot_score])
def test_nan_or_inf_where_the_mask_hides_a_key_or_query_reaches_nothing(rng, value, score_fn):
    """Keys 2 and 5 hidden from every query, query 3 from every key (a mask, as a
    padding one), hold inf in q and k and -inf in v (or NaN): the outputs, weights and
    gradients are those of clean inputs (0 · NaN had made every output NaN)."""
    q, k, v = _qkv(rng, jnp.float64)
    hidden = jnp.array([2, 5])
    mask = draws.bernoulli(rng, 0.7, (T, S), always=0).at[:, hidden].set(False).at[3].set(False)
    bad_q, bad_k, bad_v = q.at[3].set(value), k.at[hidden].set(value), v.at[hidden].set(-value)

    def outputs_and_grads(q, k, v):
        out, pullback = jax.vjp(functools.partial(attnjax.attention, mask=mask,
                                                  score_fn=score_fn), q, k, v)
        weights = attnjax.attention_weights(q, k, mask=mask, score_fn=score_fn)
        return out, weights, pullback(jnp.sin(out))

    clean, dirty = outputs_and_grads(q, k, v), outputs_and_grads(bad_q, bad_k, bad_v)
    chex.assert_tree_all_finite(dirty)
    chex.assert_trees_all_close(dirty, clean, rtol=1e-12, atol=1e-14)


def test_a_learned_alignment_must_return_floating_logits_of_t_by_s(rng, own_checks_only):
    """(a [T, 1] had broadcast over the keys, every output the sum of all values; a bool
    had been cast to logits of 0 and 1; an [S, T] had failed in an einsum)"""
    q, k, v = _qkv(rng)
    for fn, error, message in [
        (lambda q, k: jnp.sum(q, -1, keepdims=True), ValueError,
         r"score_fn\(q, k\) must return logits \[T, S\] = \[5, 7\]; got \[5, 1\]"),
        (lambda q, k: k @ q.T, ValueError, r"= \[5, 7\]; got \[7, 5\]"),
        (lambda q, k: q @ k.T > 0, TypeError, r"must return floating logits; got bool")]:
        with pytest.raises(error, match=message):
            attnjax.attention(q, k, v, score_fn=fn)
        with pytest.raises(error, match=message):   # the batched API's alignment=
            attnjax.dot_product_attention(q[None, :, None], k[None, :, None], v[None, :, None],
                                          alignment=(lambda q, k, w: fn(q + 0 * w, k),
                                                     {"w": jnp.ones((1,), q.dtype)}))


def test_lists_are_arrays_to_the_core_and_its_alignments(rng, own_checks_only):
    """(an AttributeError had named nothing; dot_product_attention takes lists)"""
    q, k, v = _qkv(rng, jnp.float64)   # as the lists' Python floats become
    w_q, w_k, a = draws.normals(rng, (H, 4), (H, 4), (4,), dtype=jnp.float64)
    expected = attnjax.attention(q, k, v, score_fn=functools.partial(
        attnjax.additive_score, w_q=w_q, w_k=w_k, v=a))
    listed = functools.partial(attnjax.additive_score, w_q=w_q.tolist(), w_k=w_k.tolist(),
                               v=a.tolist())
    np.testing.assert_allclose(attnjax.attention(q.tolist(), k.tolist(), v.tolist(),
                                                 score_fn=listed), expected, rtol=1e-12)
    w = draws.normal(rng, (H, H), jnp.float64)
    np.testing.assert_allclose(
        attnjax.attention_weights(q, k, score_fn=functools.partial(attnjax.general_score,
                                                                   w=w.tolist())),
        attnjax.attention_weights(q, k, score_fn=functools.partial(attnjax.general_score, w=w)),
        rtol=1e-12)


def test_additive_parameters_that_disagree_on_a_are_named_together(rng, own_checks_only):
    """(a v of the wrong length had been reported as a w_q of the wrong shape)"""
    q, k, v = _qkv(rng)
    for sizes in [(8, 8, 9), (9, 8, 8)]:
        w_q, w_k, a = draws.normals(rng, (H, sizes[0]), (H, sizes[1]), (sizes[2],))
        with pytest.raises(ValueError, match=rf"additive_score's w_q \[Hq, A\], w_k \[Hk, A\] "
                                             rf"and v \[A\] must have one A; got A = "
                                             rf"{sizes[0]}, {sizes[1]} and {sizes[2]}"):
            attnjax.attention(q, k, v, score_fn=functools.partial(
                attnjax.additive_score, w_q=w_q, w_k=w_k, v=a))


def test_scale_with_score_fn_is_rejected(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="score_fn"):
        attnjax.attention(q, k, v, scale=0.5, score_fn=attnjax.dot_score)


@pytest.mark.parametrize("count", [1, 2])
def test_sums_in_one_pass_are_sums_and_trace_their_computation_once(count):
    """core.sums_in_one_pass gives jnp.sum of each array (over a middle axis too, at 7
    and 40 terms), as one reduction whose traced computation is the same object from
    call to call: jax caches an op by its parameters, and a computation traced afresh at
    each call compiled the reduction again at each eager call (~30 ms)."""
    generator = draws.host(31)
    for shape, axis in (((3, 7, 5), -1), ((4, 40, 6), 1)):
        xs = tuple(draws.normal(generator, shape) for _ in range(count))
        sums = attnjax.core.sums_in_one_pass(xs, axis)
        assert len(sums) == count
        for got, x in zip(sums, xs):
            chex.assert_trees_all_close(got, jnp.sum(x, axis), rtol=1e-5, atol=1e-5)
    reductions = [[eqn for eqn in jax.make_jaxpr(
        lambda *a: attnjax.core.sums_in_one_pass(a, -1))(*xs).jaxpr.eqns
        if eqn.primitive.name == "reduce"] for _ in range(2)]
    assert [len(found) for found in reductions] == [1, 1]
    assert reductions[0][0].params["jaxpr"] is reductions[1][0].params["jaxpr"]
