"""Layer 4: pure multi-head attention, flax's parameter tree."""

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import attnjax
from tests import draws
from tests.trees import perturbed

B, T, S, D, DK, N, F = 2, 5, 7, 12, 10, 4, 9


def _inputs(rng, dtype=jnp.float32):
    return draws.normals(rng, (B, T, D), (B, S, DK), dtype=dtype)


def _random_params(rng, **kw):
    """Non-zero biases too, so a dropped bias cannot pass."""
    return perturbed(attnjax.init_multi_head_attention(rng, D, N, **kw),
                     jax.random.fold_in(rng, 1))


def test_param_tree_equals_flax(rng):
    x, y = _inputs(rng)
    flax_params = nn.MultiHeadDotProductAttention(
        num_heads=N, qkv_features=24, out_features=F).init(rng, x, y)["params"]
    ours = attnjax.init_multi_head_attention(
        rng, D, N, qkv_features=24, out_features=F, kv_features=DK)
    assert jax.tree.structure(ours) == jax.tree.structure(flax_params)
    chex.assert_trees_all_equal_shapes_and_dtypes(ours, flax_params)


def test_flax_params_give_flax_output(rng):
    generator = draws.host(rng)
    x, y = _inputs(generator)
    module = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=16, out_features=F)
    mask = draws.bernoulli(generator, 0.7, (B, 1, T, S), always=0)
    params = module.init(rng, x, y)["params"]
    params = jax.device_put(jax.tree.map(lambda p: np.asarray(p) + 0.1, params))  # non-zero biases
    with jax.numpy_dtype_promotion("standard"):
        expected = module.apply({"params": params}, x, y, mask=mask)
    np.testing.assert_allclose(
        attnjax.multi_head_attention(params, x, y, mask=mask), expected, rtol=1e-5, atol=1e-6)
    self_params = jax.device_put(jax.tree.map(lambda p: np.asarray(p) - 0.05,
                                              module.init(rng, x)["params"]))
    with jax.numpy_dtype_promotion("standard"):
        expected_self = module.apply({"params": self_params}, x)
    np.testing.assert_allclose(
        attnjax.multi_head_attention(self_params, x), expected_self, rtol=1e-5, atol=1e-6)


def test_naive_loop_over_heads_equals_fused(rng):
    """Concat(head_1..h) W^O with head_i = Attention(X W_i^Q, X W_i^K, X W_i^V)."""
    x, y = _inputs(rng)
    params = _random_params(rng, kv_features=DK, out_features=F, qkv_features=20)
    fused = attnjax.multi_head_attention(params, x, y, is_causal=False)
    p = jax.tree.map(np.asarray, params)
    x, y = np.asarray(x), np.asarray(y)
    for e in range(B):
        heads = []
        for i in range(N):
            q_i = x[e] @ p["query"]["kernel"][:, i, :] + p["query"]["bias"][i]
            k_i = y[e] @ p["key"]["kernel"][:, i, :] + p["key"]["bias"][i]
            v_i = y[e] @ p["value"]["kernel"][:, i, :] + p["value"]["bias"][i]
            heads.append(np.asarray(attnjax.attention(q_i, k_i, v_i)))
        w_o = p["out"]["kernel"].reshape(-1, F)  # [N·V, F]
        naive = np.concatenate(heads, axis=-1) @ w_o + p["out"]["bias"]
        np.testing.assert_allclose(fused[e], naive, rtol=1e-5, atol=1e-5)


def test_grouped_query_heads_share_key_value_projections(rng):
    x, y = _inputs(rng)
    params = _random_params(rng, num_kv_heads=2, kv_features=DK)
    chex.assert_shape(params["key"]["kernel"], (DK, 2, D // N))
    out = attnjax.multi_head_attention(params, x, y)
    # The same model with key/value heads repeated to N heads (head i uses kv head i // 2).
    full = jax.tree.map(lambda a: a, params)
    for name in ("key", "value"):
        full[name] = {
            "kernel": jnp.repeat(params[name]["kernel"], 2, axis=1),
            "bias": jnp.repeat(params[name]["bias"], 2, axis=0),
        }
    np.testing.assert_allclose(out, attnjax.multi_head_attention(full, x, y), rtol=1e-5, atol=1e-6)


class TestVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_shapes_and_dtypes(self):
        for dtype in (jnp.float32, jnp.bfloat16):
            x, y = _inputs(2, dtype)
            params = attnjax.init_multi_head_attention(
                jax.random.key(0), D, N, kv_features=DK, out_features=F)
            out, weights = self.variant(lambda p, x, y: attnjax.multi_head_attention(
                p, x, y, return_weights=True))(params, x, y)
            chex.assert_shape(out, (B, T, F))
            chex.assert_shape(weights, (B, N, T, S))
            chex.assert_type([out, weights], dtype)
            unbatched = self.variant(attnjax.multi_head_attention)(params, x[0], y[0])
            chex.assert_shape(unbatched, (T, F))


def test_gradients_float64_order_2(rng):
    x, y = draws.normals(rng, (B, 3, D), (B, 4, DK), dtype=jnp.float64)
    params = _random_params(rng, kv_features=DK, num_kv_heads=2, dtype=jnp.float64)
    fn = lambda p, x, y: attnjax.multi_head_attention(p, x, y, key_lengths=jnp.array([4, 2]))  # noqa: E731
    check_grads(jax.jit(fn), (params, x, y), order=2, modes=("rev",))


def test_kernel_gradients_read_each_input_transposed_once(rng):
    """On a CPU a kernel's gradient is the plain product xᵀ · g over one held copy of xᵀ:
    self-attention's query, key and value share the copy of x, the output projection
    has one of the heads, and no cotangent is copied transposed (before: one copy per
    projection's cotangent, four). Gradients, a forward-mode derivative and gradients
    through frozen kernels equal flax's module on the same parameters."""
    b, t = 4, 24  # B·T = 96 rows, no other axis of that size
    generator = draws.host(rng)
    x, target = draws.normals(generator, (b, t, D), (b, t, D))
    params = _random_params(jax.random.fold_in(rng, 3))
    module = nn.MultiHeadDotProductAttention(num_heads=N)

    def loss(params, x, ours=True):
        out = (attnjax.multi_head_attention(params, x, is_causal=True) if ours else
               module.apply({"params": params}, x, mask=nn.make_causal_mask(x[..., 0])))
        return jnp.sum((out - target) ** 2)

    grad = jax.grad(loss, (0, 1))
    program = jax.jit(grad).lower(params, x).compile().as_text()
    entry = program[program.index("ENTRY"):]
    transposed = re.findall(r"= f32\[\d+,96\]\{1,0\} ", entry)
    assert len(transposed) == 2, transposed
    # (the key bias's gradient is zero up to rounding: softmax ignores a shift of a row)
    chex.assert_trees_all_close(grad(params, x), grad(params, x, False), rtol=1e-5, atol=1e-4)
    tangents = jax.tree.map(lambda p: draws.normal(generator, p.shape, p.dtype), (params, x))
    chex.assert_trees_all_close(jax.jvp(loss, (params, x), tangents),
                                jax.jvp(lambda p, x: loss(p, x, False), (params, x), tangents),
                                rtol=1e-5, atol=1e-4)
    frozen = jax.grad(lambda x, ours: loss(jax.lax.stop_gradient(params), x, ours))
    chex.assert_trees_all_close(frozen(x, True), frozen(x, False), rtol=1e-5, atol=1e-5)


def test_half_precision_kernel_gradients_take_autodiff_s_form(rng):
    """In bfloat16 XLA's CPU products run faster in autodiff's own form: the projections
    and a widening Dense hold no copy of xᵀ behind a barrier (one layer's training step
    at (32, 64, 128, 4): 9.8 -> 6.1 ms). The gradients are flax's."""
    generator = draws.host(rng)
    x, target = draws.normals(generator, (4, 24, D), (4, 24, D))
    x = x.astype(jnp.bfloat16)
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16),
                          _random_params(jax.random.fold_in(rng, 3)))
    module = nn.MultiHeadDotProductAttention(num_heads=N)

    def loss(params, x, ours=True):
        out = (attnjax.multi_head_attention(params, x) if ours else
               module.apply({"params": params}, x))
        return jnp.sum((out.astype(jnp.float32) - target) ** 2)

    # a held xᵀ: [fan-in, B·T = 96 rows] behind a barrier
    held = lambda f, *a: re.findall(r"bf16\[\d+,96\] = optimization_barrier",  # noqa: E731
                                    str(jax.make_jaxpr(f)(*a)))
    grad = jax.grad(loss, (0, 1))
    assert held(grad, params, x) == []
    ffn = attnjax.nn.FeedForward(d_ff=48)
    ffn_params = ffn.init(jax.random.fold_in(rng, 4), x)
    assert held(jax.grad(lambda p: jnp.sum(ffn.apply(p, x).astype(jnp.float32))),
                ffn_params) == []
    # (the key bias's gradient is zero up to rounding, a bfloat16 rounding here)
    ours, theirs = (jax.tree.map(lambda g: g.astype(jnp.float32), grad(params, x, flag))
                    for flag in (True, False))
    for tree in (ours, theirs):
        del tree[0]["key"]["bias"]
    chex.assert_trees_all_close(ours, theirs, rtol=5e-2, atol=5e-1)


def test_dense_layers_kernel_gradient_copies_the_narrower_side(rng):
    """`multi_head.dot_general` in a Dense that widens (the feed-forward's first layer,
    12 -> 48) gives its kernel gradient as xᵀ · g over a copy of x, `[12, rows]`, not of
    its cotangent `[48, rows]`; the narrowing layer keeps autodiff's form, which copies
    its narrower cotangent. Gradients and a forward-mode derivative equal plain
    lax.dot_general's; any other product is lax.dot_general's."""
    generator = draws.host(rng)
    x = draws.normal(generator, (4, 24, 12))  # 96 rows
    ffn = attnjax.nn.FeedForward(d_ff=48)
    params = perturbed(ffn.init(jax.random.fold_in(rng, 1), x), jax.random.fold_in(rng, 2))

    def loss(params, x, plain=False):
        if plain:
            p = params["params"]
            hidden = jax.nn.relu(x @ p["wi"]["kernel"] + p["wi"]["bias"][None, None])
            out = hidden @ p["wo"]["kernel"] + p["wo"]["bias"][None, None]
        else:
            out = ffn.apply(params, x)
        return jnp.sum(jnp.sin(out))

    grad = jax.grad(loss, (0, 1))
    program = jax.jit(grad).lower(params, x).compile().as_text()
    entry = program[program.index("ENTRY"):]
    assert not re.findall(r"= f32\[48,96\]\{1,0\} ", entry)
    assert re.findall(r"= f32\[12,96\]\{1,0\} ", entry)
    chex.assert_trees_all_close(grad(params, x), grad(params, x, True), rtol=1e-5, atol=1e-5)
    tangents = jax.tree.map(lambda p: draws.normal(generator, p.shape, p.dtype), (params, x))
    chex.assert_trees_all_close(jax.jvp(loss, (params, x), tangents),
                                jax.jvp(lambda p, x: loss(p, x, True), (params, x), tangents),
                                rtol=1e-5, atol=1e-5)
    a, b = draws.normals(generator, (3, 4, 5), (3, 4, 5))
    batched = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(attnjax.multi_head.dot_general(a, b.swapaxes(1, 2), batched),
                                  jax.lax.dot_general(a, b.swapaxes(1, 2), batched))
