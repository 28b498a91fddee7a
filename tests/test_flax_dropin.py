"""attnjax.nn.MultiHeadDotProductAttention as a drop-in for flax.linen's: flax code that
swaps the class runs unchanged, on the same checkpoints, with the same results.

flax itself runs as its users run it (`as_users_run`: float32, standard promotion); the
attnjax module runs under the suite's strict promotion unless it calls into flax (its
LayerNorms, an attention_fn)."""

import contextlib
import subprocess
import sys
import warnings

import chex
import flax.linen as flax_nn
from flax import errors as flax_errors
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import attnjax
from attnjax import nn
from tests.checks import own_checks_only
from tests.numerics import as_users_run

# distinct sizes: two leading batch axes, T queries, S keys, N heads of H = 24 / N
B1, B2, T, S, D, DK, N, QKV, F = 2, 3, 5, 7, 12, 10, 4, 24, 9


def _host(rng) -> np.random.Generator:
    """A host generator seeded by a jax key: fresh data without compiling a sampler per
    shape."""
    return np.random.default_rng(np.asarray(jax.random.key_data(rng)).tolist())


def _x(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(_host(rng).standard_normal(shape), dtype)


def _perturbed(params, rng, scale=0.1):
    """Non-zero biases and non-default kernels, so nothing passes by being zero."""
    noise = _host(rng)
    return jax.tree.map(
        lambda x: x + jnp.asarray(scale * noise.standard_normal(x.shape), x.dtype), params)


def _pair(**fields):
    """flax's module and attnjax's, with the same fields."""
    return (flax_nn.MultiHeadDotProductAttention(**fields),
            nn.MultiHeadDotProductAttention(**fields))


def _jit(fn, *args, **kwargs):
    """fn(*args, **kwargs) under jit: one compilation, not one per operation. Keywords
    that are not arrays (mutable=, sow_weights=) stay static."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    return jax.jit(lambda args, arrays: fn(*args, **arrays, **static))(args, arrays)


def _flax_apply(module, variables, *args, **kwargs):
    with as_users_run():
        return _jit(module.apply, variables, *args, **kwargs)


def _flax_init(module, rng, *args, **kwargs):
    with as_users_run():
        return _jit(module.init, rng, *args, **kwargs)


def _causal_mask(x):
    with as_users_run():
        return flax_nn.make_causal_mask(x)


def _attention_mask(query_input, key_input):
    with as_users_run():
        return flax_nn.make_attention_mask(query_input, key_input)


def _tokens(rng, shape, vocab=11):
    """Token ids padded (0) after a random length of at least 1, the first example's two
    short, so every query sees at least one key under causal and padding masks."""
    host = _host(rng)
    tokens = host.integers(1, vocab, shape)
    lengths = host.integers(1, shape[-1] + 1, shape[:-1])
    lengths.flat[0] = shape[-1] - 2
    tokens[np.arange(shape[-1]) >= lengths[..., None]] = 0
    return jnp.asarray(tokens, jnp.int32)


# --- the swap inside a parent module: names, parameters, checkpoints ------------------


class _EncoderBlock(flax_nn.Module):
    """An ordinary flax encoder block; `attention` is the class it is built with."""

    attention: type

    @flax_nn.compact
    def __call__(self, x, tokens):
        # float32 0/1 masks from flax's helpers, [b1, b2, 1, T, T]
        mask = flax_nn.combine_masks(
            flax_nn.make_causal_mask(tokens),
            flax_nn.make_attention_mask(jnp.ones_like(tokens), tokens > 0))
        h = self.attention(num_heads=N, qkv_features=QKV, dropout_rate=0.1,
                           deterministic=True)(flax_nn.LayerNorm()(x), mask=mask,
                                               sow_weights=True)
        x = x + h
        h = flax_nn.Dense(16)(flax_nn.LayerNorm()(x))
        return x + flax_nn.Dense(D)(flax_nn.gelu(h))


def test_a_flax_encoder_block_runs_unchanged_with_the_class_swapped(rng):
    """Leading batch axes, nn.make_causal_mask / make_attention_mask float masks and
    sow_weights, in a parent whose attention is auto-named: a checkpoint made with
    flax's class loads into the parent built with attnjax's, with equal outputs and
    equal sown weights."""
    x = _x(jax.random.fold_in(rng, 1), B1, B2, T, D)
    tokens = _tokens(jax.random.fold_in(rng, 2), (B1, B2, T))
    flax_block, our_block = _EncoderBlock(flax_nn.MultiHeadDotProductAttention), _EncoderBlock(
        nn.MultiHeadDotProductAttention)
    checkpoint = {"params": _perturbed(_flax_init(flax_block, rng, x, tokens)["params"], rng)}
    assert "MultiHeadDotProductAttention_0" in checkpoint["params"]
    expected, flax_state = _flax_apply(flax_block, checkpoint, x, tokens,
                                       mutable=["intermediates"])
    with jax.numpy_dtype_promotion("standard"):   # the block's own flax layers
        got, state = _jit(our_block.apply, checkpoint, x, tokens, mutable=["intermediates"])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(state, flax_state, rtol=1e-5, atol=1e-6)
    weights, = state["intermediates"]["MultiHeadDotProductAttention_0"]["attention_weights"]
    chex.assert_shape(weights, (B1, B2, N, T, T))


@pytest.mark.parametrize("name", ["MultiHeadDotProductAttention", "MultiHeadAttention"])
def test_auto_names_and_initial_parameters_are_flax_s(rng, name):
    """Each flax class swaps for its namesake: the same auto-name in a parent, and
    init gives the same tree with the same values (initialisers, out_* initialisers
    and flattened bias initialisation included)."""
    fields = dict(num_heads=N, qkv_features=QKV, out_features=F,
                  bias_init=flax_nn.initializers.normal(0.2),
                  out_kernel_init=flax_nn.initializers.normal(0.3),
                  out_bias_init=flax_nn.initializers.constant(0.25))

    class Parent(flax_nn.Module):
        attention: type

        @flax_nn.compact
        def __call__(self, x, y):
            return self.attention(**fields)(x, y)

    x, y = _x(jax.random.fold_in(rng, 1), B1, T, D), _x(jax.random.fold_in(rng, 2), B1, S, DK)
    expected = _flax_init(Parent(getattr(flax_nn, name)), rng, x, y)
    got = _jit(Parent(getattr(nn, name)).init, rng, x, y)
    assert list(got["params"]) == [f"{name}_0"]
    chex.assert_trees_all_equal(got, expected)
    out = got["params"][f"{name}_0"]["out"]
    np.testing.assert_array_equal(out["bias"], np.full((F,), 0.25, np.float32))
    assert issubclass(getattr(nn, name), nn.MultiHeadDotProductAttention)


def test_self_attention_is_flax_s_deprecated_class(rng):
    """flax's SelfAttention swaps for attnjax's: the same auto-name and parameters, a
    mask given second as flax takes it, flax's DeprecationWarning, flax's outputs."""
    fields = dict(num_heads=N, qkv_features=QKV, out_features=F)

    class Parent(flax_nn.Module):
        attention: type

        @flax_nn.compact
        def __call__(self, x, mask):
            return self.attention(**fields)(x, mask)

    x = _x(jax.random.fold_in(rng, 1), B1, T, D)
    mask = jax.random.bernoulli(jax.random.fold_in(rng, 2), 0.7, (B1, 1, T, T))
    with pytest.warns(DeprecationWarning, match="SelfAttention will be deprecated"):
        expected = _flax_init(Parent(flax_nn.SelfAttention), rng, x, mask)
    with pytest.warns(DeprecationWarning, match="SelfAttention will be deprecated"):
        got = _jit(Parent(nn.SelfAttention).init, rng, x, mask)
    assert list(got["params"]) == ["SelfAttention_0"]
    chex.assert_trees_all_equal(got, expected)
    params = {"params": _perturbed(got["params"], rng)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        np.testing.assert_allclose(_jit(Parent(nn.SelfAttention).apply, params, x, mask),
                                   _flax_apply(Parent(flax_nn.SelfAttention), params, x, mask),
                                   rtol=1e-5, atol=1e-6)


def test_boxed_initialisers_keep_their_partitioning_as_in_flax(rng):
    x = _x(rng, B1, T, D)
    partitioned = flax_nn.with_partitioning(flax_nn.initializers.lecun_normal(),
                                            (None, "heads", None))
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, kernel_init=partitioned)
    expected = _flax_init(theirs, rng, x)
    got = _jit(ours.init, rng, x)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    chex.assert_trees_all_equal(got, expected)
    np.testing.assert_allclose(_jit(ours.apply, got, x), _flax_apply(theirs, expected, x),
                               rtol=1e-5, atol=1e-6)


def test_import_attnjax_makes_nn_available_without_importing_flax_eagerly():
    code = ("import sys, attnjax; eager = 'flax' in sys.modules; "
            "cls = attnjax.nn.MultiHeadDotProductAttention; print(eager, cls.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "MultiHeadDotProductAttention"]


# --- masks -----------------------------------------------------------------------------


def test_float_and_int_masks_mean_nonzero_attends_as_in_flax(rng):
    x, y = _x(jax.random.fold_in(rng, 1), B1, T, D), _x(jax.random.fold_in(rng, 2), B1, S, DK)
    q_tokens = _tokens(jax.random.fold_in(rng, 3), (B1, T))
    k_tokens = _tokens(jax.random.fold_in(rng, 4), (B1, S))
    # [B, 1, T, S] float32 0/1, flax's default dtype
    float_mask = _attention_mask(jnp.ones_like(q_tokens), k_tokens > 0)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV)
    params = _perturbed(_flax_init(theirs, rng, x, y)["params"], rng)
    expected = _flax_apply(theirs, {"params": params}, x, y, mask=float_mask)
    for mask in (float_mask, float_mask.astype(jnp.int32), 3.0 * float_mask,
                 float_mask.astype(bool)):
        got = _jit(ours.apply, {"params": params}, x, y, mask=mask)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    unmasked = _jit(ours.apply, {"params": params}, x, y)
    assert not np.allclose(unmasked, expected, atol=1e-3)


def test_causal_mask_from_flax_equals_is_causal(rng):
    x = _x(rng, B1, T, D)
    module = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV)
    params = _perturbed(_jit(module.init, rng, x)["params"], rng)
    by_flax_mask = _jit(module.apply, {"params": params}, x,
                                mask=_causal_mask(jnp.ones((B1, T), jnp.int32)))
    by_field = _jit(module.clone(is_causal=True).apply, {"params": params}, x)
    np.testing.assert_allclose(by_flax_mask, by_field, rtol=1e-6)


def test_functional_float_mask_error_points_at_the_right_fix():
    """attnjax's own message, as a user without runtime type checks sees it."""
    with own_checks_only():
        _functional_float_mask()


def _functional_float_mask():
    q = _x(jax.random.key(0), B1, T, N, 6)
    k = _x(jax.random.key(1), B1, S, N, 6)
    mask = _attention_mask(jnp.ones((B1, T), jnp.float32), jnp.ones((B1, S), jnp.float32))
    with pytest.raises(TypeError, match=r"mask must be boolean.*float32.*mask != 0.*bias="):
        attnjax.dot_product_attention(q, k, k, mask=mask)


# --- inputs ------------------------------------------------------------------------------


def test_leading_batch_axes_cross_attention_and_broadcast_mask_equal_flax(rng):
    x = _x(jax.random.fold_in(rng, 1), B1, B2, T, D)
    y = _x(jax.random.fold_in(rng, 2), B1, B2, S, DK)
    v = _x(jax.random.fold_in(rng, 3), B1, B2, S, D + 1)
    # broadcast over the second batch axis and the heads, [B1, 1, 1, T, S]
    mask = _host(jax.random.fold_in(rng, 4)).random((B1, 1, 1, T, S)) < 0.6
    mask[..., 0] = True
    mask = jnp.asarray(mask, jnp.float32)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, out_features=F)
    params = _perturbed(_flax_init(theirs, rng, x, y, v)["params"], rng)
    expected = _flax_apply(theirs, {"params": params}, x, y, v, mask=mask)
    got = _jit(ours.apply, {"params": params}, x, y, v, mask=mask)
    chex.assert_shape(got, (B1, B2, T, F))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # and each example alone, as a [B, T, D] batch
    flat = _jit(ours.apply, {"params": params}, x[1], y[1], v[1], mask=mask[1])
    np.testing.assert_allclose(got[1], flat, rtol=1e-5, atol=1e-6)


def test_unbatched_inputs_equal_flax(rng):
    x, y = _x(jax.random.fold_in(rng, 1), T, D), _x(jax.random.fold_in(rng, 2), S, DK)
    mask = _attention_mask(jnp.ones((T,), jnp.int32), jnp.arange(S) < S - 2)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV)
    params = _perturbed(_flax_init(theirs, rng, x, y)["params"], rng)
    np.testing.assert_allclose(_jit(ours.apply, {"params": params}, x, y, mask=mask),
                               _flax_apply(theirs, {"params": params}, x, y, mask=mask),
                               rtol=1e-5, atol=1e-6)


def test_inputs_kv_is_deprecated_as_in_flax_and_means_keys_and_values(rng):
    x, y = _x(jax.random.fold_in(rng, 1), B1, T, D), _x(jax.random.fold_in(rng, 2), B1, S, DK)
    module = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV)
    params = _jit(module.init, rng, x, y)["params"]
    with pytest.warns(DeprecationWarning, match="inputs_kv"):
        got = _jit(module.apply, {"params": params}, x, inputs_kv=y)
    np.testing.assert_allclose(got, _jit(module.apply, {"params": params}, x, y, y), rtol=1e-6)
    with pytest.raises(ValueError, match="If either `inputs_k` or `inputs_v` is not None, `inputs_kv` must be None"):
        _jit(module.apply, {"params": params}, x, y, inputs_kv=y)


def test_inputs_v_without_inputs_k_is_flax_s_error(rng):
    x, y = _x(jax.random.fold_in(rng, 1), B1, T, D), _x(jax.random.fold_in(rng, 2), B1, S, D)
    module = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV)
    params = _jit(module.init, rng, x, y)["params"]
    with pytest.raises(ValueError, match="`inputs_k` cannot be None if `inputs_v` is not None"):
        _jit(module.apply, {"params": params}, x, inputs_v=y)
    # flax's warning for a square inputs_v that was probably meant as the mask
    square = _x(rng, B1, S, S)
    with pytest.warns(DeprecationWarning, match="may have intended to pass it to the `mask`"):
        nn.MultiHeadDotProductAttention(num_heads=1).init(rng, square, square, square)


def test_a_mask_passed_as_inputs_v_fails_as_in_flax(rng):
    """flax's positional mask (before flax 0.7.4) lands in inputs_v: flax's warning,
    then flax's error for the value projection's parameter shape, which is also a
    ValueError naming inputs_v."""
    x = _x(rng, 1, S, 1)
    module = nn.MultiHeadDotProductAttention(num_heads=1, kernel_init=jax.nn.initializers.ones)
    variables = module.init(rng, x, x)
    mask = flax_nn.make_causal_mask(jnp.ones((1, S)))
    with pytest.warns(DeprecationWarning, match="the function signature of "
                      "MultiHeadDotProductAttention's `__call__` method has changed"):
        with pytest.raises(flax_errors.ScopeParamShapeError, match="inputs_v has 7 features"):
            module.apply(variables, x, x, mask)


def test_dtype_none_promotes_inputs_and_parameters_as_flax(rng):
    x = _x(rng, B1, T, D, dtype=jnp.bfloat16)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV)
    variables = _flax_init(theirs, rng, x)
    expected = _flax_apply(theirs, variables, x)
    got = _jit(ours.apply, variables, x)
    assert got.dtype == expected.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # with the parameters it holds, not the param_dtype it declares: bfloat16 parameters
    # loaded into a module of float32 param_dtype compute in bfloat16 (they had computed,
    # returned and sown float32)
    half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _perturbed(variables, rng))
    expected, theirs_sown = _flax_apply(theirs, half, x, sow_weights=True,
                                        mutable=["intermediates"])
    got, ours_sown = _jit(ours.apply, half, x, sow_weights=True, mutable=["intermediates"])
    assert got.dtype == expected.dtype == jnp.bfloat16
    assert jax.tree.map(lambda w: w.dtype, ours_sown) == jax.tree.map(lambda w: w.dtype,
                                                                      theirs_sown)
    np.testing.assert_allclose(got.astype(jnp.float32), expected.astype(jnp.float32),
                               atol=0.05)


# --- fields --------------------------------------------------------------------------------


def test_sow_weights_fills_flax_s_intermediates_entry(rng):
    x = _x(jax.random.fold_in(rng, 1), B1, B2, T, D)
    mask = _causal_mask(jnp.ones((B1, B2, T), jnp.int32))
    theirs, ours = _pair(num_heads=N, qkv_features=QKV)
    params = _perturbed(_flax_init(theirs, rng, x)["params"], rng)
    _, expected = _flax_apply(theirs, {"params": params}, x, mask=mask, sow_weights=True,
                              mutable=["intermediates"])
    _, got = _jit(ours.apply, {"params": params}, x, mask=mask, sow_weights=True,
                        mutable=["intermediates"])
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
    _, nothing = _jit(ours.apply, {"params": params}, x, mask=mask, mutable=["intermediates"])
    assert nothing == {}


def test_normalize_qk_has_flax_s_layer_norms(rng):
    x, y = _x(jax.random.fold_in(rng, 1), B1, T, D), _x(jax.random.fold_in(rng, 2), B1, S, DK)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, normalize_qk=True)
    expected_init = _flax_init(theirs, rng, x, y)
    with jax.numpy_dtype_promotion("standard"):   # flax's LayerNorm inside
        got_init = _jit(ours.init, rng, x, y)
    chex.assert_trees_all_equal(got_init, expected_init)
    assert set(got_init["params"]["query_ln"]) == {"scale"}   # use_bias=False
    params = _perturbed(expected_init["params"], rng)
    with jax.numpy_dtype_promotion("standard"):
        got = _jit(ours.apply, {"params": params}, x, y)
    np.testing.assert_allclose(got, _flax_apply(theirs, {"params": params}, x, y),
                               rtol=1e-5, atol=1e-6)
    plain = _jit(nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV).apply,
                 {"params": {k: p for k, p in params.items() if not k.endswith("_ln")}}, x, y)
    assert not np.allclose(got, plain, atol=1e-3)


def _scaled_dot_general(lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None):
    return 1.5 * lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                 preferred_element_type=preferred_element_type)


@pytest.mark.parametrize("field, value", [
    ("qkv_dot_general", _scaled_dot_general),
    ("out_dot_general", _scaled_dot_general),
    ("qkv_dot_general_cls", lambda: _scaled_dot_general),
    ("out_dot_general_cls", lambda: _scaled_dot_general),
])
def test_dot_generals_reach_the_projections_as_in_flax(rng, field, value):
    x = _x(rng, B1, T, D)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, **{field: value})
    params = _perturbed(_flax_init(theirs, rng, x)["params"], rng)
    got = _jit(ours.apply, {"params": params}, x)
    np.testing.assert_allclose(got, _flax_apply(theirs, {"params": params}, x),
                               rtol=1e-5, atol=1e-6)
    plain = _jit(ours.clone(**{field: None}).apply, {"params": params}, x)
    assert not np.allclose(got, plain, atol=1e-3)


def _half_einsum(spec, *operands, **kwargs):
    return 0.5 * jnp.einsum(spec, *operands, **kwargs)


def test_einsum_classes_run_in_flax_s_attention(rng):
    x = _x(rng, B1, T, D)
    fields = dict(num_heads=N, qkv_features=QKV, qk_attn_weights_einsum_cls=lambda: _half_einsum,
                  attn_weights_value_einsum_cls=lambda: _half_einsum)
    theirs, ours = _pair(**fields)
    params = _perturbed(_flax_init(theirs, rng, x)["params"], rng)
    mask = _causal_mask(jnp.ones((B1, T), jnp.int32))
    with as_users_run():
        got = _jit(ours.apply, {"params": params}, x, mask=mask)
    np.testing.assert_allclose(got, _flax_apply(theirs, {"params": params}, x, mask=mask),
                               rtol=1e-5, atol=1e-6)
    plain = _jit(nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV).apply,
                 {"params": params}, x, mask=mask)
    assert not np.allclose(got, plain, atol=1e-3)


def test_precision_reaches_every_product(rng):
    x = _x(rng, B1, T, D)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, precision=lax.Precision.HIGHEST)
    params = _perturbed(_flax_init(theirs, rng, x)["params"], rng)
    np.testing.assert_allclose(_jit(ours.apply, {"params": params}, x),
                               _flax_apply(theirs, {"params": params}, x), rtol=1e-5, atol=1e-6)
    # every spelling lax.dot_general takes: lax.Precision's aliases, presets, pairs
    for precision, expected in ((lax.Precision.HIGHEST, "precision = [HIGHEST, HIGHEST]"),
                                ("highest", "precision = [HIGHEST, HIGHEST]"),
                                ("float32", "precision = [HIGHEST, HIGHEST]"),
                                (("tensorfloat32", "high"), "precision = [HIGH, HIGH]"),
                                ("fastest", None), (("fastest", "bfloat16"), None),
                                (lax.DotAlgorithmPreset.DEFAULT, None), (None, None)):
        module = ours.clone(precision=precision)
        hlo = jax.jit(lambda p: module.apply({"params": p}, x, mask=jnp.ones((T, T), bool))
                      ).lower(params).as_text()
        dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
        assert len(dots) >= 6   # four projections, the logits and the weighted values
        assert all((expected in line) if expected else ("precision" not in line
                                                        or "DEFAULT" in line) for line in dots)


def test_attention_fn_is_called_with_flax_s_keywords_filtered_by_its_signature(rng):
    x = _x(rng, B1, T, D)
    mask = _causal_mask(jnp.ones((B1, T), jnp.int32))
    seen = []

    def mask_only(query, key, value, mask=None):
        seen.append(mask)
        return flax_nn.dot_product_attention(query, key, value, mask=mask)

    theirs, ours = _pair(num_heads=N, qkv_features=QKV, attention_fn=mask_only)
    params = _perturbed(_flax_init(theirs, rng, x)["params"], rng)
    expected = _flax_apply(theirs, {"params": params}, x, mask=mask)
    with as_users_run():
        got = _jit(ours.apply, {"params": params}, x, mask=mask)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert (seen[-1].dtype, seen[-1].shape) == (mask.dtype, mask.shape)   # as given
    # flax's own function takes every keyword, and module=self to sow the weights
    theirs, ours = _pair(num_heads=N, qkv_features=QKV,
                         attention_fn=flax_nn.dot_product_attention)
    _, expected = _flax_apply(theirs, {"params": params}, x, mask=mask, sow_weights=True,
                              mutable=["intermediates"])
    with as_users_run():
        _, got = _jit(ours.apply, {"params": params}, x, mask=mask, sow_weights=True,
                            mutable=["intermediates"])
    chex.assert_trees_all_close(got, expected, rtol=1e-6)
    assert nn.MultiHeadDotProductAttention(num_heads=N).attention_fn is None


@pytest.mark.parametrize("force_fp32", [True, False])
def test_force_fp32_for_softmax_sows_weights_in_flax_s_dtype(rng, force_fp32):
    x = _x(rng, B1, T, D)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, dtype=jnp.bfloat16,
                         force_fp32_for_softmax=force_fp32)
    params = _perturbed(_flax_init(theirs, rng, x)["params"], rng)
    _, expected = _flax_apply(theirs, {"params": params}, x, sow_weights=True,
                              mutable=["intermediates"])
    _, got = _jit(ours.apply, {"params": params}, x, sow_weights=True,
                  mutable=["intermediates"])
    expected, got = (v["intermediates"]["attention_weights"][0] for v in (expected, got))
    assert got.dtype == expected.dtype == (jnp.float32 if force_fp32 else jnp.bfloat16)
    np.testing.assert_allclose(got.astype(jnp.float32), expected.astype(jnp.float32),
                               atol=2e-2)


def test_complex_inputs_run_in_flax_s_attention(rng):
    """attnjax's kernels are real: complex inputs (which flax takes) run flax's own
    attention, with flax's numbers; with an attnjax field they are an error."""
    x = lax.complex(_x(jax.random.fold_in(rng, 1), B1, T, D),
                    _x(jax.random.fold_in(rng, 2), B1, T, D))
    theirs, ours = _pair(num_heads=N, qkv_features=QKV)
    params = _perturbed(_flax_init(theirs, rng, x)["params"], rng)
    expected = _flax_apply(theirs, {"params": params}, x)
    got = _jit(ours.apply, {"params": params}, x)
    assert got.dtype == expected.dtype == jnp.complex64
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    causal = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV, is_causal=True)
    with pytest.raises(ValueError, match=r"complex inputs \(complex64\) run in flax's "
                                         r"attention instead of attnjax's engine.*is_causal"):
        causal.apply({"params": params}, x)


def test_force_fp32_for_softmax_is_accepted(rng):
    x = _x(rng, B1, T, D)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, dtype=jnp.bfloat16,
                         force_fp32_for_softmax=True)
    params = _perturbed(_flax_init(theirs, rng, x)["params"], rng)
    got = _jit(ours.apply, {"params": params}, x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32),
                               _flax_apply(theirs, {"params": params}, x).astype(jnp.float32),
                               rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_force_fp32_for_softmax_without_a_dtype_returns_flax_s_float32(rng, dtype):
    """dtype=None, inputs and parameters in half precision: flax's float32 weights
    promote its weighted sum and its out projection, so it returns float32 (attnjax
    had returned the half dtype)."""
    x = _x(rng, B1, T, D, dtype=dtype)
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, param_dtype=dtype,
                         force_fp32_for_softmax=True)
    params = _perturbed(_flax_init(theirs, rng, x)["params"], rng)
    expected = _flax_apply(theirs, {"params": params}, x)
    got = _jit(ours.apply, {"params": params}, x)
    assert got.dtype == expected.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=5e-2, atol=5e-2)


# --- decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [(), (B1, B2)], ids=["unbatched", "two_batch_axes"])
@pytest.mark.parametrize("attention_fn", [None, flax_nn.dot_product_attention],
                         ids=["engine", "attention_fn"])
def test_one_token_decode_equals_flax_s_cache_step_by_step(rng, batch, attention_fn):
    length = 6
    x = _x(rng, *batch, length, D)
    theirs = flax_nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV, decode=True)
    ours = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV, decode=True,
                                           attention_fn=attention_fn)
    flax_variables = _flax_init(theirs, rng, x)
    params = _perturbed(flax_variables["params"], rng)
    flax_cache, cache = flax_variables["cache"], _jit(ours.init, rng, x)["cache"]
    chex.assert_trees_all_equal_shapes_and_dtypes(cache, flax_cache)
    assert set(cache) == {"cached_key", "cached_value", "cache_index"}
    flax_step, step = (jax.jit(lambda cache, token, module=module: module.apply(
        {"params": params, "cache": cache}, token, mutable=["cache"])) for module in (theirs, ours))
    # flax's attention_fn runs as flax's users run it
    context = as_users_run if attention_fn is not None else contextlib.nullcontext
    for i in range(length):
        token = x[..., i:i + 1, :]
        with as_users_run():
            expected, flax_state = flax_step(flax_cache, token)
        with context():
            got, state = step(cache, token)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(state["cache"], flax_state["cache"], rtol=1e-6)
        flax_cache, cache = flax_state["cache"], state["cache"]
    assert int(cache["cache_index"]) == length


# --- no inf, no NaN ------------------------------------------------------------------------


def test_masked_module_calls_run_under_debug_infs_and_nans(rng):
    """A float mask over two batch axes, with a query row that sees no key, forward
    and backward; nothing inside attnjax makes an inf or a NaN."""
    x = _x(rng, B1, B2, T, D)
    # [B1, B2, 1, T, T]: causal, and the last query of one example sees nothing
    mask = _causal_mask(jnp.ones((B1, B2, T), jnp.int32))
    mask = mask.at[0, 1, 0, T - 1].set(0.0)
    module = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV, is_causal=True)
    params = _jit(module.init, rng, x)["params"]

    def loss(params):
        out, state = _jit(module.apply, {"params": params}, x, mask=mask, sow_weights=True,
                                  mutable=["intermediates"])
        return jnp.sum(out ** 2), (out, state)

    with jax.debug_infs(True), jax.debug_nans(True):
        grads, (out, state) = jax.grad(loss, has_aux=True)(params)
    chex.assert_tree_all_finite((grads, out, state))
    weights, = state["intermediates"]["attention_weights"]
    np.testing.assert_array_equal(weights[0, 1, :, T - 1], 0.0)


# --- named errors --------------------------------------------------------------------------


def _init_on_two_batch_axes(module, *args, **kwargs):
    x = _x(jax.random.key(0), B1, B2, T, D)
    return _jit(module.init, jax.random.key(1), x, *args, **kwargs)


@pytest.mark.parametrize("call, error, message", [
    (lambda: _init_on_two_batch_axes(nn.MultiHeadDotProductAttention(num_heads=N, is_causal=True,
                                                    attention_fn=flax_nn.dot_product_attention)),
     ValueError, r"flax's attention signature.*got is_causal=True"),
    (lambda: _init_on_two_batch_axes(nn.MultiHeadDotProductAttention(num_heads=N,
                                                    attention_fn=flax_nn.dot_product_attention),
                    key_lengths=jnp.ones((B1 * B2,), jnp.int32)),
     ValueError, r"flax's attention signature.*got key_lengths="),
    (lambda: _init_on_two_batch_axes(nn.MultiHeadDotProductAttention(num_heads=N),
                    mask=jnp.ones((B2, B1, 1, T, T), jnp.float32)),
     ValueError, r"mask must be broadcastable to \[batch..., N, T, S\] with batch axes "
                 r"\[2, 3\]; got \[3, 2, 1, 5, 5\]"),
    # more batch axes than the inputs': flax broadcasts its output to them
    (lambda: _init_on_two_batch_axes(nn.MultiHeadDotProductAttention(num_heads=N),
                    mask=jnp.ones((4, B1, B2, 1, T, T), bool)),
     ValueError, r"mask must be broadcastable to \[batch..., N, T, S\] with batch axes "
                 r"\[2, 3\]; got \[4, 2, 3, 1, 5, 5\]"),
    (lambda: _init_on_two_batch_axes(nn.MultiHeadDotProductAttention(
        num_heads=N, precision=(lax.Precision.HIGHEST, lax.Precision.DEFAULT))),
     ValueError, r"precision as a pair must name one precision twice.*HIGHEST.*DEFAULT"),
    (lambda: nn.MultiHeadDotProductAttention(num_heads=N).init(
        jax.random.key(0), _x(jax.random.key(0), T, D), _x(jax.random.key(0), B1, S, D)),
     ValueError, r"must share the batch axes.*got \[5, 12\], \[2, 7, 12\]"),
])
def test_mistakes_are_named_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_dropout_rate_one_runs_deterministic_as_in_flax_and_is_refused_dropping(rng):
    """flax's module takes dropout_rate=1.0 and drops nothing when deterministic; dropping
    every weight (flax: 0/0, NaN) is a named error."""
    fields = dict(num_heads=N, qkv_features=QKV, dropout_rate=1.0)
    flax_mha, ours = _pair(**fields)
    x, y = _x(rng, B1, T, D), _x(jax.random.fold_in(rng, 1), B1, S, D)
    with as_users_run():
        variables = _perturbed(flax_mha.init(jax.random.key(1), x, y, deterministic=True), rng)
        expected = flax_mha.apply(variables, x, y, deterministic=True)
    got = _jit(ours.apply, variables, x, y, deterministic=True)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"dropout_rate=1.0 drops every attention weight.*"
                                         r"deterministic=True"):
        ours.apply(variables, x, y, deterministic=False, rngs={"dropout": rng})
    with pytest.raises(ValueError, match=r"dropout_rate must lie in \[0, 1\]; got 1.5"):
        ours.clone(dropout_rate=1.5).apply(variables, x, y, deterministic=True)


def test_decoding_another_batch_than_the_cache_is_a_named_error(rng):
    module = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=QKV, decode=True)
    variables = _jit(module.init, rng, _x(rng, B1, B2, T, D))
    message = (r"decode=True: new keys must have the cache's batch axes and heads.*"
               r"\[2, 3\] T \[4, 6\]; got \[3, 1, 4, 6\]")
    with pytest.raises(ValueError, match=message):
        _jit(module.apply, variables, _x(rng, B2, 1, D), mutable=["cache"])

