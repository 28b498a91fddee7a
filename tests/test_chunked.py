"""The chunked implementation computes the dense numbers in O(T + S) memory."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnjax
from attnjax import chunked, heads, masks
from tests import draws, reference
from tests.numerics import relative_error

# (B, T, S, N, K, H, V, block sizes): no length a multiple of its block in most rows.
SHAPES = [
    (2, 13, 21, 4, 2, 8, 5, (4, 8)),
    (1, 16, 16, 2, 2, 4, 4, (8, 8)),
    (2, 7, 30, 3, 1, 8, 8, (8, 16)),
    (1, 19, 9, 2, 1, 4, 6, (16, 4)),
]


def _inputs(seed, b, t, s, n, k, h, v, dtype=jnp.float32):
    return draws.normals(seed, (b, t, n, h), (b, s, k, h), (b, s, k, v), (b, t, n, v),
                         dtype=dtype)


@functools.partial(jax.jit, static_argnames=("flags", "block_sizes"))
def _dense_and_chunked(q, k, v, d_out, bias, arrays, *, flags, block_sizes):
    """[(out, grads) of dense, (out, grads) of chunked]: the gradients of
    Σ out·d_out w.r.t. q, k, v and bias, both kernels in one program. The options are
    split into their static flags (a tuple of (name, value) pairs) and their arrays (a
    dict, traced), so examples of the same shapes and option structure share a compile."""
    options = dict(flags, **arrays)
    results = []
    for implementation, blocks in (("dense", None), ("chunked", block_sizes)):
        def loss(q, k, v, bias, implementation=implementation, blocks=blocks):
            out = attnjax.dot_product_attention(
                q, k, v, bias, implementation=implementation, block_sizes=blocks, **options)
            return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

        grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
        results.append((out, grads))
    return results


@functools.partial(jax.jit, static_argnames=("is_causal", "window", "return_weights",
                                             "implementation", "block_sizes"))
def _attention(*args, **kwargs):
    """attnjax.dot_product_attention compiled (one program, not one per primitive), with
    its flags static."""
    return attnjax.dot_product_attention(*args, **kwargs)


def _outputs_and_grads(q, k, v, d_out, bias, options, block_sizes):
    """`_dense_and_chunked` with the options as keyword arguments: arrays traced, the
    rest static."""
    arrays = {name: x for name, x in options.items() if isinstance(x, jax.Array)}
    flags = tuple(sorted((name, x) for name, x in options.items() if name not in arrays))
    return _dense_and_chunked(q, k, v, d_out, bias, arrays, flags=flags,
                              block_sizes=block_sizes)


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
    more = draws.host(case["seed"] + 1)
    bias_shape = (b, n, t, s) if case["bias"] == "full" else (1, 1, 1, s)
    bias = draws.normal(more, bias_shape)
    options = dict(is_causal=case["causal"], window=case["window"])
    if case["lengths"] in ("query", "both"):
        options["query_lengths"] = draws.randint(more, (b,), 1, t + 1)
    if case["lengths"] in ("key", "both"):
        options["key_lengths"] = draws.randint(more, (b,), 1, s + 1)
    if case["mask"] == "rows_masked":  # rows 0 and 2 see no key at all
        rows_masked = np.ones((b, 1, t, s), bool)
        rows_masked[:, :, [0, 2]] = False
        options["mask"] = jnp.asarray(rows_masked)
    elif case["mask"] == "random":
        options["mask"] = draws.bernoulli(more, 0.6, (b, n, t, s))

    (dense_out, dense_grads), (out, grads) = _outputs_and_grads(
        q, kk, vv, d_out, bias, options, case["blocks"])
    chex.assert_tree_all_finite((out, grads))
    assert relative_error(out, dense_out) <= 2e-5
    for name, g, g_dense in zip(("query", "key", "value", "bias"), grads, dense_grads):
        assert relative_error(g, g_dense) <= 2e-5, name
    # Rows that see no key are exact zeros, as in dense.
    np.testing.assert_array_equal(np.asarray(out) == 0, np.asarray(dense_out) == 0)


@pytest.mark.parametrize("t, s, causal, window", [(12, 12, True, None), (5, 23, True, None),
                                                   (17, 17, False, (4, 2)), (9, 20, True, (6, 0))])
def test_chunked_matches_float64_reference(t, s, causal, window):
    q, k, v, _ = _inputs(3, 2, t, s, 4, 2, 8, 6, jnp.float64)
    lengths = jnp.array([t, max(1, t // 2)], jnp.int32), jnp.array([max(1, s - 3), s], jnp.int32)
    out = _attention(
        q, k, v, is_causal=causal, window=window, query_lengths=lengths[0],
        key_lengths=lengths[1], implementation="chunked", block_sizes=(4, 8))
    expected = reference.attention(q, k, v, is_causal=causal, window=window,
                                   query_lengths=lengths[0], key_lengths=lengths[1])
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_chunked_bfloat16_within_1e_2_of_dense():
    q, k, v, d_out = _inputs(5, 2, 40, 56, 4, 2, 16, 16, jnp.bfloat16)
    bias = jnp.zeros((1, 1, 1, 56), jnp.bfloat16)
    options = dict(is_causal=True)
    (dense_out, dense_grads), (out, grads) = _outputs_and_grads(
        q, k, v, d_out, bias, options, (16, 16))
    chex.assert_type([out, *grads[:3]], jnp.bfloat16)
    assert relative_error(out, dense_out) <= 1e-2
    for g, g_dense in zip(grads[:3], dense_grads[:3]):
        assert relative_error(g, g_dense) <= 1e-2


@pytest.mark.parametrize("b, n, k", [(2, 4, 2), (3, 6, 3)])
def test_chunked_bfloat16_grouped_heads_train(b, n, k):
    """bfloat16 gradients of grouped-query heads over a batch (B, K and G all > 1), a
    loss whose cotangent varies: on a CPU, d_k's and d_v's products had three batch axes
    in bfloat16, which XLA's CPU runtime refused ("Unsupported element type for
    DotThunk::Execute")."""
    q, kk, vv, weights = _inputs(11, b, 12, 12, n, k, 8, 8, jnp.bfloat16)

    def loss(q, kk, vv, implementation):
        out = attnjax.dot_product_attention(q, kk, vv, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) ** 2 * weights.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)
    chunked_grads = grads(q, kk, vv, "chunked")
    chex.assert_type(chunked_grads, jnp.bfloat16)
    # the same inputs' gradients in float32; bfloat16 rounds the weights and the logits'
    # gradient to 8 bits before the products (the dense kernel's bfloat16 gradients:
    # 0.4-0.8e-2 from these, the chunked kernel's 0.5-1.0e-2)
    wide = grads(*(x.astype(jnp.float32) for x in (q, kk, vv)), "dense")
    for g, g_wide in zip(chunked_grads, wide):
        assert relative_error(g, g_wide) <= 2e-2


def test_gradients_float64_check_grads():
    q, k, v, _ = _inputs(2, 1, 6, 9, 2, 1, 3, 4, jnp.float64)

    def fn(q, k, v):
        return attnjax.dot_product_attention(
            q, k, v, is_causal=True, implementation="chunked", block_sizes=(4, 4))

    jax.test_util.check_grads(jax.jit(fn), (q, k, v), order=1, modes=("rev",))


@pytest.mark.parametrize("magnitude", [1e3, 1e7])
def test_gradients_at_huge_logits_with_tied_keys_equal_dense(magnitude):
    """Logits of ±magnitude in float32, two keys tied at each row's maximum (a repeated
    token), a bias tied the same way, and sinks: the weights the backward pass rebuilds
    from the saved log-sum-exp are dense's (at 1e7 its log of the sum, 0.69, had
    rounded away beside the shift: the gradients of v 0.61 each instead of 0.5)."""
    q, k, v, d_out = _inputs(11, 2, 3, 5, 2, 2, 4, 3)
    q = jnp.abs(q) * magnitude ** 0.5
    k = jnp.abs(k).at[:, 1].set(jnp.abs(k)[:, 0]) * magnitude ** 0.5 / 4
    bias = jnp.zeros((2, 2, 3, 5), jnp.float32).at[..., :2].set(magnitude)
    sinks = jnp.asarray([-1.0, 2.0], jnp.float32)

    def loss(implementation, q, k, v, bias, dtype=jnp.float32):
        out = attnjax.dot_product_attention(
            *(x.astype(dtype) for x in (q, k, v, bias)), sinks=sinks.astype(dtype),
            implementation=implementation)
        return jnp.sum(out * d_out.astype(dtype))

    dense, chunked_, exact = (
        jax.jit(jax.grad(functools.partial(loss, name, dtype=dtype), argnums=(0, 1, 2, 3)))(
            q, k, v, bias)
        for name, dtype in (("dense", jnp.float32), ("chunked", jnp.float32),
                            ("dense", jnp.float64)))
    chex.assert_tree_all_finite(chunked_)
    # v's and the bias's, the weights and their logits' gradient: as dense's
    for got, want in zip(chunked_[2:], dense[2:]):
        assert relative_error(got, want) <= 1e-5
    # q's and k's, sums of terms of ~magnitude that cancel: as near float64's as dense's
    for got, want, wide in zip(chunked_[:2], dense[:2], exact[:2]):
        assert np.max(np.abs(got - wide)) <= 4 * np.max(np.abs(want - wide)) + 1e-6


@pytest.mark.parametrize("sinks", [None, -5.0])
def test_float16_gradients_where_do_v_passes_65504(sinks):
    """float16, values of ±2000 over V = 256: dO·vᵀ ≈ 2.6e5, past float16's range, while
    every input, output and gradient fits. The gradients are float32's, rounded (the
    logits' gradient had been cast to float16 for its products: inf, then NaN)."""
    q, k, _, _ = _inputs(12, 1, 2, 2, 1, 1, 4, 256)
    k = k * 1e-2
    v = jnp.concatenate([jnp.full((1, 1, 1, 256), 2000.0), jnp.full((1, 1, 1, 256), -2000.0)],
                        axis=1)
    q, k, v = (x.astype(jnp.float16).astype(jnp.float32) for x in (q * 0.1, k, v))

    def grads(dtype):
        def loss(q, k):
            out = attnjax.dot_product_attention(
                q.astype(dtype), k.astype(dtype), v.astype(dtype), implementation="chunked",
                sinks=None if sinks is None else jnp.asarray([sinks], dtype))
            return jnp.sum(out.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(q, k)

    half, wide = grads(jnp.float16), grads(jnp.float32)
    chex.assert_tree_all_finite(half)
    for g, w in zip(half, wide):
        assert relative_error(g, w) <= 2e-3


def test_dropout_is_deterministic_per_rng_and_unbiased():
    q, k, v, _ = _inputs(9, 2, 12, 20, 2, 2, 4, 5)

    def run(key):
        return attnjax.dot_product_attention(q, k, v, dropout_rate=0.3, dropout_rng=key,
                                             implementation="chunked", block_sizes=(8, 8))

    run_one = jax.jit(run)
    np.testing.assert_array_equal(run_one(jax.random.key(1)), run_one(jax.random.key(1)))
    assert not np.allclose(run_one(jax.random.key(1)), run_one(jax.random.key(2)))
    samples = 3000
    outs = np.asarray(jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(4), samples)))
    expected = np.asarray(_attention(q, k, v, implementation="dense"))
    sem = outs.std(0) / np.sqrt(samples)
    assert np.all(np.abs(outs.mean(0) - expected) <= 5 * sem + 1e-6)


@pytest.mark.parametrize("is_causal, window", [(True, None), (False, (5, 2)), (True, (9, 0))])
@pytest.mark.parametrize("t, s", [(40, 40), (24, 61), (50, 17)])
def test_block_classes_are_sound_and_skip_the_masked_blocks(t, s, is_causal, window):
    """SKIP blocks hold no visible pair and FULL blocks are visible whole (key padding
    past S counts as hidden); for one rule alone the classes are exact: every block
    with no visible pair is skipped and every block visible whole runs unmasked."""
    q_len, k_len = t - 3, s - 5
    rules = {"causal": masks.causal() if is_causal else None,
             "window": masks.window(*window) if window else None,
             "lengths": masks.lengths(jnp.array([q_len]), jnp.array([k_len]))}
    plan = chunked._Plan(t, s, 8, 16, 0.0)
    real = np.zeros((plan.padded_t, plan.padded_s), bool)
    real[:t, :s] = True

    def classes_and_truth(mask, **rule):
        seen = np.zeros_like(real)
        seen[:t, :s] = reference.visible(t, s, **rule)
        table = np.asarray(jax.jit(lambda mask: chunked._table(   # (one program)
            plan, heads.group(mask.bind(masks.Shape(1, t, s, 1)), 1, 1).padded(
                plan.padded_t, plan.padded_s), (1, 1, 1)))(mask))
        blocks = (plan.num_q_blocks, 8, plan.num_k_blocks, 16)
        live = seen.reshape(blocks).any(axis=(1, 3))
        # padded query rows are dropped, so they do not make a block partial
        whole = (seen | ~real.any(axis=1, keepdims=True)).reshape(blocks).all(axis=(1, 3))
        return table, live, whole

    parts = [(m, kw) for m, kw in (
        (rules["causal"], dict(is_causal=True)), (rules["window"], dict(window=window)),
        (rules["lengths"], dict(query_length=q_len, key_length=k_len))) if m is not None]
    combined = functools.reduce(lambda a, b: a & b, [m for m, _ in parts])
    table, live, whole = classes_and_truth(
        combined, **{k: v for _, kw in parts for k, v in kw.items()})
    assert not live[table == masks.SKIP].any()
    assert whole[table == masks.FULL].all()
    if is_causal and window is None and t == s:
        assert (table != masks.SKIP).sum() < 0.7 * table.size
    for mask, rule in parts:
        table, live, whole = classes_and_truth(mask, **rule)
        np.testing.assert_array_equal(table != masks.SKIP, live)
        np.testing.assert_array_equal(table == masks.FULL, whole)



@pytest.mark.parametrize("t, s", [(6, 7), (5, 19), (21, 8)])
def test_a_loop_over_one_block_visits_it_as_one_kind(t, s):
    """Where the forward's rows (S ≤ block_k) or the backward's columns (T ≤ block_q)
    have one block, full and partial blocks share one masked loop: with a block table
    known only at run time (random mask, lengths) the outputs and gradients are dense's,
    and a grid of one block has half the products of a grid of two by two blocks."""
    b, n, k, h, v = 2, 2, 1, 4, 3
    q, kk, vv, d_out = _inputs(t * s, b, t, s, n, k, h, v)
    more = draws.host(s)
    bias = draws.normal(more, (1, 1, 1, s))
    options = dict(is_causal=True, key_lengths=draws.randint(more, (b,), 1, s + 1),
                   mask=draws.bernoulli(more, 0.7, (b, 1, t, s)))
    (dense_out, dense_grads), (out, grads) = _outputs_and_grads(
        q, kk, vv, d_out, bias, options, (8, 8))
    chex.assert_tree_all_finite((out, grads))
    assert relative_error(out, dense_out) <= 2e-5
    for name, g, g_dense in zip(("query", "key", "value", "bias"), grads, dense_grads):
        assert relative_error(g, g_dense) <= 2e-5, name

    def products(length):
        x = jax.ShapeDtypeStruct((1, length, 1, h), jnp.float32)
        m = jax.ShapeDtypeStruct((1, 1, length, length), jnp.bool_)
        loss = lambda q, m: jnp.sum(attnjax.dot_product_attention(  # noqa: E731
            q, q, q, mask=m, implementation="chunked", block_sizes=(8, 8)))
        return str(jax.make_jaxpr(jax.grad(loss))(x, m)).count("dot_general")

    assert 2 * products(8) == products(16)


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
    (out, weights), auto_out = jax.jit(lambda q, k, v: (
        attnjax.dot_product_attention(q, k, v, return_weights=True),
        attnjax.dot_product_attention(q, k, v)))(q, k, v)
    chex.assert_shape(weights, (1, 1, 600, 600))
    np.testing.assert_allclose(out, auto_out, rtol=2e-5, atol=1e-6)
    with pytest.raises(ValueError, match="return_weights=True needs implementation='dense'"):
        attnjax.dot_product_attention(q, k, v, return_weights=True, implementation="chunked")
    with pytest.raises(ValueError, match="block_sizes=.* applies to implementation='chunked'"):
        attnjax.dot_product_attention(q, k, v, implementation="dense", block_sizes=(8, 8))


@pytest.mark.parametrize("n, k", [(4, 2), (3, 1)])
def test_heads_in_groups_equal_all_heads_at_once(monkeypatch, n, k):
    """Past LOGITS_BLOCK_BYTES the heads take the block loops in groups (split over K,
    or over G when K = 1): the same outputs, log-sum-exps and gradients — into q, k, v,
    a bias, the sinks and a score_mod's closed-over slopes — dropout included."""
    q, key, v, d_out = _inputs(5, 2, 13, 21, n, k, 8, 5)
    bias, sinks = draws.normals(6, (2, n, 13, 21), (n,))
    slopes = attnjax.scores.alibi_slopes(n)

    def run(q, key, v, bias, sinks, slopes):
        out, lse = attnjax.dot_product_attention(
            q, key, v, bias, masks.causal() | masks.prefix(3), implementation="chunked",
            block_sizes=(4, 8), score_mod=attnjax.scores.alibi(slopes), sinks=sinks,
            dropout_rate=0.25, dropout_rng=jax.random.key(8), return_residual=True)
        return jnp.sum(out * d_out) + jnp.sum(jnp.tanh(lse)), (out, lse)

    grad = jax.jit(jax.grad(run, argnums=range(6), has_aux=True))
    together = grad(q, key, v, bias, sinks, slopes)
    monkeypatch.setattr(chunked, "LOGITS_BLOCK_BYTES", 2 * 4 * 8 * 4)  # one head a pass
    split = jax.jit(jax.grad(run, argnums=range(6), has_aux=True))(q, key, v, bias, sinks, slopes)
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(together)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_functions_over_arrays_an_enclosing_jit_traces_train_in_every_pattern():
    """A document mask whose from_fn reads segment ids the caller's jit traces (and a
    score_mod reading integer ids), differentiated from outside that jit, under
    jax.checkpoint and in a lax.scan over layers: the chunked kernel's gradients equal
    the dense kernel's (it had failed: the integer ids stayed closed over inside its
    custom VJP, a tracer of a trace its passes are not in)."""
    q, k, v, _ = _inputs(31, 2, 16, 16, 2, 2, 8, 8)
    ids = jnp.asarray(np.random.default_rng(32).integers(0, 3, (2, 16)), jnp.int32)
    offsets = jnp.asarray(np.random.default_rng(33).integers(-2, 3, (2,)), jnp.int32)

    def layer(q, ids, implementation):
        mask = masks.causal() & masks.from_fn(
            lambda b, n, i, j: ids[b][i] == ids[b][j])
        mod = lambda s, b, n, i, j: s + (offsets[b] * (i - j)).astype(s.dtype) / 8  # noqa: E731
        return attnjax.dot_product_attention(q, k, v, mask=mask, score_mod=mod,
                                             implementation=implementation)

    def loss(implementation, pattern):
        def f(q, ids):
            if pattern == "checkpoint":
                return jnp.sum(jax.checkpoint(layer, static_argnums=2)(q, ids, implementation))
            if pattern == "scan":
                out, _ = jax.lax.scan(lambda x, _: (layer(x, ids, implementation), None), q,
                                      None, length=2)
                return jnp.sum(out)
            return jnp.sum(jax.jit(layer, static_argnums=2)(q, ids, implementation))
        return f

    for pattern in ("grad of jit", "checkpoint", "scan"):
        grads = {implementation: jax.jit(jax.grad(loss(implementation, pattern)))(q, ids)
                 if pattern != "grad of jit" else jax.grad(loss(implementation, pattern))(q, ids)
                 for implementation in ("dense", "chunked")}
        np.testing.assert_allclose(grads["chunked"], grads["dense"], rtol=1e-5, atol=1e-5)


def test_forward_mode_on_the_chunked_kernel_is_named():
    """Forward mode on implementation='chunked' (a custom VJP): a TypeError naming the
    kernel and the one that runs it (jax's own message named neither), and the dense
    kernel's jvp is the derivative the chunked kernel's vjp gives; jax.hessian (forward
    over reverse) runs on the chunked kernel."""
    q, k, v, d_out = _inputs(21, 1, 6, 6, 2, 2, 4, 4)
    chunked_call = functools.partial(attnjax.dot_product_attention, implementation="chunked",
                                     block_sizes=(4, 4))
    for forward_mode in (lambda f: jax.jvp(f, (q,), (d_out,)), lambda f: jax.jacfwd(f)(q)):
        with pytest.raises(TypeError, match="implementation='chunked' is differentiated in "
                                            "reverse mode .* takes implementation='dense'"):
            forward_mode(lambda q: chunked_call(q, k, v))
    _, tangent = jax.jvp(lambda q: attnjax.dot_product_attention(
        q, k, v, implementation="dense"), (q,), (d_out,))
    _, vjp = jax.vjp(lambda q: chunked_call(q, k, v), q)
    # <J d, c> two ways: the dense tangent against a cotangent c, the chunked vjp of c
    c = draws.normals(22, q.shape)[0]
    np.testing.assert_allclose(jnp.vdot(tangent, c), jnp.vdot(vjp(c)[0], d_out), rtol=1e-5)
    # forward over reverse (jax.hessian's) differentiates the backward pass's plain
    # code: the chunked kernel's Hessian is the dense kernel's
    hessians = [jax.hessian(lambda q, call=call: jnp.sum(jnp.sin(call(q, k, v))))(q)
                for call in (chunked_call, functools.partial(attnjax.dot_product_attention,
                                                             implementation="dense"))]
    np.testing.assert_allclose(*hessians, rtol=1e-5, atol=1e-6)
