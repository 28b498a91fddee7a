"""The engine through the layers above it: the KV cache by positions and a filled
length, the pure and Flax multi-head attention passing masks, positions, score_mods and
sinks through, and chunked single-token steps."""

import dataclasses
import functools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax import masks, nn, scores
from tests import draws
from tests.trees import perturbed as _perturbed

B, D, N, K = 2, 12, 4, 2


def _x(rng, *shape):
    return draws.normal(rng, shape)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_cached_decoding_on_either_kernel_equals_the_full_forward(rng, implementation):
    length = 19
    x = _x(rng, B, length, D)
    full = nn.MultiHeadAttention(num_heads=N, num_kv_heads=K, is_causal=True, window=(6, 0),
                                 implementation=implementation)
    params = _perturbed(jax.jit(full.init)(rng, x)["params"], jax.random.fold_in(rng, 1))
    expected = jax.jit(full.apply)({"params": params}, x)
    cached = full.clone(decode=True)
    cache = jax.jit(cached.init)(rng, x)["cache"]
    step = jax.jit(lambda cache, piece: cached.apply(
        {"params": params, "cache": cache}, piece, mutable=["cache"]))
    start = 0
    for size in (5, 1, 1, 7, 1, 4):   # a prefill, single tokens, chunks
        out, variables = step(cache, x[:, start:start + size])
        cache = variables["cache"]
        np.testing.assert_allclose(out, expected[:, start:start + size], rtol=1e-5, atol=1e-5)
        start += size
    assert start == length


def test_the_cache_builds_no_query_by_cache_mask(rng):
    """A decoding step describes the cache by positions and its filled length: nothing
    in the step is a boolean array as long as the cache (the old [T, S_cache] mask)."""
    capacity = 4096
    x = _x(rng, 1, capacity, D)
    module = nn.MultiHeadAttention(num_heads=N, is_causal=True, decode=True,
                                   implementation="chunked")
    variables = jax.jit(module.init)(rng, x[:, :8])
    cache = jax.tree.map(lambda c: jnp.zeros((1, capacity) + c.shape[2:], c.dtype)
                         if c.ndim == 4 else c, variables["cache"])
    step = lambda cache, piece: module.apply(  # noqa: E731
        {"params": variables["params"], "cache": cache}, piece, mutable=["cache"])
    jaxpr = jax.make_jaxpr(step)(cache, x[:, :1])
    shapes = {tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars
              if getattr(v.aval, "dtype", None) == jnp.bool_}
    shapes |= _nested_bool_shapes(jaxpr.jaxpr)
    assert not [s for s in shapes if s and s[-1] == capacity], shapes


def _nested_bool_shapes(jaxpr):
    found = set()
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            for inner in sub.eqns:
                found |= {tuple(v.aval.shape) for v in inner.outvars
                          if getattr(v.aval, "dtype", None) == jnp.bool_}
            found |= _nested_bool_shapes(sub)
    return found


@pytest.mark.parametrize("t, s", [(1, 1), (1, 23), (9, 1), (2, 7)])
def test_chunked_takes_single_queries_and_single_keys(rng, t, s):
    keys = jax.random.split(rng, 3)
    q, k, v = _x(keys[0], B, t, N, 8), _x(keys[1], B, s, K, 8), _x(keys[2], B, s, K, 5)
    bias = _x(keys[0], 1, N, t, s)

    def run(implementation):
        def loss(q, k, v, bias):
            out = attnjax.dot_product_attention(q, k, v, bias, is_causal=True,
                                                implementation=implementation)
            return jnp.sum(out * jnp.cos(jnp.arange(5.0, dtype=jnp.float32))[None, None, None]), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)

    (grads, out), (dense_grads, dense_out) = run("chunked"), run("dense")
    np.testing.assert_allclose(out, dense_out, rtol=1e-5, atol=1e-6)
    for got, expected in zip(grads, dense_grads):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_multi_head_attention_passes_masks_positions_score_mods_and_sinks(rng):
    params = jax.jit(functools.partial(attnjax.init_multi_head_attention, in_features=D,
                                       num_heads=N, num_kv_heads=K))(rng)
    x = _x(jax.random.fold_in(rng, 1), B, 10, D)
    ids = jnp.array([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3], jnp.int32)
    positions = jnp.array([list(range(4)) + list(range(6)), list(range(7)) + list(range(3))],
                          jnp.int32)
    sinks = _x(jax.random.fold_in(rng, 2), N)
    options = dict(mask=masks.causal() & masks.segments(ids), positions=(positions, positions),
                   score_mod=scores.soft_cap(5.0), sinks=sinks)
    out, lse = jax.jit(lambda params, x: attnjax.multi_head_attention(
        params, x, return_residual=True, **options))(params, x)
    chex.assert_shape((out, lse), ((B, 10, D), (B, 10, N)))
    # Each packed document alone gives the same rows.
    alone_call = jax.jit(lambda params, x, sinks: attnjax.multi_head_attention(
        params, x, is_causal=True, score_mod=scores.soft_cap(5.0), sinks=sinks))
    for b, cut in ((0, 4), (1, 7)):
        for lo, hi in ((0, cut), (cut, 10)):
            alone = alone_call(params, x[b:b + 1, lo:hi], sinks)
            np.testing.assert_allclose(out[b:b + 1, lo:hi], alone, rtol=1e-5, atol=1e-6)


def test_flax_module_learns_sinks_and_applies_its_score_mod(rng):
    x = _x(rng, B, 9, D)
    module = nn.MultiHeadAttention(num_heads=N, is_causal=True, use_sinks=True,
                                   score_mod=scores.soft_cap(3.0))
    params = _perturbed(jax.jit(module.init)(rng, x)["params"], jax.random.fold_in(rng, 1))
    chex.assert_shape(params["sinks"], (N,))
    got = jax.jit(module.apply)({"params": params}, x)

    @jax.jit
    def by_hand(params, x):
        q, k, v = (jnp.einsum("BLD,DNH->BLNH", x, params[name]["kernel"])
                   + params[name]["bias"][None, None] for name in ("query", "key", "value"))
        heads = attnjax.dot_product_attention(q, k, v, is_causal=True, sinks=params["sinks"],
                                              score_mod=scores.soft_cap(3.0))
        return (jnp.einsum("BLNV,NVF->BLF", heads, params["out"]["kernel"])
                + params["out"]["bias"][None, None])

    expected = by_hand(params, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(module.apply({"params": p}, x) ** 2)))(params)
    assert np.all(np.abs(np.asarray(grads["sinks"])) > 0)


def test_decoding_new_queries_and_keys_of_two_lengths_is_a_named_error(rng, own_checks_only):
    """decode=True appends inputs_k's tokens and places the queries at their positions:
    a query count that differs names inputs_q and inputs_k (an error about query
    positions the call never gave, before), in linen and nnx alike."""
    from flax import nnx

    import attnjax.nnx as anx

    message = (r"with decode=True, inputs_q and inputs_k hold the same new tokens: T=1 "
               r"queries and S=2 keys appended to the cache")
    x = _x(rng, B, 5, D)
    module = nn.MultiHeadDotProductAttention(num_heads=N, decode=True)
    variables = jax.jit(module.init)(rng, x)
    with pytest.raises(ValueError, match=message):
        module.apply(variables, x[:, :1], x[:, 1:3], mutable=["cache"])
    ours = anx.MultiHeadAttention(N, D, decode=True, rngs=nnx.Rngs(0))
    ours.init_cache(x.shape)
    with pytest.raises(ValueError, match=message):
        ours(x[:, :1], x[:, 1:3])
    assert int(ours.cache_index[...]) == 0


def test_sinks_init_and_metadata_make_the_sinks(rng, own_checks_only):
    """sinks_init draws the sinks (with flax's partitioning wrapper or, in nnx,
    sinks_metadata naming their axis); without it they are zeros and, in nnx, draw no
    key, so every other parameter keeps its value. Either given without use_sinks, or an
    initialiser that is not callable, is an error."""
    import flax.linen as fnn
    from flax import nnx

    import attnjax.nnx as anx

    x = _x(rng, B, 6, D)
    values = _x(jax.random.fold_in(rng, 1), N)
    init = lambda key, shape, dtype: jnp.broadcast_to(values, shape).astype(dtype)  # noqa: E731
    module = nn.MultiHeadAttention(num_heads=N, use_sinks=True,
                                   sinks_init=fnn.with_partitioning(init, ("heads",)))
    variables = jax.jit(module.init)(rng, x)
    assert fnn.get_partition_spec(variables)["params"]["sinks"] == jax.P("heads")
    params = fnn.meta.unbox(variables)["params"]
    np.testing.assert_array_equal(params["sinks"], values)
    q, k, v = (jnp.einsum("BLD,DNH->BLNH", x, params[name]["kernel"])
               + params[name]["bias"][None, None] for name in ("query", "key", "value"))
    heads = attnjax.dot_product_attention(q, k, v, sinks=values)
    by_hand = (jnp.einsum("BLNV,NVF->BLF", heads, params["out"]["kernel"])
               + params["out"]["bias"][None, None])
    np.testing.assert_allclose(jax.jit(module.apply)(variables, x), by_hand,
                               rtol=1e-5, atol=1e-6)

    mesh = jax.make_mesh((N,), ("heads",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        ours = anx.MultiHeadAttention(N, D, use_sinks=True, sinks_init=init,
                                      sinks_metadata={"out_sharding": ("heads",)},
                                      decode=False, rngs=nnx.Rngs(3))
        assert ours.sinks[...].sharding.spec == jax.P("heads")
    np.testing.assert_array_equal(ours.sinks[...], values)
    without = anx.MultiHeadAttention(N, D, score="general", decode=False, rngs=nnx.Rngs(3))
    zeros = anx.MultiHeadAttention(N, D, score="general", use_sinks=True, decode=False,
                                   rngs=nnx.Rngs(3))
    np.testing.assert_array_equal(zeros.sinks[...], np.zeros(N, np.float32))
    zeros_params = anx.to_linen_params(zeros)
    del zeros_params["sinks"]
    chex.assert_trees_all_equal(zeros_params, anx.to_linen_params(without))

    with pytest.raises(ValueError, match=r"sinks_init is for the sinks of use_sinks=True"):
        nn.MultiHeadAttention(num_heads=N, sinks_init=init).init(rng, x)
    with pytest.raises(ValueError, match=r"sinks_metadata is for the sinks of use_sinks=True"):
        anx.MultiHeadAttention(N, D, sinks_metadata={"out_sharding": ("heads",)},
                               rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"sinks_init must be an initialiser.*got 0.5"):
        anx.MultiHeadAttention(N, D, use_sinks=True, sinks_init=0.5, rngs=nnx.Rngs(0))


def test_an_option_the_module_sets_given_at_the_call_too_is_an_error(rng, own_checks_only):
    """A module's score_mod, use_sinks or score="dot" sets the engine's score_mod, sinks
    or scale: the same keyword at the call is refused, never silently one of the two
    (linen and nnx alike)."""
    from flax import nnx

    import attnjax.nnx as anx

    x = _x(rng, B, 5, D)
    cases = [(dict(score_mod=scores.soft_cap(50.0)), dict(score_mod=scores.soft_cap(0.01)),
              r"score_mod= was given at the call of a module whose score_mod=.* sets it"),
             (dict(use_sinks=True), dict(sinks=jnp.full((N,), 100.0)),
              r"sinks= was given at the call of a module whose use_sinks=True sets it"),
             (dict(score="dot"), dict(scale=0.001),
              r"scale= was given at the call of a module whose score='dot' sets it")]
    for fields, call, message in cases:
        module = nn.MultiHeadAttention(num_heads=N, **fields)
        params = jax.jit(module.init)(rng, x)
        with pytest.raises(ValueError, match=message):
            module.apply(params, x, **call)
        layer = anx.MultiHeadAttention(N, D, decode=False, rngs=nnx.Rngs(0), **fields)
        with pytest.raises(ValueError, match=message):
            layer(x, **call)


def test_the_linen_layers_name_an_option_they_do_not_know(rng, own_checks_only):
    x = _x(rng, B, 5, D)
    with pytest.raises(ValueError, match=r"activation must be one of \('relu', 'gelu'\); "
                                         r"got 'silu'"):
        nn.FeedForward(d_ff=8, activation="silu").init(rng, x)
    with pytest.raises(ValueError, match=r"kind must be one of \('sinusoidal', 'learned', "
                                         r"'none'\); got 'learnt'"):
        nn.PositionalEncoding(max_len=8, kind="learnt").init(rng, x)


def test_flax_module_takes_a_mask_value_and_positions(rng):
    x = _x(rng, B, 8, D)
    module = nn.MultiHeadAttention(num_heads=N)
    params = _perturbed(jax.jit(module.init)(rng, x)["params"], rng)
    prefix_lm = masks.causal() | masks.prefix(3)
    got = jax.jit(functools.partial(module.apply, mask=prefix_lm))({"params": params}, x)
    dense = np.tril(np.ones((8, 8), bool)) | (np.arange(8)[None, :] < 3)
    apply = jax.jit(module.apply)
    expected = apply({"params": params}, x, mask=jnp.asarray(dense)[None, None])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # Positions shifted by a constant leave a causal mask unchanged; reversed, they flip it.
    causal = nn.MultiHeadAttention(num_heads=N, is_causal=True)
    causal_apply = jax.jit(causal.apply)
    shifted = jnp.arange(8, dtype=jnp.int32) + 100
    reversed_ = jnp.arange(8, dtype=jnp.int32)[::-1]
    base = causal_apply({"params": params}, x)
    np.testing.assert_allclose(
        causal_apply({"params": params}, x, positions=(shifted, shifted)), base, rtol=1e-6)
    flipped = causal_apply({"params": params}, x[:, ::-1], positions=(reversed_, reversed_))
    anti = apply({"params": params}, x[:, ::-1], mask=jnp.asarray(np.triu(np.ones((8, 8), bool))))
    np.testing.assert_allclose(flipped, anti, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_masked_calls_create_no_inf_or_nan(rng, implementation):
    """Under jax.debug_infs / debug_nans, every masked path runs, forward and backward:
    rows that see nothing, padding, segments, a score_mod, sinks and the log-sum-exp."""
    keys = jax.random.split(rng, 4)
    q, k, v = _x(keys[0], 2, 9, N, 8), _x(keys[1], 2, 13, K, 8), _x(keys[2], 2, 13, K, 8)
    q_ids = jnp.array([[0] * 3 + [1] * 6, [2] * 9], jnp.int32)   # row 1 sees no key
    k_ids = jnp.array([[0] * 5 + [1] * 8, [0] * 13], jnp.int32)

    def loss(q, k, v, sinks):
        out, lse = attnjax.dot_product_attention(
            q, k, v, mask=masks.causal() & masks.segments(q_ids, k_ids),
            key_lengths=jnp.array([10, 4], jnp.int32), score_mod=scores.soft_cap(5.0),
            sinks=sinks, return_residual=True, implementation=implementation,
            block_sizes=(8, 8) if implementation == "chunked" else None)
        return jnp.sum(out ** 2) + jnp.sum(lse)

    with jax.debug_infs(True), jax.debug_nans(True):
        for sinks in (None, _x(keys[3], N)):
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, sinks)
            chex.assert_tree_all_finite(grads)


def test_positions_with_the_kv_cache_are_a_clear_error(rng):
    x = _x(rng, B, 6, D)
    module = nn.MultiHeadAttention(num_heads=N, is_causal=True, decode=True)
    variables = jax.jit(module.init)(rng, x)
    steps = jnp.arange(2, dtype=jnp.int32)
    with pytest.raises(ValueError, match="positions= cannot be given with decode=True"):
        # Under jit: raised while tracing, before anything is compiled.
        jax.jit(functools.partial(module.apply, mutable=["cache"]))(
            variables, x[:, :2], positions=(steps, steps))


def test_model_configs_carry_soft_caps_and_sinks_into_every_attention(rng):
    config = nn.DecoderOnlyConfig(vocab_size=11, d_model=16, num_heads=2, d_ff=32,
                                  num_layers=2, attention_soft_cap=2.0, attention_sinks=True)
    model = nn.DecoderOnly(config)
    tokens = draws.randint(rng, (2, 7), 1, 11)
    params = jax.jit(model.init)(rng, tokens)["params"]
    assert all(params["decoder"][f"layer_{i}"]["self"]["sinks"].shape == (2,) for i in range(2))
    plain = nn.DecoderOnly(dataclasses.replace(config, attention_soft_cap=None))
    assert not np.allclose(
        jax.jit(functools.partial(model.apply, deterministic=True))({"params": params}, tokens),
        jax.jit(functools.partial(plain.apply, deterministic=True))({"params": params}, tokens))
    with pytest.raises(ValueError, match="soft_cap needs a positive finite cap; got -1.0"):
        nn.DecoderOnlyConfig(vocab_size=11, attention_soft_cap=-1.0)
