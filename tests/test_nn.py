"""Layer 5: Flax modules, KV-cache decoding, models."""

import functools
import re

import chex
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax import nn
from attnjax.nn import decoding
from tests import draws
from tests.checks import own_checks_only
from tests.numerics import as_users_run
from tests.trees import perturbed as _perturbed

B, T, S, D, DK, N = 2, 5, 7, 12, 10, 4


def _x(rng, *shape, dtype=jnp.float32):
    return draws.normal(rng, shape, dtype)


# Flax's init/apply and jax.grad run under jax.jit in these tests: eagerly, XLA compiles
# every primitive as a program of its own (hundreds per test); jitted, one program.
@functools.partial(jax.jit, static_argnums=0)
def _init(module, rngs, *args):
    """module.init(rngs, *args), jitted: one program per (module, shapes), shared by the
    tests that build an equal module (flax modules compare by their fields)."""
    return module.init(rngs, *args)


@functools.partial(jax.jit, static_argnums=0)
def _apply(module, variables, *args):
    """module.apply(variables, *args), jitted and shared as _init."""
    return module.apply(variables, *args)


# --- MultiHeadAttention against flax -------------------------------------------------


@pytest.mark.parametrize("kind", ["self", "cross", "masked"])
def test_mha_params_and_outputs_equal_flax(rng, kind):
    x = _x(jax.random.fold_in(rng, 1), B, T, D)
    y = x if kind == "self" else _x(jax.random.fold_in(rng, 2), B, S, DK)
    mask = None
    if kind == "masked":
        mask = draws.bernoulli(jax.random.fold_in(rng, 3), 0.7, (B, 1, T, S), always=0)
    ours = nn.MultiHeadAttention(num_heads=N, qkv_features=16, out_features=9)
    theirs = flax_nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=16, out_features=9)
    with jax.numpy_dtype_promotion("standard"):
        flax_params = _init(theirs, rng, x, y)["params"]
    our_params = _init(ours, rng, x, y)["params"]
    chex.assert_trees_all_equal_shapes_and_dtypes(our_params, flax_params)
    flax_params = _perturbed(flax_params, rng)
    with jax.numpy_dtype_promotion("standard"):
        expected = jax.jit(theirs.apply)({"params": flax_params}, x, y, mask=mask)
    got = jax.jit(ours.apply)({"params": flax_params}, x, y, mask=mask)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_mha_dropout_follows_flax_broadcast_convention(rng):
    x = _x(rng, B, T, D)
    module = nn.MultiHeadAttention(num_heads=N, dropout_rate=0.5, deterministic=False)
    params = _init(module, {"params": rng, "dropout": rng}, x)["params"]
    apply = jax.jit(module.apply)
    run = lambda key: apply({"params": params}, x, rngs={"dropout": key})  # noqa: E731
    np.testing.assert_array_equal(run(jax.random.key(1)), run(jax.random.key(1)))
    assert not np.allclose(run(jax.random.key(1)), run(jax.random.key(2)))
    # broadcast_dropout=True shares one mask by every example: identical examples stay so.
    same = jnp.broadcast_to(x[:1], x.shape)
    shared = apply({"params": params}, same, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_allclose(shared[0], shared[1], rtol=1e-6)
    independent = jax.jit(module.clone(broadcast_dropout=False).apply)(
        {"params": params}, same, rngs={"dropout": jax.random.key(3)})
    assert not np.allclose(independent[0], independent[1])


# --- KV cache --------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_cached_decoding_equals_full_causal_forward(rng, chunk, num_kv_heads):
    length = 14
    x = _x(rng, B, length, D)
    full = nn.MultiHeadAttention(num_heads=N, num_kv_heads=num_kv_heads, is_causal=True)
    params = _perturbed(_init(full, rng, x)["params"], jax.random.fold_in(rng, 1))
    expected = _apply(full, {"params": params}, x)
    cached = full.clone(decode=True)
    cache = _init(cached, rng, x)["cache"]
    # With GQA the cache holds K heads, not N.
    chex.assert_shape(cache["cached_key"], (B, length, num_kv_heads or N, D // N))
    step = jax.jit(lambda cache, piece: cached.apply(
        {"params": params, "cache": cache}, piece, mutable=["cache"]))
    outs = []
    for start in range(0, length, chunk):
        out, variables = step(cache, x[:, start:start + chunk])
        cache = variables["cache"]
        np.testing.assert_allclose(out, expected[:, start:start + chunk], rtol=1e-5, atol=1e-5)
        outs.append(out)
    assert int(cache["cache_index"]) == length
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), expected, rtol=1e-5, atol=1e-5)


def test_cache_overrun_is_a_clear_error(rng):
    x = _x(rng, B, 4, D)
    module = nn.MultiHeadAttention(num_heads=N, is_causal=True, decode=True)
    variables = _init(module, rng, x)
    _, mutated = jax.jit(functools.partial(module.apply, mutable=["cache"]))(variables, x[:, :3])
    # Eager, as a user calls it: the cache index is concrete, so the overrun is raised.
    with pytest.raises(ValueError, match="KV cache overrun: 2 new tokens at position 3 exceed "
                                         "the cache length 4"):
        module.apply({"params": variables["params"], **mutated}, x[:, :2], mutable=["cache"])


def test_cache_overrun_under_jit_is_logged_not_an_internal_error(rng, caplog):
    """Under jit the cache index is a tracer: the overrun is reported by name (logger
    "attnjax", ERROR) when the step runs, the write stays inside the cache and the
    output stays finite, instead of an XLA INTERNAL error."""
    x = _x(rng, B, 4, D)
    module = nn.MultiHeadAttention(num_heads=N, is_causal=True, decode=True)
    variables = _init(module, rng, x)
    step = jax.jit(lambda cache, x: module.apply({"params": variables["params"], **cache}, x,
                                                 mutable=["cache"]))
    _, mutated = step({"cache": variables["cache"]}, x[:, :3])
    with caplog.at_level("ERROR", logger="attnjax"):
        out, mutated = step(dict(mutated), x[:, :2])
        jax.block_until_ready(out)
        jax.effects_barrier()
    assert "KV cache overrun: 2 new tokens at position 3 exceed the cache length 4" in caplog.text
    assert bool(jnp.all(jnp.isfinite(out)))
    assert mutated["cache"]["cached_key"].shape == variables["cache"]["cached_key"].shape
    # more tokens than the cache holds, wherever it starts: known while tracing, a named
    # error (it was lax.dynamic_update_slice's TypeError)
    with pytest.raises(ValueError, match="KV cache overrun: 5 new tokens at position any "
                                         "exceed the cache length 4"):
        step({"cache": variables["cache"]}, jnp.concatenate([x, x[:, :1]], axis=1))


def test_the_kept_memory_is_read_without_a_copy(rng):
    """cache_key_value keeps the projected memory `[B, K, H|V, S]`, the layout the
    products read on a CPU: a later step's compiled program copies neither (before, each
    step transposed both, 3 ms a step for the dates model's 1,000 sources)."""
    b, s, k, h = 3, 29, 2, 8
    module = nn.MultiHeadDotProductAttention(num_heads=4, num_kv_heads=k, qkv_features=4 * h,
                                             cache_key_value=True)
    x, memory = _x(rng, b, 1, D), _x(jax.random.fold_in(rng, 1), b, s, DK)
    mask = jnp.arange(s)[None, None, None] < jnp.array([s, 5, 11])[:, None, None, None]
    params = _init(module, rng, x, memory)["params"]
    first, kept = module.apply({"params": params}, x, memory, mask=mask, mutable=["cache"])
    assert kept["cache"]["projected_key"].shape == (b, k, h, s)
    assert kept["cache"]["projected_value"].shape == (b, k, h, s)

    def step(cache, x, memory):
        return module.apply({"params": params, **cache}, x, memory, mask=mask)

    later = jax.jit(step)(kept, x, memory)
    np.testing.assert_allclose(later, first, rtol=1e-6, atol=1e-6)
    program = jax.jit(step).lower(kept, x, memory).compile().as_text()
    moved = [line for line in program.splitlines()
             if re.search(rf"%\S*(transpose|copy)\S* = f32\[{b},{k},{h},{s}\]", line)]
    assert not moved, moved
    # The first step writes each kept array once, and its own products read that copy
    # (before: five arrays of that shape, a transposed copy for the products and a
    # bias-add and a copy for each kept one; the dates model's first step 23 -> 10 ms).
    program = jax.jit(lambda x, memory: module.apply(
        {"params": params}, x, memory, mask=mask, mutable=["cache"])).lower(
            x, memory).compile().as_text()
    entry = program[program.index("\nENTRY"):]
    written = re.findall(rf"\n\s*(?:ROOT )?%\S+ = f32\[{b},{k},{h},{s}\]", entry)
    assert len(written) == 2, written


def test_a_decode_cache_sized_by_init_decodes_the_memory_it_is_given(rng):
    """Transformer(decode=True).init sizes the cache with a stand-in source; its
    cross-attentions had kept that source's projected memory, and every step decoded it
    instead of the memory given (logits 1.2 off a full forward of the real source).
    Steps now equal the full forward; a step given another memory than the cache keeps
    projected is a named error."""
    config = nn.TransformerConfig(src_vocab_size=13, tgt_vocab_size=11, d_model=32,
                                  num_heads=4, d_ff=64, num_encoder_layers=1,
                                  num_decoder_layers=1, dropout_rate=0.0)
    model = nn.Transformer(config)
    generator = draws.host(int(jax.random.randint(rng, (), 0, 1 << 30)))
    src, stand_in = (jnp.asarray(generator.integers(3, 13, (2, 7)), jnp.int32)
                     for _ in range(2))
    tgt = jnp.asarray(generator.integers(3, 11, (2, 6)), jnp.int32)
    # (jitted, as a user runs them: one program each, not one per operation)
    params = jax.jit(model.init)(rng, src, tgt)["params"]
    full = jax.jit(model.apply)({"params": params}, src, tgt)
    decoder = model.clone(decode=True)
    cache = jax.jit(decoder.init)(rng, stand_in, tgt)["cache"]
    memory = jax.jit(functools.partial(model.apply, method=nn.Transformer.encode))(
        {"params": params}, src)
    step = jax.jit(lambda cache, token, memory: decoder.apply(
        {"params": params, "cache": cache}, token, memory,
        method=nn.Transformer.decode_logits, mutable=["cache"]))
    logits = []
    for i in range(tgt.shape[1]):
        out, variables = step(cache, tgt[:, i:i + 1], memory)
        cache = variables["cache"]
        logits.append(out)
    np.testing.assert_allclose(jnp.concatenate(logits, axis=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"inputs_k \[2, 3, 32\] is not the memory the cache "
                                         r"keeps projected \(batch \[2\], S=7\)"):
        step(cache, tgt[:, :1], memory[:, :3])


def test_one_query_reads_the_kept_memory_on_the_dense_kernel():
    """implementation=None reads the kept memory on the dense kernel even where keys
    this long would run chunked: the chunked kernel would copy the `[B, K, H, S]`
    memory into blocks at every step (3-10x slower). The first step, which projects
    the memory as `[B, S, K, H]`, keeps the rule."""
    b, s, k, h = 1, 16384, 8, 64   # 32 MiB of keys, all one example's: chunked
    x = jax.ShapeDtypeStruct((b, 1, k * h), jnp.float32)
    memory = jax.ShapeDtypeStruct((b, s, k * h), jnp.float32)

    def programs(implementation):
        module = nn.MultiHeadDotProductAttention(num_heads=k, cache_key_value=True,
                                                 implementation=implementation)
        params = jax.eval_shape(module.init, jax.random.key(0), x, memory)["params"]
        first = lambda params, x, memory: module.apply(  # noqa: E731
            {"params": params}, x, memory, mutable=["cache"])
        kept = jax.eval_shape(first, params, x, memory)[1]
        later = lambda params, kept, x, memory: module.apply(  # noqa: E731
            {"params": params, **kept}, x, memory)
        return (str(jax.make_jaxpr(first)(params, x, memory)),
                str(jax.make_jaxpr(later)(params, kept, x, memory)))

    (first, later), (first_dense, later_dense) = programs(None), programs("dense")
    assert later == later_dense
    assert first == programs("chunked")[0] != first_dense


def _equations(jaxpr, enclosing: str, inside: bool = False):
    """(equation, whether it lies inside an `enclosing` equation: a while loop, a cond)
    for every equation of a jaxpr and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _equations(sub, enclosing,
                                          inside or eqn.primitive.name == enclosing)


def test_a_step_within_the_cache_does_not_call_the_host(rng):
    """The overrun check calls the host only on an overrun: its callback sits in the
    branch of a cond (a callback per layer at every step cost 1 ms of a 9 ms dates
    decoding step)."""
    x = _x(rng, B, 4, D)
    module = nn.MultiHeadAttention(num_heads=N, is_causal=True, decode=True)
    variables = _init(module, rng, x)
    jaxpr = jax.make_jaxpr(lambda cache, x: module.apply(
        {"params": variables["params"], **cache}, x, mutable=["cache"]))(
        {"cache": variables["cache"]}, x[:, :1])

    in_cond = [inside for eqn, inside in _equations(jaxpr.jaxpr, "cond")
               if eqn.primitive.name == "debug_callback"]
    assert in_cond == [True]


def test_decoding_loops_call_no_host_so_jax_can_cache_their_programs(rng):
    """greedy_decode and generate size their caches for every token they append, so
    their steps leave out the overrun check: its host callback kept their programs out
    of jax's persistent compilation cache, and every run of the training command compiled
    its evaluation afresh. A step outside them still checks."""
    model = nn.Transformer(_transformer())
    src = _tokens(rng, B, S, 11)
    params = _init(model, rng, src, src[:, :3])["params"]
    lengths = jnp.array([S, 3], jnp.int32)
    decoder_only = nn.DecoderOnly(nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2,
                                                       d_ff=24, max_len=20))
    prompt = _tokens(jax.random.fold_in(rng, 1), B, 4, 13)
    lm_params = _init(decoder_only, rng, prompt)["params"]
    loops = {
        "greedy_decode": jax.make_jaxpr(lambda p, s, n: nn.greedy_decode(
            model, p, s, n, max_len=T, bos_id=1, eos_id=2))(params, src, lengths),
        "generate": jax.make_jaxpr(lambda p, x: nn.generate(
            decoder_only, p, x, max_new_tokens=5))(lm_params, prompt),
    }
    for name, jaxpr in loops.items():
        primitives = {eqn.primitive.name for eqn, _ in _equations(jaxpr.jaxpr, "while")}
        assert primitives & {"while", "scan"}, name    # the loop was looked into
        assert "debug_callback" not in primitives, name
    # the starting cache traced alone, as a server's loop that jits it does: its decoder
    # pass over one token (whose own cache is dropped) checks nothing either
    model = model.clone(deterministic=True)
    memory = model.apply({"params": params}, src, lengths, method=nn.Transformer.encode)
    start = jax.make_jaxpr(lambda p, m, n: decoding._start_cache(model, p, m, n, max_len=T))(
        params, memory, lengths)
    primitives = {eqn.primitive.name for eqn, _ in _equations(start.jaxpr, "cond")}
    assert {"dot_general", "debug_callback"} & primitives == {"dot_general"}
    # the check is back for a step the caller drives (sized_for_every_append ended)
    module = nn.MultiHeadAttention(num_heads=N, is_causal=True, decode=True)
    x = _x(rng, B, 4, D)
    variables = _init(module, rng, x)
    step = jax.make_jaxpr(lambda cache, x: module.apply(
        {"params": variables["params"], **cache}, x, mutable=["cache"]))(
        {"cache": variables["cache"]}, x[:, :1])
    assert "debug_callback" in {eqn.primitive.name for eqn, _ in _equations(step.jaxpr, "cond")}


def test_a_step_of_ones_own_traced_sized_calls_no_host_and_decodes_the_same(rng):
    """A decoding step the caller drives, decorated with nn.sized_for_every_append under
    jax.jit: every trace of it leaves out the overrun check, whose host callback keeps a
    program from jit's fast dispatch (one layer's token: 284 against 161 µs); token by
    token it gives the checked step's outputs and cache. The decorator's context ends
    with each trace: a step traced after it checks again. A sized step exports
    (jax.export)."""
    length = 4
    x = _x(rng, B, length, D)
    module = nn.MultiHeadAttention(num_heads=N, is_causal=True, decode=True)
    variables = _init(module, rng, x)

    def step(cache, token):
        return module.apply({"params": variables["params"], **cache}, token, mutable=["cache"])

    sized = nn.sized_for_every_append()(step)

    def callbacks(fn, trace=jax.make_jaxpr):
        jaxpr = trace(fn)({"cache": variables["cache"]}, x[:, :1])
        return [eqn for eqn, _ in _equations(jaxpr.jaxpr, "cond")
                if eqn.primitive.name == "debug_callback"]

    assert callbacks(sized) == []
    assert len(callbacks(step)) == 1
    caches = {name: {"cache": variables["cache"]} for name in ("checked", "sized")}
    for i in range(length):
        outs = {}
        for name, fn in (("checked", step), ("sized", sized)):
            outs[name], mutated = jax.jit(fn)(caches[name], x[:, i:i + 1])
            caches[name] = dict(mutated)
        np.testing.assert_allclose(outs["sized"], outs["checked"], rtol=1e-6, atol=1e-6)
    checked, kept = (jax.tree.leaves(caches[name]) for name in ("checked", "sized"))
    for a, b in zip(checked, kept, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(caches["sized"]["cache"]["cache_index"]) == length
    assert len(callbacks(step)) == 1
    # As a context manager, it holds for the calls inside it, of a step jitted and traced
    # before (jit's cache key holds the setting: the trace made outside was reused)
    jitted = jax.jit(step)
    traced = lambda: callbacks(jitted, lambda f: lambda *a: f.trace(*a).jaxpr)  # noqa: E731
    assert len(traced()) == 1
    with nn.sized_for_every_append():
        assert traced() == []
    assert len(traced()) == 1
    # and the way to jax.export a step: the sized one exports (the check's host
    # callback cannot be) and runs as traced
    cache = {"cache": variables["cache"]}
    out, mutated = jax.export.export(jax.jit(sized))(cache, x[:, :1]).call(cache, x[:, :1])
    want, want_cache = step(cache, x[:, :1])
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(mutated), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _loop_bodies(program: str) -> str:
    """The text of the while loops' bodies in a compiled HLO module."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", program))
    blocks = re.split(r"\n(?=\S)", program)
    return "\n".join(b for b in blocks if b.split(" ", 1)[0].lstrip("%") in bodies)


def test_greedy_decode_reads_the_kept_memory_in_its_loop_without_a_copy(rng):
    """In greedy_decode's compiled loop, the kept memory is read as it was stored: no
    step transposes it (XLA would otherwise carry it in its old layout through the loop
    and transpose it at every step, since it does not lift transposes out of loops)."""
    config = _transformer()
    model = nn.Transformer(config)
    src = _tokens(rng, B, S, 11)
    params = _init(model, rng, src, src[:, :3])["params"]
    program = jax.jit(functools.partial(
        decoding._greedy_decode, model, max_len=T, bos_id=1, eos_id=2, pad_id=0)).lower(
        params, src, jnp.array([S, 3], jnp.int32)).compile().as_text()
    n, h = config.num_heads, config.d_model // config.num_heads
    kept = rf"%\S*(transpose|copy)\S* = f32\[{B},{n},{h},{S}\]"
    assert re.search(kept, program), "the kept memory is laid out once, before the loop"
    moved = [line for line in _loop_bodies(program).splitlines() if re.search(kept, line)]
    assert not moved, moved


# --- learned scores ------------------------------------------------------------------


def test_general_and_additive_scores_against_hand_computed_values(rng):
    x = _x(rng, 1, 3, 8)
    for score in ("general", "additive"):
        module = nn.MultiHeadAttention(num_heads=2, score=score)
        params = _perturbed(_init(module, rng, x)["params"], rng)
        got = np.asarray(jax.jit(module.apply)({"params": params}, x), np.float64)
        p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
        xn = np.asarray(x[0], np.float64)
        q = np.einsum("td,dnh->tnh", xn, p["query"]["kernel"]) + p["query"]["bias"]
        k = np.einsum("td,dnh->tnh", xn, p["key"]["kernel"]) + p["key"]["bias"]
        v = np.einsum("td,dnh->tnh", xn, p["value"]["kernel"]) + p["value"]["bias"]
        heads = np.zeros_like(v)
        for n in range(2):
            logits = np.zeros((3, 3))
            for i in range(3):
                for j in range(3):
                    if score == "general":
                        logits[i, j] = q[i, n] @ p["score_w"][n] @ k[j, n]
                    else:
                        logits[i, j] = p["score_v"][n] @ np.tanh(
                            q[i, n] @ p["score_w_q"][n] + k[j, n] @ p["score_w_k"][n])
            w = np.exp(logits - logits.max(-1, keepdims=True))
            heads[:, n] = (w / w.sum(-1, keepdims=True)) @ v[:, n]
        expected = np.einsum("tnh,nhf->tf", heads, p["out"]["kernel"]) + p["out"]["bias"]
        np.testing.assert_allclose(got[0], expected, rtol=1e-5, atol=1e-5)


def test_dot_score_is_unscaled(rng):
    x = _x(rng, B, T, D)
    params = _init(nn.MultiHeadAttention(num_heads=N), rng, x)["params"]
    dot = jax.jit(nn.MultiHeadAttention(num_heads=N, score="dot").apply)({"params": params}, x)
    expected = jax.jit(functools.partial(attnjax.multi_head_attention, scale=1.0))(params, x)
    np.testing.assert_allclose(dot, expected, rtol=1e-6)


# --- models ----------------------------------------------------------------------------


def _transformer(**kw):
    return nn.TransformerConfig(src_vocab_size=11, tgt_vocab_size=13, d_model=16, num_heads=2,
                                num_encoder_layers=2, num_decoder_layers=2, d_ff=24, max_len=20,
                                **kw)


def _tokens(rng, b, length, vocab):
    return draws.randint(rng, (b, length), 1, vocab)


@pytest.mark.parametrize("pre_ln", [True, False])
def test_a_model_s_dtype_is_every_block_s_compute_dtype(rng, pre_ln):
    """dtype="bfloat16": every sublayer (attention, feed-forward, their layer norms and
    residual sums) of every block computes in bfloat16, as flax's dtype means, with
    float32 parameters and logits; the feed-forward and layer norms kept float32, and
    from the first block on the residual stream was float32. (Standard promotion: flax's
    LayerNorm promotes bfloat16 to float32 for its statistics.)"""
    model = nn.Transformer(_transformer(dtype="bfloat16", pre_ln=pre_ln, dropout_rate=0.0))
    src, tgt = _tokens(rng, B, S, 11), _tokens(jax.random.fold_in(rng, 1), B, T, 13)
    with as_users_run():
        params = _init(model, rng, src, tgt)["params"]
        logits, state = jax.jit(lambda p: model.apply(
            {"params": p}, src, tgt, capture_intermediates=True,
            mutable=["intermediates"]))(params)
    assert logits.dtype == jnp.float32
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    outputs = jax.tree_util.tree_flatten_with_path(state["intermediates"])[0]
    blocks = {jax.tree_util.keystr(path): x.dtype for path, x in outputs
              if "layer_" in jax.tree_util.keystr(path) or "ln_final" in jax.tree_util.keystr(path)}
    assert any("ffn'" in name for name in blocks) and any("'ln'" in name for name in blocks)
    assert set(blocks.values()) == {jnp.dtype(jnp.bfloat16)}, blocks


def test_sown_weights_have_a_shape_for_every_layer(rng):
    model = nn.Transformer(_transformer())
    src, tgt = _tokens(rng, B, S, 11), _tokens(jax.random.fold_in(rng, 1), B, T, 13)
    params = _init(model, rng, src, tgt)["params"]
    _, state = jax.jit(functools.partial(model.apply, sow_weights=True, deterministic=True,
                                         mutable=["intermediates"]))({"params": params}, src, tgt)
    maps = nn.attention_maps(state["intermediates"])
    expected = {f"encoder/layer_{i}/self": (B, 2, S, S) for i in range(2)}
    expected |= {f"decoder/layer_{i}/self": (B, 2, T, T) for i in range(2)}
    expected |= {f"decoder/layer_{i}/cross": (B, 2, T, S) for i in range(2)}
    assert {k: v.shape for k, v in maps.items()} == expected


def test_encoder_is_permutation_equivariant_without_positions(rng):
    model = nn.Transformer(_transformer(positional="none", dropout_rate=0.0))
    src = _tokens(rng, B, S, 11)
    params = _init(model, rng, src, src[:, :3])["params"]
    encode = jax.jit(lambda s: model.apply({"params": params}, s, method=nn.Transformer.encode))
    perm = draws.host(jax.random.fold_in(rng, 1)).permutation(S)
    np.testing.assert_allclose(encode(src[:, perm]), encode(src)[:, perm], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["transformer", "decoder_only"])
def test_every_parameter_receives_a_gradient(rng, which):
    if which == "transformer":
        model = nn.Transformer(_transformer(share_embeddings=False, positional="learned",
                                            num_kv_heads=1))
        src, tgt = _tokens(rng, B, S, 11), _tokens(jax.random.fold_in(rng, 1), B, 20, 13)
        args = (src, tgt)
    else:
        model = nn.DecoderOnly(nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2,
                                                    d_ff=24, max_len=20, positional="learned"))
        args = (_tokens(rng, B, 20, 13),)
    params = _init(model, rng, *args)["params"]

    def loss(params):
        logits = model.apply({"params": params}, *args, deterministic=False,
                             rngs={"dropout": jax.random.key(1)})
        return jnp.mean(jax.nn.log_softmax(logits)[..., 1])

    grads = jax.jit(jax.grad(loss))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    zero = [jax.tree_util.keystr(path) for path, g in flat if not jnp.any(g != 0)]
    assert not zero, f"parameters without gradient: {zero}"


def test_post_ln_and_pre_ln_differ_and_run(rng):
    src, tgt = _tokens(rng, B, S, 11), _tokens(jax.random.fold_in(rng, 1), B, T, 13)
    outs = []
    for pre_ln in (True, False):
        model = nn.Transformer(_transformer(pre_ln=pre_ln))
        params = _init(model, rng, src, tgt)["params"]
        outs.append(jax.jit(functools.partial(model.apply, deterministic=True))(
            {"params": params}, src, tgt))
        chex.assert_shape(outs[-1], (B, T, 13))
        chex.assert_tree_all_finite(outs[-1])
    assert not np.allclose(outs[0], outs[1])


def test_greedy_decode_matches_step_by_step_full_recomputation(rng):
    config = _transformer(num_kv_heads=1)
    model = nn.Transformer(config)
    src = _tokens(rng, B, S, 11)
    src_lengths = jnp.array([S, 4], jnp.int32)
    params = _perturbed(_init(model, rng, src, src[:, :3])["params"], rng, 0.5)
    out = nn.greedy_decode(model, params, src, src_lengths, max_len=6, bos_id=1, eos_id=2)
    chex.assert_shape(out, (B, 6))
    # Without the cache: feed the whole prefix every step, padded to one length (the
    # decoder is causal: what follows position i does not change its logits).
    full = jax.jit(lambda prefix: model.apply({"params": params}, src, prefix, src_lengths,
                                              deterministic=True))
    prefix = np.zeros((B, 7), np.int32)
    prefix[:, 0] = 1
    done = np.zeros(B, bool)
    for i in range(6):
        token = np.asarray(jnp.argmax(full(jnp.asarray(prefix))[:, i], -1))
        token = np.where(done, 0, token)
        done |= token == 2
        prefix[:, i + 1] = token
    np.testing.assert_array_equal(out, prefix[:, 1:])
    # a list, as src_lengths takes (an AttributeError had named nothing)
    np.testing.assert_array_equal(nn.greedy_decode(model, params, np.asarray(src).tolist(),
                                                   src_lengths.tolist(), max_len=6, bos_id=1,
                                                   eos_id=2), out)


def test_generate_greedy_matches_full_forward_and_sampling_uses_the_rng(rng):
    config = nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2, num_kv_heads=1,
                                  d_ff=24, max_len=20)
    model = nn.DecoderOnly(config)
    prompt = _tokens(rng, B, 4, 13)
    params = _perturbed(_init(model, rng, prompt)["params"], rng, 0.5)
    out = nn.generate(model, params, prompt, max_new_tokens=5)
    chex.assert_shape(out, (B, 9))
    np.testing.assert_array_equal(out[:, :4], prompt)
    # the whole sequence at once: causal, so position i − 1 predicts token i
    logits = jax.jit(lambda tokens: model.apply({"params": params}, tokens,
                                                deterministic=True))(out)
    np.testing.assert_array_equal(out[:, 4:], jnp.argmax(logits[:, 3:-1], -1))
    a = nn.generate(model, params, prompt, max_new_tokens=5, temperature=1.0, rng=jax.random.key(1))
    b = nn.generate(model, params, prompt, max_new_tokens=5, temperature=1.0, rng=jax.random.key(1))
    np.testing.assert_array_equal(a, b)
    # a NumPy number is a temperature too, the same one (it was refused as not a number)
    c = nn.generate(model, params, prompt, max_new_tokens=5, temperature=np.float32(1.0),
                    rng=jax.random.key(1))
    np.testing.assert_array_equal(a, c)
    # a temperature that overflows logits / temperature in float32 (1e-39), or is 0 there
    # (1e-300), samples the largest logit: greedy (it had sampled from inf and NaN)
    for tiny in (1e-39, 1e-300):
        np.testing.assert_array_equal(nn.generate(model, params, prompt, max_new_tokens=5,
                                                  temperature=tiny, rng=jax.random.key(2)), out)
    # a list, as prompt_lengths takes (an AttributeError had named nothing)
    np.testing.assert_array_equal(nn.generate(model, params, np.asarray(prompt).tolist(),
                                              max_new_tokens=5), out)


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_generate_fills_learned_positions_to_max_len(rng, padding_side):
    """The model reads the prompt and every new token but the last: with learned
    positions, P + max_new_tokens - 1 = max_len fits, its tokens those of the full
    forward over the max_len tokens read."""
    config = nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2, d_ff=24, max_len=9,
                                  positional="learned")
    model = nn.DecoderOnly(config)
    prompt = _tokens(rng, B, 4, 13)
    params = _perturbed(_init(model, rng, prompt)["params"], rng, 0.5)
    lengths = jnp.full((B,), 4, jnp.int32)      # every row whole: one layout either side
    out = nn.generate(model, params, prompt, lengths, max_new_tokens=6,
                      padding_side=padding_side)
    chex.assert_shape(out, (B, 10))
    logits = jax.jit(lambda tokens: model.apply({"params": params}, tokens,
                                                deterministic=True))(out[:, :9])
    np.testing.assert_array_equal(out[:, 4:], jnp.argmax(logits[:, 3:], -1))


def test_feed_forward_with_dropout_takes_deterministic_as_flax_modules_do(rng):
    """FeedForward with dropout needs deterministic, here or at the call, as the blocks
    and models do (its call's default had been True: dropout silently off in training)."""
    x = _x(draws.host(rng), B, T, D)
    ffn = nn.FeedForward(d_ff=16, dropout_rate=0.5)
    params = ffn.init(jax.random.fold_in(rng, 1), x)   # init needs none
    with pytest.raises(ValueError, match=r"FeedForward has dropout_rate=0.5, so "
                                         r"deterministic is required"):
        ffn.apply(params, x)
    evaluated = ffn.apply(params, x, deterministic=True)
    np.testing.assert_array_equal(
        nn.FeedForward(d_ff=16, dropout_rate=0.5, deterministic=True).apply(params, x),
        evaluated)
    dropped = [module.apply(params, x, rngs={"dropout": jax.random.fold_in(rng, 2)}, **kw)
               for module, kw in ((ffn, dict(deterministic=False)),
                                  (ffn.clone(deterministic=False), {}))]
    np.testing.assert_array_equal(dropped[0], dropped[1])
    assert np.abs(np.asarray(dropped[0] - evaluated)).max() > 1e-3
    # without dropout, deterministic may be left out
    plain = nn.FeedForward(d_ff=16)
    np.testing.assert_array_equal(plain.apply(params, x), evaluated)


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_model=10, num_heads=4), "d_model must be divisible by num_heads"),
    (dict(num_kv_heads=3), "num_kv_heads must be a positive divisor of num_heads=4"),
    (dict(dropout_rate=1.5), r"dropout_rate must lie in \[0, 1\); got 1.5"),
    (dict(positional="rotary"), "positional must be one of"),
    (dict(num_encoder_layers=0), "num_encoder_layers must be a positive int; got 0"),
    (dict(share_embeddings=True), "share_embeddings needs src_vocab_size == tgt_vocab_size"),
    (dict(activation="swish"), "activation must be one of"),
    (dict(attention_soft_cap=0.0), "attention_soft_cap: soft_cap needs a positive finite cap"),
])
def test_config_errors(kwargs, message):
    base = dict(src_vocab_size=11, tgt_vocab_size=13, num_heads=4)
    with pytest.raises(ValueError, match=message):
        nn.TransformerConfig(**(base | kwargs))


@pytest.mark.usefixtures("own_checks_only")   # as users run it: no runtime type checks
def test_config_numbers_of_any_kind_are_stored_as_python_s():
    """A NumPy or jax number in a config is stored as Python's: np.float32(0.1) as a
    rate had been refused ("must lie in [0, 1)"), jnp.float32(5.0) as a cap made the
    config unhashable (a module's static argument), np.int64 widths were kept as such."""
    plain = nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2, dropout_rate=0.1,
                                 attention_soft_cap=5.0)
    numpy_numbers = nn.DecoderOnlyConfig(
        vocab_size=np.int64(13), d_model=np.int32(16), num_heads=2,
        dropout_rate=np.float32(0.1), attention_soft_cap=jnp.float32(5.0))
    assert numpy_numbers == plain and hash(numpy_numbers) == hash(plain)
    assert repr(numpy_numbers) == repr(plain)
    assert (type(numpy_numbers.d_model), type(numpy_numbers.dropout_rate)) == (int, float)
    with pytest.raises(ValueError, match=r"dropout_rate must lie in \[0, 1\); got 1.5"):
        nn.DecoderOnlyConfig(vocab_size=13, num_heads=2, dropout_rate=np.float32(1.5))


@pytest.mark.usefixtures("own_checks_only")
@pytest.mark.parametrize("kwargs, message", [
    # a switch is a bool ("no" had built pre-LN), a count is not
    (dict(pre_ln="no"), r"TransformerConfig.pre_ln must be a bool \(True or False\); got 'no'"),
    (dict(attention_sinks=1), r"TransformerConfig.attention_sinks must be a bool"),
    (dict(num_kv_heads=True), "num_kv_heads must be a positive divisor of num_heads=4; got True"),
])
def test_config_types_as_users_without_type_checks_meet_them(kwargs, message):
    base = dict(src_vocab_size=11, tgt_vocab_size=13, num_heads=4)
    with pytest.raises(ValueError, match=message):
        nn.TransformerConfig(**(base | kwargs))


def _dot_products_in_loop(closed) -> int:
    """dot_generals inside the while loops of a jaxpr: the work of every step."""
    return sum(inside for eqn, inside in _equations(closed.jaxpr, "while")
               if eqn.primitive.name == "dot_general")


def test_greedy_decode_projects_the_memory_once(rng):
    """The cross-attentions keep the projected memory in the cache: the same tokens as
    projecting it every step, with two fewer products per layer in each step."""
    config = _transformer(num_kv_heads=1)
    model = nn.Transformer(config)
    src = _tokens(rng, B, S, 11)
    src_lengths = jnp.array([S, 3], jnp.int32)
    params = _perturbed(_init(model, rng, src, src[:, :3])["params"], rng, 0.5)
    kwargs = dict(max_len=7, bos_id=1, eos_id=2, pad_id=0)
    once = nn.greedy_decode(model, params, src, src_lengths, **kwargs)
    every = nn.greedy_decode(model, params, src, src_lengths, memory_cache=False, **kwargs)
    np.testing.assert_array_equal(once, every)
    products = [_dot_products_in_loop(jax.make_jaxpr(functools.partial(
        decoding._greedy_decode, model, memory_cache=cached, **kwargs))(params, src, src_lengths))
        for cached in (True, False)]
    assert products[1] - products[0] == 2 * config.num_decoder_layers, products
    with own_checks_only(), pytest.raises(TypeError, match="memory_cache must be a bool"):
        nn.greedy_decode(model, params, src, src_lengths, memory_cache="yes", **kwargs)
    # the other kind of model (an AttributeError of its config had named nothing)
    with own_checks_only(), pytest.raises(TypeError, match=r"^generate takes an attnjax.nn."
                                                           r"DecoderOnly; got Transformer"):
        nn.generate(model, params, src, max_new_tokens=2)
    lm = nn.DecoderOnly(nn.DecoderOnlyConfig(vocab_size=16, d_model=32, num_heads=4, d_ff=64))
    with own_checks_only(), pytest.raises(TypeError, match=r"^greedy_decode takes an attnjax.nn."
                                                           r"Transformer; got DecoderOnly"):
        nn.greedy_decode(lm, params, src, src_lengths, **kwargs)


def _compiled_products_outside_loops(hlo: str) -> int:
    """The products of a compiled program that run once: in its entry computation and
    the computations it calls, but not in a while loop's body or condition."""
    computations, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?(%[\w.\-]+) .*\{$", line)
        if header:
            name = "ENTRY" if line.startswith("ENTRY") else header.group(1)
            computations[name] = []
        elif name is not None:
            computations[name].append(line)

    def count(name):
        lines = computations[name]
        called = [c for line in lines
                  for c in re.findall(r"(?:calls|to_apply)=(%[\w.\-]+)", line)]
        return sum(" dot(" in line for line in lines) + sum(map(count, called))
    return count("ENTRY")


def test_greedy_decode_compiles_one_decoder_step(rng):
    """The memory is projected before the loop by a decoder pass of which only those
    projections are compiled: outside its loop, the compiled decoding holds the
    encoder's products and two per decoder layer (a first step outside the loop held
    the whole decoder's)."""
    # the model and shapes of the test above, whose program the suite's cache holds
    config = _transformer(num_kv_heads=1)
    model = nn.Transformer(config)
    src = _tokens(rng, B, S, 11)
    src_lengths = jnp.array([S, 3], jnp.int32)
    params = _init(model, rng, src, src[:, :3])["params"]
    kwargs = dict(max_len=7, bos_id=1, eos_id=2, pad_id=0)
    hlo = decoding._greedy_decode.lower(model, params, src, src_lengths,
                                        **kwargs).compile().as_text()
    encoder = jax.jit(functools.partial(model.clone(deterministic=True).apply,
                                        method=nn.Transformer.encode)).lower(
        {"params": params}, src, src_lengths).compile().as_text()
    assert _compiled_products_outside_loops(encoder) > 0
    assert (_compiled_products_outside_loops(hlo)
            == _compiled_products_outside_loops(encoder) + 2 * config.num_decoder_layers)


def test_decoding_refuses_packed_rows(rng, own_checks_only):
    """A decode=True call with segment ids had failed inside the attention, naming
    `key_ids` (an argument of attnjax.segments a model user cannot pass) for any prefill
    shorter than the cache: packed rows are for training and scoring, and each row of a
    cache is one sequence. Both models now refuse them, naming their own argument."""
    generator = draws.host(int(jax.random.randint(rng, (), 0, 1 << 30)))
    tokens = jnp.asarray(generator.integers(0, 13, (2, 5)), jnp.int32)
    ids = jnp.asarray(np.sort(generator.integers(0, 2, (2, 5)), axis=1), jnp.int32)
    lm = nn.DecoderOnly(nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2, d_ff=24,
                                             num_layers=1, dropout_rate=0.0))
    params = lm.init(rng, tokens)["params"]
    packed = lm.apply({"params": params}, tokens, segment_ids=ids)
    assert packed.shape == (2, 5, 13) and bool(jnp.isfinite(packed).all())
    cache = lm.clone(decode=True).init(rng, jnp.zeros((2, 8), jnp.int32))["cache"]
    with pytest.raises(ValueError, match=r"segment_ids packs several sequences into a row, "
                                         r"for training and scoring; with decode=True each "
                                         r"row of the cache is one sequence"):
        lm.clone(decode=True).apply({"params": params, "cache": cache}, tokens,
                                    segment_ids=ids, mutable=["cache"])
    model = nn.Transformer(nn.TransformerConfig(
        src_vocab_size=13, tgt_vocab_size=13, d_model=16, num_heads=2, d_ff=24,
        num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0))
    params = model.init(rng, tokens, tokens)["params"]
    decoder = model.clone(decode=True)
    cache = decoder.init(rng, tokens, jnp.zeros((2, 8), jnp.int32))["cache"]
    memory = model.apply({"params": params}, tokens, src_segment_ids=ids,
                         method=nn.Transformer.encode)
    with pytest.raises(ValueError, match=r"tgt_segment_ids packs several sequences into a "
                                         r"row.*call without tgt_segment_ids"):
        decoder.apply({"params": params, "cache": cache}, tokens, memory,
                      tgt_segment_ids=ids, src_segment_ids=ids,
                      method=nn.Transformer.decode_logits, mutable=["cache"])
