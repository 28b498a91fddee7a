"""Layer 2: batched, multi-head dot_product_attention against references."""

import functools
import importlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnjax
from attnjax import masks, scores
from tests import draws, reference
from tests.checks import lowerings
from tests.numerics import softmax_float64

attention_module = importlib.import_module("attnjax.attention")

B, T, S, N, K, H, V = 2, 5, 7, 6, 3, 4, 11


def _qkv(rng, b=B, t=T, s=S, n=N, k=K, h=H, v=V, dtype=jnp.float32):
    """q, k, v from rng (a key, a seed or a generator: tests.draws)."""
    return draws.normals(rng, (b, t, n, h), (b, s, k, h), (b, s, k, v), dtype=dtype)


def _jax_nn(query, key, value, **kw):
    """jax.nn.dot_product_attention for any V: it needs V = H, and attention is
    linear in the value columns, so run it on H-wide column slices (zero-padded).
    jax.nn compares int32 lengths with int64 positions, so it runs with standard
    dtype promotion (attnjax itself passes under the suite's strict promotion)."""
    h, v = key.shape[-1], value.shape[-1]
    pieces = []
    for start in range(0, v, h):
        part = value[..., start:start + h]
        pad = h - part.shape[-1]
        part = jnp.pad(part, [(0, 0)] * 3 + [(0, pad)])
        with jax.numpy_dtype_promotion("standard"):
            pieces.append(jax.nn.dot_product_attention(query, key, part, **kw)[..., :h - pad])
    return jnp.concatenate(pieces, axis=-1)


@functools.partial(jax.jit, static_argnames=("is_causal", "window", "return_weights"))
def _attention(*args, **kwargs):
    """attnjax.dot_product_attention compiled (one program, not one per primitive), with
    its flags static."""
    return attnjax.dot_product_attention(*args, **kwargs)


@functools.partial(jax.jit, static_argnames=("is_causal",))
def _ours_and_jax_nn(q, k, v, bias, mask, q_len, k_len, *, is_causal):
    """attnjax and jax.nn on the same inputs, compiled together: one program per shape
    and option structure (None arrays are empty pytrees), reused across examples,
    instead of hundreds of eagerly compiled primitives per example."""
    ours = attnjax.dot_product_attention(
        q, k, v, bias, mask, is_causal=is_causal, query_lengths=q_len, key_lengths=k_len)
    theirs = _jax_nn(q, k, v, bias=bias, mask=mask, is_causal=is_causal,
                     query_seq_lengths=q_len, key_value_seq_lengths=k_len)
    return ours, theirs


# (B, T, S, N, K, H, V): T ≠ S, H ≠ V, grouped and multi-query heads, a single query.
# A few fixed shapes keep the compiled-primitive cache warm; the options and the random
# data vary freely.
SHAPES = [
    (2, 5, 7, 6, 3, 4, 4),
    (1, 6, 6, 4, 4, 8, 5),
    (3, 4, 4, 6, 2, 4, 4),
    (2, 1, 9, 2, 1, 8, 8),
    (2, 8, 3, 3, 1, 2, 6),
]


@st.composite
def cases(draw):
    b, t, s, n, k, h, v = draw(st.sampled_from(SHAPES))
    return dict(
        b=b, t=t, s=s, n=n, k=k, h=h, v=v,
        causal=t == s and draw(st.booleans()),
        mask=draw(st.sampled_from([None, "full", "per_example", "per_head_query"])),
        bias=draw(st.sampled_from([None, "full", "key_only"])),
        lengths=draw(st.sampled_from([None, "query", "key", "both"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(max_examples=200, deadline=None, derandomize=True)
@given(cases())
def test_matches_jax_nn_float32(case):
    b, t, s, n, k = case["b"], case["t"], case["s"], case["n"], case["k"]
    generator = draws.host(case["seed"])
    q, kk, v = _qkv(generator, b, t, s, n, k, case["h"], case["v"])
    mask_shape = {None: None, "full": (b, n, t, s), "per_example": (b, 1, 1, s),
                  "per_head_query": (1, n, t, 1)}[case["mask"]]
    mask = None if mask_shape is None else draws.bernoulli(generator, 0.7, mask_shape)
    bias_shape = {None: None, "full": (b, n, t, s), "key_only": (1, 1, 1, s)}[case["bias"]]
    bias = None if bias_shape is None else draws.normal(generator, bias_shape)
    q_len = k_len = None
    if case["lengths"] in ("query", "both"):
        q_len = draws.randint(generator, (b,), 1, t + 1)
    if case["lengths"] in ("key", "both"):
        k_len = draws.randint(generator, (b,), 1, s + 1)

    ours, theirs = _ours_and_jax_nn(q, kk, v, bias, mask, q_len, k_len,
                                    is_causal=case["causal"])
    chex.assert_shape(ours, (b, t, n, case["v"]))
    chex.assert_type(ours, jnp.float32)

    # Rows that see no key: attnjax gives zeros, jax.nn averages all values. Compare
    # only the rows that see at least one key, and check the others are exact zeros.
    seen = np.ones((b, n, t, s), bool)
    if mask is not None:
        seen &= np.broadcast_to(np.asarray(mask), seen.shape)
    q_len, k_len = (None if x is None else np.asarray(x) for x in (q_len, k_len))
    for e in range(b):
        seen[e] &= reference.visible(
            t, s, is_causal=case["causal"],
            query_length=None if q_len is None else int(q_len[e]),
            key_length=None if k_len is None else int(k_len[e]))
    # [B, T, N]
    row_sees = seen.any(-1).transpose(0, 2, 1)
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    np.testing.assert_allclose(ours[row_sees], theirs[row_sees], rtol=1e-5, atol=1e-6)
    assert np.all(ours[~row_sees] == 0)


@pytest.mark.parametrize(
    "t, s, causal, window",
    [(5, 5, True, None), (3, 8, True, None), (1, 9, True, None), (4, 9, False, (2, 1)),
     (6, 6, True, (3, 0)), (7, 4, False, 1), (2, 7, True, (0, 0))],
)
def test_matches_float64_reference_causal_and_windows(rng, t, s, causal, window):
    generator = draws.host(rng)
    q, k, v = _qkv(generator, t=t, s=s, dtype=jnp.float64)
    bias = draws.normal(generator, (B, N, t, s), jnp.float64)
    q_len = jnp.array([t, max(1, t - 2)], jnp.int32)
    k_len = jnp.array([max(1, s - 1), s], jnp.int32)
    w = (window, window) if isinstance(window, int) else window
    ours = _attention(
        q, k, v, bias, is_causal=causal, window=window, query_lengths=q_len, key_lengths=k_len)
    expected = reference.attention(
        q, k, v, bias=bias, is_causal=causal, window=w, query_lengths=q_len, key_lengths=k_len)
    np.testing.assert_allclose(ours, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_float16_with_a_scale_above_one_is_the_float32_result(implementation, traced):
    """float16 with scale=1000 (in range) and queries of ~100: q·scale passes float16's
    65504 (it was inf, then NaN, in both kernels; jax.nn computes it), and so it did for
    the same scale traced under jit (a learned temperature, say). The output is that of
    the float32 call rounded to float16, the gradients the exact ones (float64) to
    within float32's rounding at the problem's scale: the weights are nearly one-hot, so
    d_k's exact value, ~1e-9, lies far below what any float32 kernel resolves (each
    kernel's float32 call is 0.005 off it; the float16 one had matched that noise while
    its derivative read the rounded output)."""
    q, k, v, d_out = draws.normals(3, (2, 5, 2, 4), (2, 6, 2, 4), (2, 6, 2, 4), (2, 5, 2, 4))
    # float16's values, so that both calls take the same numbers
    q, k, v = (x.astype(jnp.float16).astype(jnp.float32) for x in (q * 50.0, k * 0.01, v))

    def grads(dtype):
        def loss(q, k, v, scale):
            out = attnjax.dot_product_attention(*(x.astype(dtype) for x in (q, k, v)),
                                                scale=scale if traced else 1000.0,
                                                implementation=implementation)
            out = out.astype(jnp.float16)
            return jnp.sum(out.astype(jnp.float32) * d_out), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
            q, k, v, jnp.float32(1000.0))

    (half, out), (_, out_wide) = grads(jnp.float16), grads(jnp.float32)
    chex.assert_tree_all_finite((out, half))
    np.testing.assert_array_equal(out, out_wide)

    wide = jax.grad(lambda *x: jnp.sum(softmax_float64(*x, 1000.0) * d_out.astype(
        jnp.float64)), argnums=(0, 1, 2))(*(x.astype(jnp.float64) for x in (q, k, v)))
    # the bound of a logit's derivative, |dO|·|v|·H, through the scale to q and k, in
    # float32's rounding; d_v = Pᵀ dO, with the weights in float16 (as jax.nn's)
    bound = float(jnp.max(jnp.abs(d_out)) * jnp.max(jnp.abs(v))) * q.shape[-1]
    atols = (2.0 ** -23 * 1000.0 * bound * k.shape[1] * float(jnp.max(jnp.abs(k))),
             2.0 ** -23 * 1000.0 * bound * q.shape[1] * float(jnp.max(jnp.abs(q))),
             2.0 ** -10 * float(jnp.max(jnp.abs(d_out))) * q.shape[1])
    for g, w, atol in zip(half, wide, atols):
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=atol)


def test_causal_with_fewer_queries_sees_the_whole_prefix(rng):
    """Bottom-right alignment: the last query sees every key, the first sees S − T + 1."""
    q, k, v = _qkv(rng, t=3, s=8)
    _, weights = _attention(q, k, v, is_causal=True, return_weights=True)
    visible = np.asarray(weights[0, 0] > 0)
    np.testing.assert_array_equal(visible.sum(-1), [6, 7, 8])
    np.testing.assert_array_equal(visible, np.asarray(attnjax.causal_mask(3, 8)))


def test_a_python_bool_mask_is_a_0_d_mask(rng):
    """mask=True sees every key, mask=False none (zeros), as their 0-d arrays do (a
    TypeError saying a bool is not boolean, before)."""
    q, k, v = _qkv(rng)
    np.testing.assert_array_equal(_attention(q, k, v, mask=True), _attention(q, k, v))
    np.testing.assert_array_equal(_attention(q, k, v, mask=False), np.zeros(q.shape[:3] + (V,)))


def test_unbatched_equals_batched(rng):
    generator = draws.host(rng)
    q, k, v = _qkv(generator)
    mask = draws.bernoulli(generator, 0.8, (N, T, S))
    batched = _attention(q, k, v, mask=mask[None], key_lengths=jnp.array([4, 6], jnp.int32))
    for e, k_len in enumerate((4, 6)):
        single = _attention(q[e], k[e], v[e], mask=mask, key_lengths=jnp.array(k_len, jnp.int32))
        np.testing.assert_allclose(single, batched[e], rtol=1e-6)


def test_each_head_is_the_core_attention(rng):
    """The batched form is the core applied per (example, query head) with its kv head."""
    generator = draws.host(rng)
    q, k, v = _qkv(generator)
    bias = draws.normal(generator, (B, N, T, S))
    out, weights = _attention(q, k, v, bias, return_weights=True)
    core_attention, core_weights = jax.jit(attnjax.attention), jax.jit(attnjax.attention_weights)
    g = N // K
    for e in range(B):
        for head in range(N):
            args = (q[e, :, head], k[e, :, head // g])
            np.testing.assert_allclose(
                out[e, :, head], core_attention(*args, v[e, :, head // g], bias=bias[e, head]),
                rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(
                weights[e, head], core_weights(*args, bias=bias[e, head]),
                rtol=1e-5, atol=1e-6)


class TestVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_shapes_dtypes_and_weights(self):
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
            q, k, v = _qkv(jax.random.key(7), dtype=dtype)
            fn = self.variant(lambda q, k, v: attnjax.dot_product_attention(
                q, k, v, is_causal=True, window=(3, 1), return_weights=True))
            out, weights = fn(q, k, v)
            chex.assert_shape(out, (B, T, N, V))
            chex.assert_shape(weights, (B, N, T, S))
            chex.assert_type([out, weights], dtype)
            chex.assert_tree_all_finite(out)

    @chex.variants(with_jit=True, without_jit=True)
    def test_mask_helpers(self):
        lengths = jnp.array([2, 5], jnp.int32)
        chex.assert_shape(self.variant(attnjax.causal_mask, static_argnums=(0, 1))(3, 5), (3, 5))
        chex.assert_type(self.variant(attnjax.padding_mask, static_argnums=1)(lengths, 6), bool)
        qk = self.variant(attnjax.query_key_mask, static_argnums=(2, 3))(lengths, lengths, 4, 6)
        chex.assert_shape(qk, (2, 1, 4, 6))


def test_mask_helpers_values():
    lengths = jnp.array([2, 4], jnp.int32)
    np.testing.assert_array_equal(
        attnjax.padding_mask(lengths, 5), [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(attnjax.causal_mask(4), np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(
        attnjax.sliding_window_mask(4, 6, (1, 0)), reference.visible(4, 6, window=(1, 0)))
    qk = attnjax.query_key_mask(lengths, jnp.array([3, 1], jnp.int32), 4, 5)
    expected = np.zeros((2, 1, 4, 5), bool)
    expected[0, 0, :2, :3] = True
    expected[1, 0, :4, :1] = True
    np.testing.assert_array_equal(qk, expected)
    combined = attnjax.combine_masks(attnjax.causal_mask(4, 5), None, qk)
    np.testing.assert_array_equal(combined, expected & np.tril(np.ones((4, 5), bool), 1))
    assert attnjax.combine_masks(None, None) is None
    # The helpers agree with the options that build the same mask.
    q, k, v = _qkv(jax.random.key(1), t=4, s=5)
    by_mask = _attention(q, k, v, mask=combined)
    by_options = _attention(
        q, k, v, is_causal=True, query_lengths=lengths, key_lengths=jnp.array([3, 1], jnp.int32))
    np.testing.assert_allclose(by_mask, by_options, rtol=1e-6)


def test_jit_compatible_with_traced_lengths(rng):
    q, k, v = _qkv(rng)
    fn = jax.jit(lambda q, k, v, kl: attnjax.dot_product_attention(q, k, v, key_lengths=kl))
    k_len = jnp.array([3, 7], jnp.int32)
    np.testing.assert_allclose(
        fn(q, k, v, k_len), _attention(q, k, v, key_lengths=k_len), rtol=1e-6)


def test_an_eager_call_compiles_the_kernel_as_one_program(rng):
    """Outside jit, a call runs as one program compiled per shape and options (about
    sixty one-operation programs otherwise), its lengths and positions laid out on the
    host; inside jit it is a nested call XLA inlines, with the same numbers."""
    q, k, v = _qkv(rng, t=13, s=19)
    key_lengths = jnp.array([11, 19], jnp.int32)
    call = functools.partial(attnjax.dot_product_attention, is_causal=True,
                             key_lengths=key_lengths, implementation="chunked",
                             block_sizes=(8, 8))
    # the first call of these shapes: the arguments' checks and layout compile nothing
    assert lowerings(lambda: call(q, k, v)) == 1
    eager = call(q, k, v)
    traced = jax.jit(lambda q, k, v: call(q, k, v))(q, k, v)
    np.testing.assert_allclose(eager, traced, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(eager, _attention(q, k, v, is_causal=True,
                                                 key_lengths=key_lengths), rtol=1e-5,
                               atol=1e-6)


def test_an_eager_grad_or_vmap_compiles_the_kernel_as_one_program(rng):
    """jax.grad and jax.vmap of a call, outside jit, run the kernel as one program too
    (its derivative one more), not operation by operation (about a hundred one-operation
    programs for this gradient); the numbers are jit's."""
    q, k, v = _qkv(rng, t=14, s=17)
    key_lengths = jnp.array([9, 17], jnp.int32)
    call = functools.partial(attnjax.dot_product_attention, is_causal=True,
                             key_lengths=key_lengths)
    grad = jax.grad(lambda q, k, v: jnp.sum(call(q, k, v) ** 2), (0, 1, 2))
    call(q, k, v)   # the arguments' checks
    # the kernel, its derivative, and the loss's and the casts' few operations
    assert lowerings(lambda: grad(q, k, v)) <= 12
    chex.assert_trees_all_close(grad(q, k, v), jax.jit(grad)(q, k, v), rtol=1e-6,
                                atol=1e-6)
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]   # [2, B, ...]
    mapped = jax.vmap(call)
    # the kernel, and the default positions and indices (iotas, under vmap)
    assert lowerings(lambda: mapped(*stacked)) <= 12
    chex.assert_trees_all_close(mapped(*stacked), jax.jit(mapped)(*stacked), rtol=1e-6,
                                atol=1e-6)


def test_a_traced_call_s_program_does_not_grow_with_the_sequence():
    """Under jit the default positions and the example and head indices are iotas of
    the program: its text is about the same at T = 2048 and 16384 (made on the host,
    they were constants of T numbers each, 2 MB of program at T = 131072, and compiled
    1.6-1.9x slower)."""
    def text(t):
        x = jax.ShapeDtypeStruct((1, t, 1, 8), jnp.float32)
        return jax.jit(lambda q: attnjax.dot_product_attention(
            q, q, q, is_causal=True, implementation="chunked")).lower(x).as_text()

    assert len(text(16384)) < 1.1 * len(text(2048))


def test_eager_calls_compile_for_a_score_mod_once_it_comes_again(rng):
    """A function new at every call (a lambda written in the call) is not compiled for:
    the call runs operation by operation, whose programs are already there the second
    time. The same function again is compiled for once; soft_cap(cap) is one function
    per cap."""
    q, k, v = _qkv(rng, t=11, s=11)

    def call(mod):
        return attnjax.dot_product_attention(q, k, v, score_mod=mod)

    lowerings(lambda: call(lambda s, b, n, i, j: s * 0.5))
    assert lowerings(lambda: call(lambda s, b, n, i, j: s * 0.5)) == 0

    def half(s, b, n, i, j):
        return s * 0.5

    lowerings(lambda: call(half))
    assert lowerings(lambda: call(half)) == 1
    assert lowerings(lambda: call(half)) == 0
    np.testing.assert_allclose(call(half), attnjax.dot_product_attention(
        q, k, v, scale=0.5 * H ** -0.5), rtol=1e-5, atol=1e-6)
    assert scores.soft_cap(30.0) is scores.soft_cap(30.0) and (
        scores.soft_cap(30.0) is not scores.soft_cap(20.0))


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_the_functions_of_a_call_read_the_state_of_the_moment(rng, implementation):
    """A score_mod that reads a Python number and a from_fn mask that reads an array it
    closes over, both changed between calls: each call, eager or under a fresh jit,
    equals the same call with new functions (compiled programs and jax's closure
    conversion had kept what the functions read when first traced)."""
    q, k, v = _qkv(rng, t=11, s=11)
    gain, near = 1.0, np.array(3, np.int32)

    def mod(s, b, n, i, j):
        return s + gain * (i - j).astype(s.dtype) / 4

    mask = masks.from_fn(lambda b, n, i, j: jnp.abs(i - j) <= near)
    for gain, near[...] in [(1.0, 3), (1.0, 3), (-2.0, 3), (-2.0, 1), (0.5, 5)]:
        now = attnjax.dot_product_attention(
            q, k, v, implementation=implementation,
            score_mod=lambda s, b, n, i, j, g=gain: s + g * (i - j).astype(s.dtype) / 4,
            mask=masks.from_fn(lambda b, n, i, j, w=int(near): jnp.abs(i - j) <= w))
        call = functools.partial(attnjax.dot_product_attention, implementation=implementation,
                                 score_mod=mod, mask=mask)
        np.testing.assert_allclose(call(q, k, v), now, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(jax.jit(lambda *x: call(*x))(q, k, v), now, rtol=1e-6,
                                   atol=1e-6)


def test_functions_over_traced_values_or_keys_run_again_and_again(rng):
    """One score_mod shared by two calls (two layers) over a table the caller's grad or
    vmap traces, the inputs known; and a from_fn over a typed PRNG key, called eagerly
    again and again: each call runs as the first (the second had failed turning the
    closed-over tracer or key into NumPy)."""
    q, k, v = _qkv(rng, t=9, s=9)
    table = jax.random.normal(jax.random.fold_in(rng, 1), (17, N), q.dtype)

    def twice(table):
        def mod(s, b, n, i, j):
            return s + table[i - j + 8, n]
        return sum(jnp.sum(attnjax.dot_product_attention(q, k, v, score_mod=mod) * w)
                   for w in (1.0, 0.5))

    def once(table, w):
        return jnp.sum(attnjax.dot_product_attention(
            q, k, v, score_mod=lambda s, b, n, i, j: s + table[i - j + 8, n]) * w)

    np.testing.assert_allclose(jax.grad(twice)(table), jax.grad(once)(table, 1.5), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(jax.vmap(twice)(jnp.stack([table, -table])),
                               [once(table, 1.5), once(-table, 1.5)], rtol=1e-5)
    before = None
    for seed in (3, 4):
        key = jax.random.key(seed)
        mask = masks.from_fn(lambda b, n, i, j: jax.random.bernoulli(key, 0.5, (9, 9))[i, j]
                             | (i == j))
        eager = [attnjax.dot_product_attention(q, k, v, mask=mask) for _ in range(2)]
        np.testing.assert_array_equal(eager[1], eager[0])
        np.testing.assert_allclose(eager[0], jax.jit(
            lambda q: attnjax.dot_product_attention(q, k, v, mask=mask))(q), rtol=1e-6,
            atol=1e-6)
        if seed == 4:
            assert not np.allclose(eager[0], before, atol=1e-3)
        before = eager[0]


@pytest.mark.parametrize("b, t, n, chosen", [
    (32, 64, 4, "dense"),       # a toy task's batch
    (64, 256, 8, "dense"),      # T·S = 256²: dense whatever the batch (its value alone:
                                # chunked, see the next test)
    (1, 512, 8, "dense"),       # 512², 8 MiB of logits: dense
    (2, 512, 8, "chunked"),     # 512², 16 MiB: chunked
    (1, 320, 32, "chunked"),    # between 256² and 512², 12.5 MiB: chunked
    (1, 640, 1, "chunked"),     # above 512²: chunked whatever the batch
])
def test_implementation_none_picks_by_grid_and_batch(monkeypatch, b, t, n, chosen):
    """implementation=None traces the derivatives of the kernel its rule picks (on a
    CPU, the rule by the grid T·S and the batch's logits, B·N·T·S float32 values; on a
    GPU, dense up to 4 GiB of logits, so dense for all of these)."""
    q = jax.ShapeDtypeStruct((b, t, n, 8), jnp.float32)
    program = lambda implementation: str(jax.make_jaxpr(jax.grad(  # noqa: E731
        lambda q: jnp.sum(attnjax.dot_product_attention(q, q, q, is_causal=True,
                                                        implementation=implementation))))(q))
    other = {"dense": "chunked", "chunked": "dense"}[chosen]
    assert program(None) == program(chosen)
    assert program(None) != program(other)
    # (the programs traced as on a GPU: the dense kernel then runs the batch whole)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert program(None) == program("dense")


@pytest.mark.parametrize("b, t, n, causal, value", [
    (4, 256, 8, True, "dense"),       # 8 MiB of logits
    (8, 256, 8, True, "chunked"),     # 16 MiB under a mask
    (8, 256, 8, False, "dense"),      # 16 MiB, no mask
    (16, 256, 8, False, "chunked"),   # 32 MiB
    (256, 64, 8, True, "chunked"),    # 32 MiB of 64 × 64 heads: by the batch's logits
    (2048, 16, 8, True, "dense"),     # 16 MiB, but 16 queries: thin blocks
])
def test_implementation_none_runs_a_large_dense_call_s_value_alone_chunked(
        monkeypatch, b, t, n, causal, value):
    """On a CPU, where implementation=None runs dense, the value alone (no derivative
    taken) of a call of 64 queries or more whose logits pass AUTO_DENSE_BYTES under a
    mask, or twice that without one, runs on the chunked kernel (its block loops: a scan
    over while loops), 2-3x as fast; the derivatives stay dense's (no loop). The numbers
    are those of the two kernels, small sizes standing in for large ones."""
    q = jax.ShapeDtypeStruct((b, t, n, 8), jnp.float32)
    # a new function at each trace: jax reuses a function's trace from before a patch
    call = lambda: lambda q: attnjax.dot_product_attention(q, q, q, is_causal=causal)  # noqa: E731
    loops = lambda f: bool(re.search(r"\b(scan|while)\[", str(jax.make_jaxpr(f)(q))))  # noqa: E731
    assert loops(call()) == (value == "chunked")
    assert not loops(jax.grad(lambda q: jnp.sum(call()(q))))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not loops(call())

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(attention_module, "AUTO_DENSE_BYTES", 1)
    monkeypatch.setattr(attention_module, "VALUE_CHUNKED_MIN_T", 1)
    q, k, v, g = draws.normals(31, (2, 7, 4, 8), (2, 11, 2, 8), (2, 11, 2, 8), (2, 7, 4, 8))
    lengths = jnp.array([11, 5])

    def loss(implementation):
        return lambda q, k, v: jnp.sum(g * attnjax.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation=implementation))

    value, grads = jax.jit(jax.value_and_grad(loss(None), (0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(jax.jit(loss(None))(q, k, v), jax.jit(loss("chunked"))(q, k, v),
                               rtol=1e-6)
    np.testing.assert_allclose(value, jax.jit(loss("dense"))(q, k, v), rtol=1e-6)
    chex.assert_trees_all_close(grads, jax.jit(jax.grad(loss("dense"), (0, 1, 2)))(q, k, v),
                                rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("b, t, n, chosen", [
    (4, 2048, 16, "dense"),     # 1 GiB of logits
    (1, 8192, 16, "dense"),     # 4 GiB: dense
    (2, 8192, 16, "chunked"),   # 8 GiB: chunked
    (1, 32768, 8, "chunked"),   # 32 GiB
])
def test_implementation_none_on_a_gpu_runs_dense_up_to_4_gib_of_logits(monkeypatch, b, t, n,
                                                                      chosen):
    """On a GPU (or TPU) implementation=None runs dense whatever the grid while the
    batch's float32 logits fit AUTO_ACCELERATOR_DENSE_BYTES: chunked was 5.9x slower
    than dense on an H100 at (4, 2048, 16); on a CPU the same shapes all run chunked."""
    q = jax.ShapeDtypeStruct((b, t, n, 8), jnp.bfloat16)
    program = lambda implementation: str(jax.make_jaxpr(  # noqa: E731
        lambda q: attnjax.dot_product_attention(q, q, q, is_causal=True,
                                                implementation=implementation))(q))
    assert program(None) == program("chunked")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    other = {"dense": "chunked", "chunked": "dense"}[chosen]
    assert program(None) == program(chosen)
    assert program(None) != program(other)


class _Device:
    """A device that reports its memory limit (None: one that reports no statistics)."""

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}


@pytest.mark.parametrize("limit, b, t, n, chosen", [
    (11 * 2**30, 4, 1024, 16, "dense"),     # a 16 GB card's pool: 256 MiB of logits
    (11 * 2**30, 1, 4096, 16, "chunked"),   # 1 GiB, past 11/12 GiB: chunked
    (24 * 2**30, 1, 8192, 8, "dense"),      # a 32 GB card's: 2 GiB, its bound
    (24 * 2**30, 1, 8192, 16, "chunked"),   # 4 GiB
    (60 * 2**30, 1, 8192, 16, "dense"),     # an H100's: 4 GiB, the bound's most
    (104 * 2**30, 2, 8192, 16, "chunked"),  # an H200's: 8 GiB, past the 4 GiB
    (None, 1, 8192, 16, "dense"),           # no statistics: 4 GiB
])
def test_implementation_none_on_a_gpu_keeps_dense_to_a_twelfth_of_its_memory(
        monkeypatch, limit, b, t, n, chosen):
    """On a GPU or TPU that reports the memory jax may use, implementation=None runs
    dense only while the logits are at most a twelfth of it (and 4 GiB): dense's
    temporaries, 2.1-2.5x the logits, would not fit a small card at 4 GiB of logits."""
    q = jax.ShapeDtypeStruct((b, t, n, 8), jnp.bfloat16)
    program = lambda implementation: str(jax.make_jaxpr(  # noqa: E731
        lambda q: attnjax.dot_product_attention(q, q, q, is_causal=True,
                                                implementation=implementation))(q))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "local_devices", lambda *args, **kwargs: [_Device(limit)])
    expected = {name: program(name) for name in ("dense", "chunked")}
    other = {"dense": "chunked", "chunked": "dense"}[chosen]
    assert program(None) == expected[chosen] != expected[other]


@pytest.mark.parametrize("b, s, k, h, chosen", [
    (1, 16384, 8, 64, "chunked"),   # 32 MiB of keys, all one example's: chunked
    (8, 2048, 8, 64, "chunked"),    # 32 MiB, 4 MiB an example: chunked
    (1, 8192, 8, 64, "dense"),      # 16 MiB: dense
    (16, 1024, 8, 64, "dense"),     # 32 MiB of short caches, 2 MiB each: dense
    (64, 256, 8, 64, "dense"),      # 32 MiB, 0.5 MiB each: dense
])
def test_implementation_none_decodes_a_long_cache_chunked(monkeypatch, b, s, k, h, chosen):
    """A decoding step (one query) against a long cache runs chunked on a CPU: the dense
    kernel would copy all of k and v at every step (see AUTO_DECODE_KEY_BYTES); the
    same keys with two queries keep the grid rule, and a GPU runs any such step dense."""
    def program(implementation, t=1):
        q = jax.ShapeDtypeStruct((b, t, 2 * k, h), jnp.float32)
        kv = jax.ShapeDtypeStruct((b, s, k, h), jnp.float32)
        return str(jax.make_jaxpr(lambda q, kv: attnjax.dot_product_attention(
            q, kv, kv, is_causal=True, implementation=implementation))(q, kv))

    other = {"dense": "chunked", "chunked": "dense"}[chosen]
    assert program(None) == program(chosen)
    assert program(None) != program(other)
    assert program(None, t=2) == program("dense", t=2)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert program(None) == program("dense")


@pytest.mark.parametrize("keywords", ["key_lengths", "query_lengths_causal", "mask",
                                      "mask_lengths_window"])
def test_cudnn_rows_that_see_no_key_are_zeros(monkeypatch, rng, keywords):
    """implementation='cudnn' keeps attnjax's semantics for a row that sees no key: zeros
    and finite gradients, where cuDNN leaves values (up to 4.4 on an H100). Traced as on
    a GPU, with jax.nn's XLA path standing in for cuDNN: it too leaves values there (the
    mean of the values), so the rows are attnjax's own doing."""
    b, t, n, h = 3, 16, 2, 8
    generator = draws.host(rng)
    q, k, v = draws.normals(generator, *[(b, t, n, h)] * 3, dtype=jnp.bfloat16)
    key_lengths = jnp.asarray([t, 0, 5], jnp.int32)
    mask = draws.bernoulli(generator, 0.3, (b, n, t, t)).at[0, 1, 3].set(False)
    call = {
        "key_lengths": dict(key_lengths=key_lengths),
        "query_lengths_causal": dict(query_lengths=jnp.asarray([t, t, 9], jnp.int32),
                                     key_lengths=key_lengths, is_causal=True),
        "mask": dict(mask=mask),
        # row 15 of example 2 sees keys 12-15, all past its key length 5
        "mask_lengths_window": dict(mask=mask, key_lengths=key_lengths, window=(3, 0)),
    }[keywords]
    real = jax.nn.dot_product_attention

    def xla_for_cudnn(query, key, value, bias, mask, *, implementation, **kw):
        assert implementation == "cudnn" and bias is None
        # in float32 and standard promotion: jax.nn's XLA path mixes dtypes, which the
        # suite's strict promotion refuses
        f32 = [x.astype(jnp.float32) for x in (query, key, value)]
        with jax.numpy_dtype_promotion("standard"):
            return real(*f32, bias, mask, implementation="xla", **kw).astype(query.dtype)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.nn, "dot_product_attention", xla_for_cudnn)

    def loss(implementation, q, k, v):
        out = attnjax.dot_product_attention(q, k, v, implementation=implementation, **call)
        return jnp.sum(out.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(functools.partial(loss, "cudnn"), (0, 1, 2),
                                         has_aux=True)(q, k, v)
    dense = attnjax.dot_product_attention(q, k, v, implementation="dense", **call)
    empty = np.asarray(jnp.all(dense == 0, axis=-1))
    assert empty.any() and not empty.all()
    np.testing.assert_array_equal(np.asarray(out)[empty], 0)
    chex.assert_trees_all_close(out.astype(jnp.float32), dense.astype(jnp.float32),
                                atol=2e-2, rtol=2e-2)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
