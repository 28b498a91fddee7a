"""attnjax.dot_product_attention takes every argument of jax.nn.dot_product_attention
with jax.nn's meaning: a call written for jax.nn gives jax.nn's result on every row that
sees a key (a row that sees none gives zeros in attnjax, an average in jax.nn).

jax.nn runs as its users run it (standard promotion); attnjax under the suite's strict
promotion."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax.core import MASKED
from tests.numerics import as_users_run

# distinct sizes; jax.nn needs V = H
B, T, S, N, K, H = 3, 5, 7, 4, 2, 6


def _host(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _qkv(seed: int, t=T, s=S, batch=(B,)):
    host = _host(seed)
    return tuple(jnp.asarray(host.standard_normal(batch + shape), jnp.float32)
                 for shape in ((t, N, H), (s, K, H), (s, K, H)))


def _jax_nn(*args, **kwargs):
    with as_users_run():
        return jax.nn.dot_product_attention(*args, **kwargs)


def _visible(t, s, kwargs, mask=None):
    """jax.nn's visibility `[B|1, 1|N, T, S]`, written out in numpy: top-left causal
    and window, lengths by index."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    seen = np.ones((1, 1, t, s), bool)
    if mask is not None:
        seen = seen & np.asarray(mask)
    if kwargs.get("is_causal"):
        seen = seen & (j <= i)
    window = kwargs.get("local_window_size")
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        seen = seen & (j >= i - left) & (j <= i + right)
    if kwargs.get("key_value_seq_lengths") is not None:
        seen = seen & (j < np.asarray(kwargs["key_value_seq_lengths"])[:, None, None, None])
    if kwargs.get("query_seq_lengths") is not None:
        seen = seen & (i < np.asarray(kwargs["query_seq_lengths"])[:, None, None, None])
    return seen


def _lengths(seed, high, low=0):
    return jnp.asarray(_host(seed).integers(low, high + 1, (B,)), jnp.int32)


def test_every_jax_nn_argument_is_accepted_with_its_kind_and_default():
    ours = inspect.signature(attnjax.dot_product_attention).parameters
    for name, theirs in inspect.signature(jax.nn.dot_product_attention).parameters.items():
        assert name in ours, name
        assert ours[name].kind == theirs.kind, name
        assert ours[name].default == theirs.default, name


# (name, T, S, keywords for both, whether to pass a random bool mask)
CASES = [
    ("seq_lengths", T, S, lambda seed: dict(query_seq_lengths=_lengths(seed, T, 1),
                                            key_value_seq_lengths=_lengths(seed + 1, S)), False),
    ("window_int_causal", T, T, lambda seed: dict(local_window_size=2, is_causal=True), False),
    ("window_pair", T, T, lambda seed: dict(local_window_size=(3, 1)), True),
    # a negative side, as jax.nn takes it: the two keys before the query, or the three
    # after it (both had been refused)
    ("window_strictly_past", T, T, lambda seed: dict(local_window_size=(2, -1)), False),
    ("window_ahead", T, T, lambda seed: dict(local_window_size=(-1, 3)), True),
    ("top_left_fewer_queries", T, S, lambda seed: dict(is_causal=True,
                                                       causal_alignment="top_left"), False),
    ("top_left_more_queries", S, T, lambda seed: dict(
        is_causal=True, local_window_size=(2, 0), causal_alignment="top_left",
        key_value_seq_lengths=_lengths(seed, T, 2)), False),
    ("top_left_window_and_bias", T, S, lambda seed: dict(
        local_window_size=(1, 2), causal_alignment="top_left", implementation="xla"), True),
]


@pytest.mark.parametrize("name, t, s, make, with_mask", CASES, ids=[c[0] for c in CASES])
def test_jax_nn_keywords_give_jax_nn_results(name, t, s, make, with_mask):
    seed = sum(map(ord, name))
    q, k, v = _qkv(seed, t, s)
    kwargs = make(seed)
    host = _host(seed + 2)
    mask = jnp.asarray(host.random((B, 1, t, s)) < 0.7) if with_mask else None
    bias = jnp.asarray(host.standard_normal((1, N, t, s)), jnp.float32) if with_mask else None
    theirs = {key: x for key, x in kwargs.items() if key != "causal_alignment"}
    expected, expected_lse = _jax_nn(q, k, v, bias, mask, return_residual=True, **theirs)
    got, lse = attnjax.dot_product_attention(q, k, v, bias, mask, return_residual=True, **kwargs)
    seen = np.broadcast_to(_visible(t, s, theirs, mask), (B, N, t, s))
    # [B, T, N]: rows that see a key, and padded query rows (zeros in both)
    rows = seen.any(-1).transpose(0, 2, 1)
    padded = np.zeros_like(rows)
    if "query_seq_lengths" in theirs:
        padded = (np.arange(t)[None, :] >= np.asarray(theirs["query_seq_lengths"])[:, None])
        padded = np.broadcast_to(padded[:, :, None], rows.shape)
    assert rows.any()
    compared = rows | padded
    np.testing.assert_allclose(np.asarray(got)[compared], np.asarray(expected)[compared],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[rows], np.asarray(expected_lse)[rows],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[~compared], 0.0)


def test_unbatched_call_with_jax_nn_keywords():
    q, k, v = _qkv(11, T, S, batch=())
    expected = _jax_nn(q, k, v, local_window_size=(2, 3))
    got = attnjax.dot_product_attention(q, k, v, local_window_size=(2, 3),
                                        causal_alignment="top_left")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_window_sides_may_be_concrete_integer_arrays_as_jax_nn_takes_them(own_checks_only):
    """local_window_size=(jnp.array(2), np.int64(1)), known values as jax.nn takes them
    (both annotate ints): jax.nn's result (it was a TypeError); a side traced under jit
    is a TypeError that says a window must be known there."""
    q, k, v = _qkv(19, T, S)
    expected = _jax_nn(q, k, v, local_window_size=(2, 1))
    got = attnjax.dot_product_attention(q, k, v, local_window_size=(jnp.array(2), np.int64(1)),
                                        causal_alignment="top_left")
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match=r"window sizes must be known when the call is traced"):
        jax.jit(lambda w: attnjax.dot_product_attention(q, k, v, window=(w, 1)))(2)


def test_unbatched_call_with_jax_nn_s_batch_of_one(own_checks_only):
    """jax.nn gives an unbatched call a batch of one, and takes its bias and mask 4-D,
    its lengths [1]: attnjax takes those forms too (annotated `*B` = (), they are
    outside jaxtyping's checks)."""
    q, k, v = _qkv(18, T, S, batch=())
    host = _host(17)
    kw = dict(bias=jnp.asarray(host.standard_normal((1, N, T, S)), jnp.float32),
              mask=jnp.asarray(host.random((1, 1, T, S)) < 0.7),
              query_seq_lengths=jnp.asarray(host.integers(2, T + 1, (1,)), jnp.int32),
              key_value_seq_lengths=jnp.asarray(host.integers(2, S + 1, (1,)), jnp.int32))
    expected = _jax_nn(q, k, v, **kw)
    got = attnjax.dot_product_attention(q, k, v, **kw)
    rows = _visible(T, S, kw, kw["mask"])[0, 0].any(-1)   # [T]
    assert rows.any() and not rows.all()
    np.testing.assert_allclose(np.asarray(got)[rows], np.asarray(expected)[rows], rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[~rows], 0.0)


def test_lengths_bias_and_mask_may_be_python_lists_as_in_jax_nn(own_checks_only):
    q, k, v = _qkv(19)
    host = _host(20)
    q_len, k_len = host.integers(1, T + 1, B).tolist(), host.integers(1, S + 1, B).tolist()
    bias = host.standard_normal((T, S)).astype(np.float32)
    mask = host.random((T, S)) < 0.8
    kw = dict(query_seq_lengths=q_len, key_value_seq_lengths=tuple(k_len))
    as_lists = attnjax.dot_product_attention(q, k, v, bias=bias.tolist(), mask=mask.tolist(),
                                             **kw)
    np.testing.assert_array_equal(as_lists, attnjax.dot_product_attention(
        q, k, v, bias=jnp.asarray(bias), mask=jnp.asarray(mask),
        query_seq_lengths=jnp.asarray(q_len, jnp.int32),
        key_value_seq_lengths=jnp.asarray(k_len, jnp.int32)))
    rows = _visible(T, S, kw, mask)[:, 0].any(-1)   # [B, T]
    np.testing.assert_allclose(np.asarray(as_lists)[rows], np.asarray(
        _jax_nn(q, k, v, bias=bias.tolist(), mask=mask.tolist(), **kw))[rows],
        rtol=1e-5, atol=1e-5)
    # a list of jax values, traced by a jit
    traced = jax.jit(lambda n: attnjax.dot_product_attention(
        q, k, v, bias=bias.tolist(), mask=mask.tolist(), query_seq_lengths=q_len,
        key_value_seq_lengths=[n] + k_len[1:]))(jnp.int32(k_len[0]))
    np.testing.assert_allclose(traced, as_lists, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="key_lengths must have an integer dtype; got float"):
        attnjax.dot_product_attention(q, k, v, key_lengths=[1.5] * B)
    with pytest.raises(TypeError, match=r"key_lengths must be an array, or a list of numbers "
                                        r"of one shape; got list \[\[1\], \[2, 3\]"):
        attnjax.dot_product_attention(q, k, v, key_lengths=[[1], [2, 3]])


def test_jax_nn_names_are_aliases_of_attnjax_s():
    q, k, v = _qkv(12)
    q_len, k_len = _lengths(13, T, 1), _lengths(14, S, 1)
    by_jax_nn = attnjax.dot_product_attention(
        q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=k_len, local_window_size=(2, 1))
    by_attnjax = attnjax.dot_product_attention(
        q, k, v, query_lengths=q_len, key_lengths=k_len, window=(2, 1))
    np.testing.assert_array_equal(by_jax_nn, by_attnjax)
    automatic = attnjax.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_array_equal(
        attnjax.dot_product_attention(q, k, v, is_causal=True, implementation="xla"), automatic)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_scale_may_be_an_array_traced_under_jit_and_learned_under_grad(implementation,
                                                                      own_checks_only):
    """jax.nn takes scale as an array (1/jnp.sqrt(H)), traced (a jit argument) and
    differentiated (a learned temperature): attnjax gives the bits it gives for the same
    number as a float, and jax.nn's gradient for it."""
    q, k, v = _qkv(30)
    number = float(_host(31).uniform(0.1, 1.0))
    kw = dict(is_causal=True, causal_alignment="top_left", implementation=implementation)

    def ours(scale):
        return attnjax.dot_product_attention(q, k, v, scale=scale, **kw)

    as_float = ours(number)
    np.testing.assert_array_equal(ours(jnp.float32(number)), as_float)
    np.testing.assert_array_equal(jax.jit(ours)(jnp.float32(number)), as_float)
    weights = jnp.asarray(_host(32).standard_normal(as_float.shape), jnp.float32)
    grad = jax.grad(lambda s: jnp.sum(ours(s) * weights))(number)
    expected = jax.grad(lambda s: jnp.sum(_jax_nn(q, k, v, scale=s, is_causal=True) * weights)
                        )(number)
    np.testing.assert_allclose(grad, expected, rtol=1e-4)
    with pytest.raises(TypeError, match=r"scale must be a real number or a 0-d array of one; "
                                        r"got a traced float32 \[2\]"):
        jax.jit(ours)(jnp.full((2,), number, jnp.float32))


def test_top_left_is_positions_from_zero_and_differs_from_bottom_right():
    q, k, v = _qkv(15)
    top_left = attnjax.dot_product_attention(q, k, v, is_causal=True,
                                             causal_alignment="top_left")
    by_positions = attnjax.dot_product_attention(
        q, k, v, is_causal=True, positions=(jnp.arange(T, dtype=jnp.int32),
                                            jnp.arange(S, dtype=jnp.int32)))
    np.testing.assert_array_equal(top_left, by_positions)
    bottom_right = attnjax.dot_product_attention(q, k, v, is_causal=True)
    assert not np.allclose(top_left, bottom_right, atol=1e-3)
    # with T = S the two alignments are one
    square = attnjax.dot_product_attention(q, k[:, :T], v[:, :T], is_causal=True,
                                           causal_alignment="top_left")
    np.testing.assert_array_equal(
        square, attnjax.dot_product_attention(q, k[:, :T], v[:, :T], is_causal=True))


@pytest.mark.usefixtures("own_checks_only")
@pytest.mark.parametrize("kwargs, message", [
    (dict(query_lengths=jnp.ones((B,), jnp.int32), query_seq_lengths=jnp.ones((B,), jnp.int32)),
     "query_lengths and query_seq_lengths are two names for one argument"),
    (dict(key_lengths=jnp.ones((B,), jnp.int32),
          key_value_seq_lengths=jnp.ones((B,), jnp.int32)),
     "key_lengths and key_value_seq_lengths are two names for one argument"),
    (dict(window=2, local_window_size=2), "window and local_window_size are two names"),
    (dict(causal_alignment="top_left", positions=(jnp.arange(T), jnp.arange(S))),
     "causal_alignment='top_left'.*with positions= given"),
    (dict(causal_alignment="top-left"),
     r"causal_alignment must be one of \('bottom_right', 'top_left'\); got 'top-left'"),
    (dict(implementation="flash"), r"implementation must be one of .*'xla'; got 'flash'"),
])
def test_mistakes_are_named_errors(kwargs, message):
    q, k, v = _qkv(16)
    with pytest.raises(ValueError, match=message):
        attnjax.dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_masked_calls_run_under_debug_infs_and_nans(implementation):
    """jax.nn's keywords with rows that see no key (a zero key length, a window past
    the keys), forward, backward and the residual: nothing inside attnjax makes an inf
    or a NaN."""
    q, k, v = _qkv(17, S, T)
    k_len = jnp.asarray([T, 0, 3], jnp.int32)

    def loss(q, k, v):
        out, lse = attnjax.dot_product_attention(
            q, k, v, is_causal=True, query_seq_lengths=jnp.asarray([S, S - 1, 2], jnp.int32),
            key_value_seq_lengths=k_len, local_window_size=(1, 0), causal_alignment="top_left",
            return_residual=True, implementation=implementation)
        return jnp.sum(out ** 2) + jnp.sum(jnp.where(lse > -1e29, lse, 0.0)), (out, lse)

    with jax.debug_infs(True), jax.debug_nans(True):
        grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    for x in (*grads, out, lse):
        assert np.isfinite(np.asarray(x)).all()
    np.testing.assert_array_equal(out[1], 0.0)          # no key at all
    np.testing.assert_array_equal(out[0, T + 1:], 0.0)  # window past the last key


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_residual_has_jax_nn_s_dtype_so_its_vjp_takes_their_cotangents(dtype, implementation):
    """jax's own test of dot_product_attention pulls a cotangent of the inputs' dtype
    back through (output, log-sum-exp): the log-sum-exp comes back in that dtype, as
    jax.nn's does, with jax.nn's values, and a row that sees no key keeps a finite one
    (float16 cannot hold −1e30)."""
    q, k, v = (x.astype(dtype) for x in _qkv(23))
    host = _host(24)
    d_out = jnp.asarray(host.standard_normal(q.shape), dtype)
    d_lse = jnp.asarray(host.standard_normal((B, T, N)), dtype)
    k_len = jnp.asarray([S, 0, 3], jnp.int32)   # the second example sees no key
    _, expected = _jax_nn(q, k, v, key_value_seq_lengths=k_len, return_residual=True)

    def ours(q, k, v):
        return attnjax.dot_product_attention(q, k, v, key_value_seq_lengths=k_len,
                                             return_residual=True, implementation=implementation)

    (out, lse), pull_back = jax.vjp(ours, q, k, v)
    assert lse.dtype == expected.dtype == dtype and out.dtype == dtype
    grads = pull_back((d_out, d_lse))
    assert [g.dtype for g in grads] == [dtype] * 3
    for x in (lse, *grads):
        assert np.isfinite(np.asarray(x, np.float32)).all()
    lse, expected = np.asarray(lse, np.float32), np.asarray(expected, np.float32)
    np.testing.assert_allclose(lse[[0, 2]], expected[[0, 2]], rtol=1e-2, atol=1e-2)
    # attnjax's MASKED (−1e30) where the dtype holds it, else the dtype's lowest
    np.testing.assert_allclose(lse[1], max(MASKED, float(jnp.finfo(dtype).min)), rtol=1e-2)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_a_float16_log_sum_exp_past_float16_s_range_is_its_largest_not_inf(implementation):
    """Logits of ~1e5 from float16 inputs: the output and gradients are finite, and the
    log-sum-exp (float32 inside) comes back as float16's largest value, not inf."""
    q, k, v = (x.astype(jnp.float16) for x in _qkv(25))
    # positive q and k of ~200: q·k / √H ~ 1e5, past float16's 65504
    q, k = (jnp.abs(x) * jnp.float16(250.0) for x in (q, k))

    def lse_sum(q, k, v):
        _, lse = attnjax.dot_product_attention(q, k, v, return_residual=True,
                                               implementation=implementation)
        return jnp.sum(lse.astype(jnp.float32)), lse

    grads, lse = jax.grad(lse_sum, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    lse = np.asarray(lse, np.float32)
    assert np.isfinite(lse).all() and (lse == np.float32(jnp.finfo(jnp.float16).max)).any()
    for g in grads:
        assert np.isfinite(np.asarray(g, np.float32)).all()
