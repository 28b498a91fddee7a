"""attnjax.nnx: MultiHeadAttention against flax.nnx.MultiHeadAttention (state, outputs,
cache, errors), the nnx models against the linen ones (exact parameter round trips,
equal outputs, decoding), and the toy trainer with model.api=nnx against linen."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnjax.nnx as anx
from attnjax import masks, nn
from attnjax.nnx.models import counterpart
from attnjax.toy import make_task
from attnjax.toy import train as training
from attnjax.toy.config import load_config
from tests.children import one_device_mesh
from tests.numerics import as_users_run

B, T, S, D, DKV = 3, 5, 7, 12, 10
ATOL = 1e-5


def _pair(rngs_seed: int, **kw):
    """flax's module and attnjax's, built from the same nnx.Rngs."""
    flax_mha = nnx.MultiHeadAttention(rngs=nnx.Rngs(rngs_seed), decode=False, **kw)
    ours = anx.MultiHeadAttention(rngs=nnx.Rngs(rngs_seed), decode=False, **kw)
    return flax_mha, ours


def _tree_equal(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


_JITTED = {}


def _call(module, *args, **kwargs):
    """module(*args, **kwargs) under nnx.jit: arrays and Masks traced, other keywords
    static, one compiled function per set of keywords."""
    traced = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, masks.Mask))}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in traced))
    key = (static, tuple(sorted(traced)))
    if key not in _JITTED:
        _JITTED[key] = nnx.jit(lambda m, t, *a: m(*a, **t, **dict(static)))
    return _JITTED[key](module, traced, *args)


RNG = np.random.default_rng(20)


def _normal(*shape):
    """Fresh unit-variance float32 values (NumPy's generator: nothing to compile)."""
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


@pytest.fixture(scope="module")
def inputs():
    return _normal(B, T, D), _normal(B, S, DKV)


@pytest.mark.parametrize("kw", [
    dict(num_heads=4, in_features=D, in_kv_features=DKV),
    dict(num_heads=4, in_features=D, in_kv_features=DKV, num_kv_heads=2, normalize_qk=True,
         qkv_features=8, out_features=6),
], ids=["plain", "gqa_qknorm"])
def test_same_rngs_same_state_and_outputs_as_flax(inputs, kw):
    x, memory = inputs
    flax_mha, ours = _pair(3, **kw)
    assert _tree_equal(nnx.to_pure_dict(nnx.state(flax_mha)), nnx.to_pure_dict(nnx.state(ours)))
    # a random float 0/1 mask, flax's kind
    mask = jnp.asarray(RNG.uniform(size=(B, 1, T, S)) < 0.7, jnp.float32)
    mask = mask.at[..., 0].set(1.0)  # every query sees a key: flax averages otherwise
    for args, call in (((x, memory), {"mask": mask}), ((x, memory, memory + 1.0), {})):
        np.testing.assert_allclose(_call(ours, *args, **call), _call(flax_mha, *args, **call),
                                   atol=ATOL)


def test_state_loads_from_and_into_flax(inputs):
    x, memory = inputs
    kw = dict(num_heads=2, in_features=D, in_kv_features=DKV, num_kv_heads=1)
    flax_mha, _ = _pair(1, **kw)
    _, ours = _pair(2, **kw)
    assert not np.allclose(_call(ours, x, memory), _call(flax_mha, x, memory), atol=1e-3)
    nnx.update(ours, nnx.state(flax_mha))
    np.testing.assert_allclose(_call(ours, x, memory), _call(flax_mha, x, memory), atol=ATOL)
    # and back: a flax module with attnjax's state computes attnjax's function
    nnx.update(ours, jax.tree.map(lambda p: 1.5 * p, nnx.state(ours, nnx.Param)))
    nnx.update(flax_mha, nnx.state(ours))
    np.testing.assert_allclose(_call(flax_mha, x, memory), _call(ours, x, memory), atol=ATOL)


def test_sow_weights_as_flax_sows_them(inputs):
    x, _ = inputs
    flax_mha, ours = _pair(4, num_heads=4, in_features=D)
    sown = []
    for module in (flax_mha, ours):
        # flax's way to collect what a module sows: nnx.capture
        forward = nnx.capture(lambda m, x: m(x, sow_weights=True, is_causal=True),
                              nnx.Intermediate)
        _, intermediates = forward(module, x)
        sown.append(nnx.to_pure_dict(intermediates)["attention_weights"])
    theirs, mine = sown
    assert mine[0].shape == (B, 4, T, T)
    np.testing.assert_allclose(mine[0], theirs[0], atol=ATOL)


def test_decode_step_by_step_equals_full_causal_and_flax(inputs):
    x, _ = inputs
    kw = dict(num_heads=4, in_features=D, num_kv_heads=2)
    flax_mha, ours = _pair(6, **kw)
    full = _call(ours, x, is_causal=True)
    for module in (flax_mha, ours):
        module.init_cache(x.shape)
    ours_steps, flax_steps = [], []
    for i in range(T):
        ours_steps.append(_call(ours, x[:, i:i + 1], decode=True))
        with jax.numpy_dtype_promotion("standard"):   # flax's cache mixes int widths
            flax_steps.append(_call(flax_mha, x[:, i:i + 1], decode=True))
    np.testing.assert_allclose(jnp.concatenate(ours_steps, 1), full, atol=ATOL)
    np.testing.assert_allclose(jnp.concatenate(ours_steps, 1), jnp.concatenate(flax_steps, 1),
                               atol=ATOL)
    assert int(ours.cache_index[...]) == T
    # a chunked prefill, then one token: the same rows
    ours.init_cache(x.shape)
    chunks = [_call(ours, x[:, :3], decode=True, is_causal=True),
              _call(ours, x[:, 3:], decode=True, is_causal=True)]
    np.testing.assert_allclose(jnp.concatenate(chunks, 1), full, atol=ATOL)


def test_every_setting_flax_s_module_keeps_is_kept_alike():
    """Code that reads a setting back from flax's module (qkv_promote_dtype,
    out_dot_general, ...) reads the same from attnjax's; attention_fn alone differs (its
    default, None, is attnjax's engine; flax's, flax's function)."""
    kw = dict(num_heads=4, in_features=D, in_kv_features=DKV, num_kv_heads=2,
              out_dot_general=jax.lax.dot_general, qkv_promote_dtype=lambda *xs, **k: xs)
    flax_mha, ours = _pair(int(RNG.integers(100)), **kw)
    settings = {name: value for name, value in vars(flax_mha).items()
                if not name.startswith("_") and name != "attention_fn"
                and not isinstance(value, (nnx.Variable, nnx.Module))}
    assert {"qkv_promote_dtype", "out_dot_general", "head_dim", "num_kv_heads"} <= set(settings)
    assert {name: getattr(ours, name, "missing") for name in settings} == settings


def test_view_sizes_a_missing_cache_and_keeps_an_existing_one(inputs):
    """nnx.view(decode=True, batch_size=..., max_length=...) sizes a cache init_cache has
    not, and needs both only then: on a sized cache (flax: any) it only sets decode."""
    x, _ = inputs
    ours = anx.MultiHeadAttention(num_heads=4, in_features=D, num_kv_heads=2, decode=False,
                                  rngs=nnx.Rngs(3))
    full = _call(ours, x[:, :2], is_causal=True)
    with pytest.raises(TypeError, match="'max_length' must be provided"):
        ours.set_view(decode=True, batch_size=B)
    assert not ours.decode   # a refused view changes nothing
    viewed = nnx.view(ours, decode=True, batch_size=B, max_length=T)
    assert viewed.cached_key.shape == (B, T, 2, D // 4) and viewed.decode
    steps = [_call(viewed, x[:, i:i + 1]) for i in range(2)]
    before = viewed.cached_key[...]
    for sizes in (dict(batch_size=B + 1), dict(max_length=T + 1), {}):
        again = nnx.view(viewed, decode=True, **sizes)
        np.testing.assert_array_equal(again.cached_key[...], before)
        assert int(again.cache_index[...]) == 2
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=ATOL)


def test_a_decoding_step_traced_sized_for_every_append_calls_no_host(inputs):
    """nn.sized_for_every_append serves the nnx cache too: a step traced inside it has
    no overrun check's host callback (the same step outside has one), and decodes token
    by token the rows of full causal attention."""
    x, _ = inputs
    _, ours = _pair(7, num_heads=4, in_features=D)
    full = _call(ours, x, is_causal=True)
    ours.init_cache(x.shape)
    graphdef, state = nnx.split(ours)

    def step(state, token):
        module = nnx.merge(graphdef, state)
        return module(token, decode=True), nnx.state(module)

    sized = nn.sized_for_every_append()(step)
    for fn, calls in ((sized, False), (step, True)):
        assert ("debug_callback" in str(jax.make_jaxpr(fn)(state, x[:, :1]))) is calls
    rows, jitted = [], jax.jit(sized)
    for i in range(T):
        row, state = jitted(state, x[:, i:i + 1])
        rows.append(row)
    np.testing.assert_allclose(jnp.concatenate(rows, 1), full, atol=ATOL)
    assert int(state["cache_index"][...]) == T



# flax.nnx's attention runs jax.nn's, which casts complex logits to float32 (jax warns)
@pytest.mark.filterwarnings("ignore:Casting from complex to real:DeprecationWarning")
def test_complex_inputs_run_in_flax_s_attention():
    """attnjax's kernels are real: complex inputs run flax's own attention, with flax's
    numbers; the call's is_causal is passed to it, and the module's own is_causal (which
    aligns bottom-right) is an error, as in the linen module."""
    x = jax.lax.complex(_normal(B, T, D), _normal(B, T, D))
    theirs, ours = _pair(3, num_heads=4, in_features=D)
    with as_users_run():  # flax promotes the float32 parameters implicitly
        expected = _call(theirs, x, deterministic=True)
        got = _call(ours, x, deterministic=True)
        expected_causal = _call(theirs, x, mask=nnx.make_causal_mask(jnp.ones((B, T))),
                                deterministic=True)
        got_causal = _call(ours, x, deterministic=True, is_causal=True)
    assert got.dtype == expected.dtype == jnp.complex64
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=ATOL)
    np.testing.assert_allclose(got_causal, expected_causal, rtol=1e-5, atol=ATOL)
    assert not np.allclose(got_causal, got)
    causal = anx.MultiHeadAttention(rngs=nnx.Rngs(3), decode=False, num_heads=4,
                                    in_features=D, is_causal=True)
    with as_users_run(), pytest.raises(
            ValueError, match=r"complex inputs \(complex64\) run in flax's attention "
                              r"instead of attnjax's engine.*is_causal"):
        causal(x, deterministic=True)


def test_flax_errors():
    _, ours = _pair(0, num_heads=2, in_features=D)
    x = _normal(2, 3, D)
    with pytest.raises(ValueError, match="cache not initialized, call ``init_cache`` first"):
        ours(x, decode=True)
    with pytest.raises(ValueError, match="No `decode` argument was provided"):
        anx.MultiHeadAttention(2, D, rngs=nnx.Rngs(0))(x)
    with pytest.raises(ValueError, match=r"inputs_q must have shape \[batch..., length, "
                                         r"in_features=12\]; got \[2, 3, 5\]"):
        ours(x[..., :5])
    with pytest.raises(ValueError, match="`inputs_k` cannot be None"):
        ours(x, inputs_v=x)
    with pytest.raises(ValueError, match="num_kv_heads must divide num_heads"):
        anx.MultiHeadAttention(4, D, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="qkv_features must be divisible by num_heads"):
        anx.MultiHeadAttention(5, D, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="score must be one of"):
        anx.MultiHeadAttention(2, D, score="cosine", rngs=nnx.Rngs(0))
    ours.init_cache((2, 4, D))
    with pytest.raises(ValueError, match=r"new keys must have the cache's batch axes and heads"):
        ours(jnp.concatenate([x, x]), decode=True)
    with pytest.raises(ValueError, match="KV cache overrun: 5 new tokens at position 0"):
        ours(jnp.concatenate([x, x[:, :2]], 1), decode=True)
    with pytest.raises(ValueError, match="attention_fn replaces attnjax's engine"):
        anx.MultiHeadAttention(2, D, attention_fn=nnx.dot_product_attention, window=2,
                               decode=False, rngs=nnx.Rngs(0))(x)
    # attnjax's is_causal aligns bottom-right, flax's attention top-left: not passed on
    with pytest.raises(ValueError, match="attention_fn replaces attnjax's engine.*"
                                         "got is_causal=True"):
        anx.MultiHeadAttention(2, D, attention_fn=nnx.dot_product_attention, is_causal=True,
                               decode=False, rngs=nnx.Rngs(0))(x)
    with pytest.raises(ValueError, match=r"kind must be one of \('sinusoidal', 'learned', "
                                         r"'none'\); got 'learnt'"):
        anx.models.PositionalEncoding(8, D, kind="learnt", rngs=nnx.Rngs(0))
    # a decoding encoding called before init_cache (positions from 0 at every call, before)
    positional = anx.models.PositionalEncoding(8, D, decode=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"cache not initialized, call ``init_cache`` first"):
        positional(x)
    positional.init_cache()
    whole = anx.models.PositionalEncoding(8, D, rngs=nnx.Rngs(0))(jnp.concatenate([x, x], 1))
    parts = jnp.concatenate([positional(x), positional(x)], 1)
    np.testing.assert_allclose(parts, whole, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"activation must be one of \('relu', 'gelu'\); "
                                         r"got 'silu'"):
        anx.models.FeedForward(D, 8, activation="silu", rngs=nnx.Rngs(0))


def test_feed_forward_dropout_follows_train_and_eval(inputs):
    """nnx's FeedForward drops out after model.train() and not after model.eval(), and
    with neither (nor a call's deterministic) is refused (its call's default, True, had
    overridden model.train(): dropout silently off in training)."""
    x, _ = inputs
    ffn = anx.models.FeedForward(D, 16, dropout_rate=0.5, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"FeedForward has dropout_rate=0.5, so "
                                         r"deterministic is required"):
        ffn(x)
    evaluated = ffn(x, deterministic=True)
    ffn.eval()
    np.testing.assert_array_equal(ffn(x), evaluated)
    ffn.train()
    dropped = ffn(x, rngs=nnx.Rngs(dropout=1))
    assert np.abs(np.asarray(dropped - evaluated)).max() > 1e-3
    np.testing.assert_array_equal(ffn(x, rngs=nnx.Rngs(dropout=1)), dropped)
    plain = anx.models.FeedForward(D, 16, rngs=nnx.Rngs(0))   # no dropout: none needed
    assert plain(x).shape == x.shape


def test_dropout_rate_one_runs_deterministic_as_in_flax_and_is_refused_dropping(inputs):
    x, y = inputs
    flax_mha, ours = _pair(0, num_heads=4, in_features=D, in_kv_features=DKV,
                           dropout_rate=1.0)
    with as_users_run():
        expected = flax_mha(x, y, deterministic=True)
    np.testing.assert_allclose(_call(ours, x, y, deterministic=True), expected, atol=ATOL)
    with pytest.raises(ValueError, match=r"dropout_rate=1.0 drops every attention weight"):
        ours(x, y, deterministic=False)
    with pytest.raises(ValueError, match=r"dropout_rate must lie in \[0, 1\]; got 1.5"):
        anx.MultiHeadAttention(4, D, dropout_rate=1.5, rngs=nnx.Rngs(0))


def test_attnjax_fields_match_the_linen_module(inputs):
    """num_kv_heads, is_causal, window, score, sinks, score_mod: the nnx module and the
    linen one on the same parameters compute the same function."""
    x, memory = inputs
    fields = dict(num_kv_heads=2, is_causal=True, window=(3, 1), score="additive",
                  use_sinks=True, projection_activation=jnp.tanh)
    score_mod = lambda s, b, n, q, k: s - 0.1 * jnp.abs(q - k).astype(s.dtype)  # noqa: E731
    ours = anx.MultiHeadAttention(4, D, in_kv_features=DKV, score_mod=score_mod,
                                  decode=False, rngs=nnx.Rngs(8), **fields)
    params = anx.to_linen_params(ours)
    assert params["score_v"].shape == (4, 3) and params["sinks"].shape == (4,)
    # sinks start at zero; give them values that matter
    params["sinks"] = _normal(4)
    anx.from_linen_params(ours, params)
    linen = nn.MultiHeadAttention(num_heads=4, score_mod=score_mod, **fields)
    bias = 0.5 * _normal(B, 4, T, S)
    lengths = masks.lengths(key=jnp.array([7, 2, 4]))
    expected = jax.jit(linen.apply)({"params": params}, x, memory, bias=bias, mask=lengths)
    np.testing.assert_allclose(_call(ours, x, memory, bias=bias, mask=lengths), expected,
                               atol=ATOL)


# The models: one tiny config each, with every parameter kind (learned positions,
# grouped-query heads, sinks), built once.
TRANSFORMER = nn.TransformerConfig(src_vocab_size=11, tgt_vocab_size=13, d_model=16,
                                   num_heads=4, num_kv_heads=2, d_ff=24, num_encoder_layers=1,
                                   num_decoder_layers=1, positional="learned", max_len=12,
                                   attention_sinks=True)
DECODER_ONLY = nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2, d_ff=24,
                                    num_layers=1, pre_ln=False, attention_soft_cap=5.0)


@pytest.fixture(scope="module")
def tokens():
    return tuple(jnp.asarray(RNG.integers(0, vocab, (2, length)), jnp.int32)
                 for vocab, length in ((11, 9), (13, 6), (13, 8)))


def _abstract(linen):
    """The nnx counterpart of a linen model, its parameters not yet drawn."""
    return nnx.eval_shape(lambda: counterpart(linen, rngs=nnx.Rngs(0)))


@nnx.jit
def _nnx_call(model, *args):
    return model(*args, deterministic=True)


def _random_like(shapes, seed: int):
    """Fresh random values for a tree of shapes (NumPy's generator: no compilation)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype),
                        shapes)


def test_linen_nnx_round_trip_and_same_function(tokens):
    src, tgt, seq = tokens
    linen = nn.Transformer(TRANSFORMER)
    args = (src, tgt, jnp.array([9, 4]))
    shapes = jax.eval_shape(linen.init, jax.random.key(0), *args)["params"]
    params = _random_like(shapes, 31)
    model = anx.from_linen_params(_abstract(linen), params)
    back = anx.to_linen_params(model)
    assert _tree_equal(back, params)
    expected = jax.jit(lambda p, *a: linen.apply({"params": p}, *a, deterministic=True))(
        params, *args)
    np.testing.assert_allclose(_nnx_call(model, *args), expected, atol=ATOL)
    # nnx -> linen -> nnx: other parameters survive both ways
    own = _random_like(shapes, 32)
    assert not _tree_equal(own, params)
    again = anx.to_linen_params(anx.from_linen_params(model, own))
    assert _tree_equal(again, own)
    # the decoder-only model's tree too
    lm = _abstract(nn.DecoderOnly(DECODER_ONLY))
    linen_tree = jax.eval_shape(nn.DecoderOnly(DECODER_ONLY).init, jax.random.key(0), seq)
    lm_params = _random_like(linen_tree["params"], 33)
    assert _tree_equal(anx.to_linen_params(anx.from_linen_params(lm, lm_params)), lm_params)


def test_from_linen_params_names_what_does_not_fit():
    model = _abstract(nn.DecoderOnly(DECODER_ONLY))
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), anx.to_linen_params(model))
    params["logits"]["kernel"] = params["logits"]["kernel"][:, :5]
    with pytest.raises(ValueError, match=r"params\[logits/kernel\] must have shape \(16, 13\); "
                                         r"got \(16, 5\)"):
        anx.from_linen_params(model, params)
    params["logits"]["kernel"] = jnp.ones((16, 13), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"params\[logits/kernel\] must have dtype float32 "
                                         r"\(the model's param_dtype\); got bfloat16"):
        anx.from_linen_params(model, params)
    params["logits"]["kernel"] = 1.5
    with pytest.raises(TypeError, match=r"params\[logits/kernel\] must be an array; got float"):
        anx.from_linen_params(model, params)
    del params["logits"]
    with pytest.raises(ValueError, match=r"missing \['logits/bias', 'logits/kernel'\]"):
        anx.from_linen_params(model, params)


def test_from_linen_params_unboxes_partitioned_params(inputs):
    """Parameters a linen module made with flax.linen.with_partitioning come boxed."""
    import flax.linen as fnn

    x, _ = inputs
    init = fnn.with_partitioning(fnn.initializers.lecun_normal(), (None, None, None))
    linen = nn.MultiHeadDotProductAttention(num_heads=4, kernel_init=init)
    boxed = linen.init(jax.random.key(5), x)["params"]
    assert isinstance(boxed["query"]["kernel"], fnn.Partitioned)
    model = anx.from_linen_params(
        anx.MultiHeadAttention(4, D, decode=False, rngs=nnx.Rngs(1)), boxed)
    expected = jax.jit(linen.apply)({"params": boxed}, x)
    np.testing.assert_allclose(_call(model, x), expected, atol=ATOL)


def test_view_deterministic_is_eval_mode_for_the_models(tokens):
    """nnx.view(model, deterministic=True) switches a model's dropout off as
    model.eval() does, and deterministic=False on as model.train() does."""
    _, _, seq = tokens
    config = nn.DecoderOnlyConfig(**{**vars(DECODER_ONLY), "dropout_rate": 0.5})
    model = counterpart(nn.DecoderOnly(config), rngs=nnx.Rngs(7))
    viewed = nnx.view(model, deterministic=True)
    assert viewed.deterministic is True and model.deterministic is None
    run = nnx.jit(lambda m, x: m(x))
    evaluated = run(viewed, seq)
    model.eval()
    np.testing.assert_array_equal(evaluated, run(model, seq))
    dropped = nnx.view(model, deterministic=False)(seq, rngs=nnx.Rngs(dropout=3))
    assert not np.allclose(dropped, evaluated)


@pytest.mark.parametrize("kind", ["decoder_only", "transformer"])
def test_a_decoding_view_of_a_model_is_refused_for_init_cache(kind):
    """nnx.view(model, decode=True, batch_size=..., max_length=...) had switched every
    attention layer (the encoder's and cross-attention's too) and no position counter:
    a DecoderOnly view decoded every token at position 0 (1.33 off the full pass), a
    Transformer's failed in its encoder with a cache overrun. The models and blocks
    refuse it, naming init_cache; a deterministic view is unchanged."""
    linen = (nn.DecoderOnly(DECODER_ONLY) if kind == "decoder_only"
             else nn.Transformer(TRANSFORMER))
    model = counterpart(linen, rngs=nnx.Rngs(7))
    for sizes in (dict(decode=True, batch_size=2, max_length=6), dict(decode=False),
                  dict(max_length=6)):
        with pytest.raises(ValueError, match=r"nnx.view: attnjax.nnx's blocks and models .* "
                                             r"take deterministic only; got .*init_cache"):
            nnx.view(model, **sizes)
    assert nnx.view(model, deterministic=True).deterministic is True


def test_nnx_decoder_only_decodes_on_its_cache(tokens):
    _, _, seq = tokens
    linen = nn.DecoderOnly(DECODER_ONLY)
    params = _random_like(anx.to_linen_params(_abstract(linen)), 40)
    model = anx.from_linen_params(_abstract(linen), params)
    full = _nnx_call(model, seq)
    decoder = anx.from_linen_params(_abstract(linen.clone(decode=True)), params)
    decoder.init_cache(2, seq.shape[1])
    steps = [_nnx_call(decoder, seq[:, :4])] + [_nnx_call(decoder, seq[:, i:i + 1])
                                                for i in range(4, seq.shape[1])]
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, atol=ATOL)
    assert int(decoder.decoder.layer_0.self.cache_index[...]) == seq.shape[1]


def test_nnx_training_matches_linen(float32):
    """The trainer's step with model.api=nnx gives linen's losses and exact match (the
    decoder-only model here; the encoder–decoder's function is compared above)."""
    steps = 30
    overrides = [
        "task.num_symbols=4", "task.min_len=1", "task.max_len=3", "task.eval_size=64",
        "model.kind=decoder_only", "model.d_model=16", "model.num_heads=2", "model.d_ff=32",
        "model.num_decoder_layers=1", "model.max_len=8", "model.dropout_rate=0.0",
        "optim.learning_rate=1e-2", "optim.warmup_steps=5", "batch_size=32", f"steps={steps}"]
    config = load_config(None, overrides)
    task = make_task(config.task)
    model = training.make_model(config, task)
    optimizer = training.make_optimizer(config.optim, config.steps)
    mesh = one_device_mesh()
    initial = training.init_state(model, optimizer, task, config.seed, mesh)
    held_out = training.eval_set(task, config)
    runs = {}
    for api in ("linen", "nnx"):
        assert load_config(None, overrides + [f"model.api={api}"]).model.api == api
        state = jax.tree.map(jnp.copy, initial)   # the step donates its state
        step = training.make_train_step(model, optimizer, config.optim, config.steps,
                                        config.seed, state, mesh, api=api)
        losses = []
        for i in range(steps):
            state, metrics = step(state, training.train_batch(task, config, i, mesh))
            losses.append(float(metrics["loss"]))
        predictions = training.predict(model, task, state.params, held_out, 64, mesh)
        runs[api] = losses, training.accuracies(predictions, np.asarray(held_out.tgt_out))
    (linen_losses, linen_acc), (nnx_losses, nnx_acc) = runs["linen"], runs["nnx"]
    np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-4, atol=1e-5)
    assert linen_losses[-1] < 0.6 * linen_losses[0]
    assert linen_acc["exact_match"] > 0.2
    assert nnx_acc == linen_acc


def _decoding_lm(num_layers: int, length: int, cache_length: int):
    """Fresh tokens `[1, length]`, a DecoderOnly's full-forward logits of them, and the
    decode=True model of the same parameters with its caches sized for cache_length."""
    config = nn.DecoderOnlyConfig(vocab_size=17, d_model=32, num_heads=4, d_ff=64,
                                  num_layers=num_layers, dropout_rate=0.0)
    generator = np.random.default_rng()
    tokens = jnp.asarray(generator.integers(0, 17, (1, length)), jnp.int32)
    seed = int(generator.integers(1 << 30))
    full = anx.DecoderOnly(config, rngs=nnx.Rngs(seed))(tokens)
    model = anx.DecoderOnly(config, decode=True, rngs=nnx.Rngs(seed))
    model.init_cache(1, cache_length)
    return tokens, full, model


def test_a_refused_append_leaves_the_position_counter_as_it_was(own_checks_only):
    """Two tokens into a cache with one free slot are refused (a KV cache overrun); the
    positions' counter had advanced in place before the refusal, and the next, valid
    token was encoded two places on (logits 0.44 off the full forward)."""
    tokens, full, model = _decoding_lm(num_layers=1, length=4, cache_length=4)
    model(tokens[:, :3])
    with pytest.raises(ValueError, match="KV cache overrun: 2 new tokens at position 3"):
        model(jnp.concatenate([tokens[:, 3:], tokens[:, 3:]], axis=1))
    assert int(model.embed.positions.position[...]) == 3
    np.testing.assert_allclose(model(tokens[:, 3:])[:, 0], full[:, 3], rtol=1e-5, atol=1e-5)


def test_a_refused_call_leaves_every_cache_as_it_was(own_checks_only):
    """A decoding call refused after its keys were projected (a mask of the wrong shape)
    leaves the layer's cache, and every cache of a model, as it was: the refused tokens
    had been appended in place, and the next, valid token attended to them (logits 0.12
    off the full forward)."""
    tokens, full, model = _decoding_lm(num_layers=2, length=5, cache_length=6)
    model(tokens[:, :3])
    layer = model.decoder.layer_0.self
    caches = lambda: jax.tree.map(  # noqa: E731
        np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Cache)))
    before = caches()
    with pytest.raises(ValueError, match=r"mask must be broadcastable to \[B, N, T, S\]"):
        model(tokens[:, 3:4], mask=jnp.ones((1, 1, 1, 3), bool))
    with pytest.raises(ValueError, match=r"mask must be broadcastable to \[B, N, T, S\]"):
        layer(_normal(1, 1, 32), mask=jnp.ones((1, 1, 1, 2), bool))
    chex.assert_trees_all_equal(caches(), before)
    # refused by the second layer after the first has appended (its cache cut short)
    second = model.decoder.layer_1.self
    for name in ("cached_key", "cached_value"):
        getattr(second, name).set_value(getattr(second, name)[...][:, :4])
    shortened = caches()
    with pytest.raises(ValueError, match="KV cache overrun: 2 new tokens at position 3"):
        model(tokens[:, 3:])
    chex.assert_trees_all_equal(caches(), shortened)
    for name in ("cached_key", "cached_value"):
        getattr(second, name).set_value(jnp.asarray(before["decoder"]["layer_1"]["self"][name]))
    np.testing.assert_allclose(model(tokens[:, 3:]), full[:, 3:], rtol=1e-5, atol=1e-5)


def test_nnx_decoding_refuses_packed_rows(own_checks_only):
    """As the linen models (tests/test_nn.py): a decode=True call with segment ids is
    refused, naming the model's argument, and the cache is left as it was."""
    tokens, full, model = _decoding_lm(num_layers=1, length=4, cache_length=8)
    ids = jnp.asarray(np.sort(np.random.default_rng().integers(0, 2, (1, 4)), axis=1),
                      jnp.int32)
    with pytest.raises(ValueError, match="segment_ids packs several sequences into a row"):
        model(tokens, segment_ids=ids)
    assert int(model.embed.positions.position[...]) == 0
    np.testing.assert_allclose(model(tokens), full, rtol=1e-5, atol=1e-5)
