"""Sharded training: data- and model-parallel runs on 4 emulated devices, and two
processes on 127.0.0.1 (gloo), each matching a one-device run step for step. (One of
two processes killed or signalled: test_faults.py.)"""

import contextlib
import functools
import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from attnjax import chunked
from attnjax.parallel import mesh as mesh_lib
from attnjax.toy import cli, make_task
from attnjax.toy import train as training
from attnjax.toy.config import load_config
from tests import children, training_run
from tests.numerics import USERS_RANDOM_BITS, as_users_run, users_random_bits

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest "
                                "sets --xla_force_host_platform_device_count=4)")

ROOT = Path(__file__).resolve().parents[1]
# Every step logged (log_every=1) so the losses compare step by step; dropout on, so the
# random streams must agree under sharding too.
PARALLEL = ["task.num_symbols=5", "task.min_len=1", "task.max_len=6", "task.eval_size=200",
            "model.d_model=32", "model.num_heads=4", "model.d_ff=64",
            "model.num_encoder_layers=1", "model.num_decoder_layers=1", "model.max_len=16",
            "model.dropout_rate=0.1", "optim.warmup_steps=10", "batch_size=32", "log_every=1",
            "eval_batch_size=100"]


def config(steps: int):
    return load_config(ROOT / "configs" / "copy.yaml",
                       PARALLEL + [f"steps={steps}", f"eval_every={steps}",
                                   f"checkpoint_every={steps}"])


def _losses(workdir: Path) -> np.ndarray:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
    return np.array([r["loss"] for r in records if "loss" in r])


@pytest.fixture(scope="module")
def one_device():
    """Losses of a one-device run of 50 steps (the loss of every step, as a run with
    log_every=1 logs them; no evaluation, checkpoints or files)."""
    with as_users_run(), users_random_bits():
        return training_run.losses(config(50), children.one_device_mesh())


@pytest.mark.parametrize("shape", [{"data": 4}, {"data": 2, "model": 2}])
def test_sharded_training_matches_one_device(tmp_path, one_device, float32, shape):
    mesh = mesh_lib.make_mesh(shape, jax.devices()[:4])
    with users_random_bits():
        cli.run(config(50), tmp_path, mesh=mesh, interactive=False)
    losses = _losses(tmp_path)
    assert len(losses) == 50 and losses[-1] < losses[0]
    np.testing.assert_allclose(losses, one_device, rtol=0, atol=1e-5)


def test_parameters_are_split_in_the_megatron_layout(float32):
    c = config(50)
    mesh = mesh_lib.make_mesh({"data": 2, "model": 2}, jax.devices()[:4])
    task = make_task(c.task)
    model = training.make_model(c, task)
    optimizer = training.make_optimizer(c.optim, c.steps)
    state = training.init_state(model, optimizer, task, c.seed, mesh)
    attention = state.params["encoder"]["layer_0"]["self"]
    ffn = state.params["encoder"]["layer_0"]["ffn"]
    expected = {
        "query kernel": (attention["query"]["kernel"], PartitionSpec(None, "model", None)),
        "out kernel": (attention["out"]["kernel"], PartitionSpec("model", None, None)),
        "ffn in": (ffn["wi"]["kernel"], PartitionSpec(None, "model")),
        "ffn out": (ffn["wo"]["kernel"], PartitionSpec("model", None)),
        "layer norm": (state.params["encoder"]["ln_final"]["scale"], PartitionSpec()),
    }
    for name, (array, spec) in expected.items():
        assert array.sharding.spec == spec, name
    # each device holds half the heads of a [D=32, N=4, H=8] kernel, and half of the FFN
    assert {s.data.shape for s in attention["query"]["kernel"].addressable_shards} == {(32, 2, 8)}
    assert {s.data.shape for s in ffn["wi"]["kernel"].addressable_shards} == {(32, 32)}
    # Adam's moments follow their parameters
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state)
               if leaf.shape == attention["query"]["kernel"].shape]
    assert moments and all(m.sharding.spec == PartitionSpec(None, "model", None)
                           for m in moments)


def test_an_nnx_state_is_split_as_its_linen_tree(rng):
    """mesh.shardings of an nnx model's State (leaves under a Variable's "value") gives
    each parameter the Megatron split its linen tree gets (every leaf had been
    replicated, silently); and a linen kernel with a head axis annotated by
    nn.with_partitioning initialises under jax.set_mesh, the annotation its own (it had
    been applied to the flattened matrix flax's initialiser sees: a ValueError)."""
    import flax.linen as flax_nn
    from flax import nnx

    import attnjax.nnx
    from attnjax import nn

    config = nn.DecoderOnlyConfig(vocab_size=16, d_model=8, num_heads=2, d_ff=16,
                                  num_layers=1)
    model = attnjax.nnx.DecoderOnly(config, rngs=nnx.Rngs(int(jax.random.randint(
        rng, (), 0, 1000))))
    mesh = mesh_lib.make_mesh({"data": 2, "model": 2}, jax.devices()[:4])
    by_state = mesh_lib.shardings(nnx.state(model, nnx.Param), mesh)
    by_linen = mesh_lib.shardings(attnjax.nnx.to_linen_params(model), mesh)
    specs = {jax.tree_util.keystr(path[:-1]): sharding.spec
             for path, sharding in jax.tree_util.tree_leaves_with_path(by_state)}
    assert specs == {jax.tree_util.keystr(path): sharding.spec
                     for path, sharding in jax.tree_util.tree_leaves_with_path(by_linen)}
    assert PartitionSpec(None, "model", None) in specs.values()
    x = jax.random.normal(rng, (4, 4, 8), jnp.float32)
    split = flax_nn.with_partitioning(flax_nn.initializers.lecun_normal(), (None, "model", None))
    module = nn.MultiHeadDotProductAttention(num_heads=4, kernel_init=split)
    auto = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(auto):
        variables = jax.jit(module.init)(rng, x)
    kernel = variables["params"]["query"]["kernel"]
    assert kernel.names == (None, "model", None)
    np.testing.assert_array_equal(kernel.value, nn.MultiHeadDotProductAttention(
        num_heads=4).init(rng, x)["params"]["query"]["kernel"])


def test_mesh_errors():
    with pytest.raises(ValueError, match="the mesh {'data': 3} needs 3 devices; there are 4"):
        mesh_lib.make_mesh({"data": 3}, jax.devices()[:4])
    for text in ("data=2,heads=2", "data=²", "data=٢"):   # digits int() refuses, or reads
        with pytest.raises(ValueError, match="--mesh expects axis=size pairs"):
            mesh_lib.parse_mesh(text)
    assert mesh_lib.parse_mesh("data=2,model=2") == {"data": 2, "model": 2}
    with pytest.raises(ValueError, match=r"query/kernel \(32, 2, 16\) is split over model=4, "
                                         r"which must divide its size 2"):
        mesh_lib.shardings({"query": {"kernel": np.zeros((32, 2, 16))}},
                           mesh_lib.make_mesh({"model": 4}, jax.devices()[:4]))
    with pytest.raises(cli.ConfigError, match="batch_size=30 must be divisible by the mesh's "
                                              "data axis \\(4 devices\\)"):
        cli.run(load_config(None, ["batch_size=30"]), Path("unused"),
                mesh=mesh_lib.make_mesh(devices=jax.devices()[:4]))


def test_two_processes_match_one_process(tmp_path, one_device):
    processes = children.processes_of_one_run(
        tmp_path, PARALLEL + ["steps=50", "eval_every=50", "checkpoint_every=20"],
        env=USERS_RANDOM_BITS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        outputs = [p.communicate(timeout=240)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, output in zip(processes, outputs):
        assert p.returncode == 0, output[-3000:]
    assert "held-out exact match" in outputs[0]
    losses = _losses(tmp_path)
    assert len(losses) == 50
    np.testing.assert_allclose(losses, one_device, rtol=0, atol=1e-5)
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                  if p.name.isdigit()) == [20, 40, 50]


def test_functions_of_the_indices_on_explicit_meshes(rng, own_compiled_programs):
    """On a mesh of Explicit axes, batch and heads sharded in their types: a score_mod
    and a from_fn mask that index arrays by the example and the head (scores.alibi's
    slopes[n], a traced table[n], lengths[b]) run in both kernels, values and
    gradients (into q, k, v, the slopes and the table) those of the unsharded call
    (such gathers had been jax's ShardingTypeError). And arrays put on such a mesh
    without jax.set_mesh run as jax.nn's do (a bare PartitionSpec had needed it)."""
    import attnjax
    from attnjax import masks, scores

    keys = jax.random.split(rng, 5)
    q = jax.random.normal(keys[0], (4, 8, 4, 8), jnp.float32)
    k, v = (jax.random.normal(key, (4, 8, 2, 8), jnp.float32) for key in keys[1:3])
    table = jax.random.normal(keys[3], (4,), jnp.float32)
    slopes = jax.random.uniform(keys[4], (4,), jnp.float32, 0.1, 1.0)
    lengths = jnp.asarray([3, 8, 5, 1], jnp.int32)

    def loss(q, k, v, slopes, table, implementation, lengths=lengths):
        out = attnjax.dot_product_attention(
            q, k, v, is_causal=True, implementation=implementation,
            block_sizes=(4, 4) if implementation == "chunked" else None,
            score_mod=lambda s, b, n, i, j: (scores.alibi(slopes)(s, b, n, i, j)
                                             + table[n] * lengths[b].astype(s.dtype)),
            mask=masks.from_fn(lambda b, n, i, j: j < lengths[b] + 2))
        return jnp.sum(out * jnp.sin(out))

    grads = jax.value_and_grad(loss, argnums=range(5))
    want_value, want = grads(q, k, v, slopes, table, "dense")
    mesh = jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    spec = PartitionSpec("data", None, "model", None)
    with jax.set_mesh(mesh):
        sq, sk, sv = (jax.device_put(a, spec) for a in (q, k, v))
        for implementation in ("dense", "chunked"):
            value, got = jax.jit(grads, static_argnums=5)(sq, sk, sv, slopes, table,
                                                          implementation)
            np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-5)
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
            assert got[0].sharding.spec == spec
        # the functions' arrays on the mesh too (made under jax.set_mesh), traced by the
        # jit or closed over as they are: they had carried the mesh's Explicit axes into
        # the kernel's Auto context ("context mesh should match")
        on_mesh = [jax.device_put(a, PartitionSpec()) for a in (slopes, table, lengths)]
        for implementation, call in (
                ("dense", lambda *a: grads(*a[:5], "dense", a[5])),
                ("chunked", lambda *a: grads(*a[:5], "chunked", lengths=on_mesh[2]))):
            value, got = jax.jit(call)(sq, sk, sv, *on_mesh)
            np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-5)
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=implementation)
        # lengths split by examples, which jax cannot index by one example's b: named
        split = jax.device_put(lengths, PartitionSpec("data"))
        with pytest.raises(ValueError, match="score_mod function closes over an array split"):
            loss(sq, sk, sv, slopes, table, "dense", lengths=split)
        # the same where the inputs' batch and heads are whole (had been jax's error)
        whole = [jax.device_put(a, PartitionSpec()) for a in (q, k, v)]
        with pytest.raises(ValueError, match="score_mod function closes over an array split"):
            loss(*whole, slopes, table, "dense", lengths=split)
        # operations whose types the mesh's axes entered as they were traced there (a
        # broadcast, a reshard, indices of two shapes): a learned relative-position
        # table, a from_fn of document ids; values and gradients as unsharded
        rpb = lambda q, k, v, t: jnp.sum(jnp.sin(attnjax.dot_product_attention(  # noqa: E731
            q, k, v, score_mod=scores.relative_position_bias(t, num_buckets=4,
                                                             max_distance=8))))
        want_table = jax.grad(rpb, argnums=3)(q, k, v, table[None] + slopes[:, None])
        got_table = jax.jit(jax.grad(rpb, argnums=3))(sq, sk, sv, jax.device_put(
            table[None] + slopes[:, None], PartitionSpec()))
        np.testing.assert_allclose(got_table, want_table, rtol=1e-4, atol=1e-5)
        docs = np.sort(np.random.default_rng(3).integers(0, 3, (4, 8)), axis=1)
        ids = jnp.asarray(docs)
        np.testing.assert_allclose(
            attnjax.dot_product_attention(sq, sk, sv, mask=masks.from_fn(
                lambda b, n, i, j: ids[b, i] == ids[b, j])),
            attnjax.dot_product_attention(q, k, v, mask=docs[:, None, :, None] == docs[
                :, None, None, :]), rtol=1e-5, atol=1e-6)
        # control flow, and custom derivatives (whose rules were traced on the mesh's
        # Explicit axes: inlined, jax.nn.relu's gradient at 0 had differed), are named
        for mod, what in ((lambda s, b, n, i, j: jax.lax.cond(
                n > 0, lambda: s + on_mesh[1][n], lambda: s), "cond"),
                          (lambda s, b, n, i, j: s + jax.nn.relu(on_mesh[1][n]), "custom_jvp")):
            with pytest.raises(TypeError, match=f"without control flow or custom derivatives; "
                                                f"got {what}"):
                attnjax.dot_product_attention(sq, sk, sv, score_mod=mod)
        # inside a jax.shard_map manual over "data" only, heads still sharded in their
        # type ("data" stays manual: only the Explicit axes turn Auto)
        attend = functools.partial(attnjax.dot_product_attention,
                                   score_mod=scores.alibi(slopes))
        expected = attend(q, k, v)
        for implementation in ("dense", "chunked"):
            inner = jax.shard_map(functools.partial(attend, implementation=implementation),
                                  in_specs=PartitionSpec("data"),
                                  out_specs=PartitionSpec("data"), axis_names={"data"})
            np.testing.assert_allclose(jax.jit(inner)(sq, sk, sv), expected,
                                       rtol=1e-5, atol=1e-6)
        # scores' own tables made inside the block, closed over as a user's arrays are
        # (they had carried the mesh's Explicit axes into the kernel that runs them Auto:
        # "context mesh should match")
        mod = scores.chain(scores.alibi(scores.alibi_slopes(4)), scores.relative_position_bias(
            jnp.asarray(table[None] + slopes[:, None]), num_buckets=4, max_distance=8))
        for implementation in ("dense", "chunked"):
            np.testing.assert_allclose(
                attnjax.dot_product_attention(sq, sk, sv, score_mod=mod,
                                              implementation=implementation),
                attnjax.dot_product_attention(q, k, v, score_mod=mod,
                                              implementation=implementation),
                rtol=1e-5, atol=1e-6, err_msg=implementation)
    # outside jax.set_mesh: arrays put on the mesh, batch and heads or the sequence
    # sharded, eager and under jit
    expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    on_mesh = jax.sharding.NamedSharding(mesh, spec)
    sq, sk, sv = (jax.device_put(a, on_mesh) for a in (q, k, v))
    for implementation in ("dense", "chunked"):
        call = functools.partial(attnjax.dot_product_attention, is_causal=True,
                                 implementation=implementation)
        np.testing.assert_allclose(call(sq, sk, sv), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(jax.jit(call)(sq, sk, sv), expected, rtol=1e-5, atol=1e-6)
    got = jax.jit(jax.grad(loss, argnums=range(5)), static_argnums=5)(
        sq, sk, sv, slopes, table, "chunked")
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    by_sequence = jax.sharding.NamedSharding(mesh, PartitionSpec("data", "model"))
    np.testing.assert_allclose(
        attnjax.dot_product_attention(*(jax.device_put(a, by_sequence) for a in (q, k, v)),
                                      is_causal=True), expected, rtol=1e-5, atol=1e-6)


def test_layers_train_on_explicit_meshes(rng, own_compiled_programs):
    """Training an attention layer and a feed-forward on a mesh of Explicit axes, the
    batch on "data": gradients (of the parameters and the inputs) those of the
    unsharded step, with the parameters replicated or in the Megatron layout by heads
    and hidden units (the projections' kernel gradient had been jax's
    ShardingTypeError at a reshape; the output projections, which sum over the split
    axis, one asking where the sum goes), under jax.set_mesh and without; and
    cross-attention on inputs made without the mesh."""
    from attnjax import nn, scores

    x = jax.random.normal(rng, (4, 6, 16), jnp.float32)
    attention = nn.MultiHeadDotProductAttention(
        num_heads=4, num_kv_heads=2, score_mod=scores.alibi(scores.alibi_slopes(4)))
    feed_forward = nn.FeedForward(d_ff=32)
    keys = jax.random.split(rng, 2)
    params = {"attention": attention.init(keys[0], x)["params"],
              "feed_forward": feed_forward.init(keys[1], x)["params"]}

    def loss(params, x):
        y = attention.apply({"params": params["attention"]}, x, is_causal=True)
        return jnp.sum(feed_forward.apply({"params": params["feed_forward"]}, y) ** 2)

    grads = jax.grad(loss, argnums=(0, 1))
    want = grads(params, x)
    mesh = jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    on_mesh = functools.partial(jax.sharding.NamedSharding, mesh)
    megatron = jax.tree_util.tree_map_with_path(
        lambda path, leaf: on_mesh(mesh_lib.partition_spec(path, leaf)), params)
    assert megatron["attention"]["out"]["kernel"].spec == PartitionSpec("model", None, None)
    for layout, context in ((megatron, jax.set_mesh(mesh)),
                            (jax.tree.map(lambda _: on_mesh(PartitionSpec()), params),
                             contextlib.nullcontext())):
        with context:
            got = jax.jit(grads)(jax.device_put(params, layout),
                                 jax.device_put(x, on_mesh(PartitionSpec("data"))))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
        assert got[1].sharding.spec[0] == "data"
    # cross-attention in the Megatron layout without jax.set_mesh, its keys' inputs made
    # without the mesh: their gradient, a sum over the split heads, had been jax's
    # ShardingTypeError (flax's own class fails its forward pass there)
    memory = jax.random.normal(keys[1], (4, 5, 16), jnp.float32)

    def cross(params, x, memory):
        return jnp.sum(attention.apply({"params": params}, x, memory) ** 2)

    cross_grads = jax.grad(cross, argnums=(0, 1, 2))
    want = cross_grads(params["attention"], x, memory)
    got = jax.jit(cross_grads)(jax.device_put(params["attention"], megatron["attention"]),
                               jax.device_put(x, on_mesh(PartitionSpec("data"))), memory)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_models_train_on_explicit_meshes(rng, own_compiled_programs):
    """The models (linen and nnx) on a mesh of Explicit axes, tokens and positions split
    by examples on "data": gradients those of the unsharded step, parameters in the
    Megatron layout (under jax.set_mesh) or replicated (nnx's, without it). (flax's
    token lookup, and the learned positions', had been jax's ShardingTypeError: a
    gather by sharded ids; nnx's output projections' sums over split heads and hidden
    units in the Megatron layout, too.) And decoding on the KV cache (linen's generate,
    nnx's steps)."""
    from flax import nnx

    import attnjax.nnx
    from attnjax import nn

    keys = jax.random.split(rng, 3)
    tokens = jax.random.randint(keys[0], (4, 8), 0, 16)
    positions = jnp.sort(jax.random.randint(keys[1], (4, 8), 0, 16), axis=1)
    kw = dict(d_model=32, num_heads=4, num_kv_heads=2, d_ff=64, max_len=16,
              positional="learned")
    lm_config = nn.DecoderOnlyConfig(vocab_size=16, num_layers=1, **kw)
    linen_lm = nn.DecoderOnly(lm_config)
    graphdef, state = nnx.split(attnjax.nnx.DecoderOnly(lm_config, rngs=nnx.Rngs(3)))

    def score(logits):
        return jnp.sum(jax.nn.log_softmax(logits) ** 2)

    losses = {
        "linen DecoderOnly": (lambda p, t, q: score(linen_lm.apply(
            {"params": p}, t, positions=q, deterministic=True)),
            linen_lm.init(keys[2], tokens)["params"]),
        "nnx DecoderOnly": (lambda p, t, q: score(nnx.merge(graphdef, p)(
            t, positions=q, deterministic=True)), state)}
    mesh = jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    on_mesh = functools.partial(jax.sharding.NamedSharding, mesh)
    by_example = on_mesh(PartitionSpec("data"))
    for name, megatron in (("linen DecoderOnly", True), ("nnx DecoderOnly", True),
                           ("nnx DecoderOnly", False)):
        loss, params = losses[name]
        want = jax.grad(loss)(params, tokens, positions)
        layout = jax.tree_util.tree_map_with_path(lambda path, leaf: on_mesh(
            mesh_lib.partition_spec(path, leaf) if megatron else PartitionSpec()), params)
        with jax.set_mesh(mesh) if megatron else contextlib.nullcontext():
            got = jax.jit(jax.grad(loss))(jax.device_put(params, layout),
                                          jax.device_put(tokens, by_example),
                                          jax.device_put(positions, by_example))
        # (atol on the largest gradient's scale: the key bias's is zero to rounding)
        scale = max(float(jnp.abs(w).max()) for w in jax.tree.leaves(want))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * scale, err_msg=name)
    # generation on the KV cache, the prompt split by examples (its cache had been made
    # without a sharding, and the first keys written to it were jax's ShardingTypeError)
    params = losses["linen DecoderOnly"][1]
    want = nn.generate(linen_lm, params, tokens[:, :4], max_new_tokens=3)
    with jax.set_mesh(mesh):
        got = nn.generate(linen_lm, params, jax.device_put(tokens[:, :4], by_example),
                          max_new_tokens=3)
    np.testing.assert_array_equal(got, want)
    assert got.sharding.spec[0] == "data"
    # nnx's decoding, its cache sized by init_cache (made without a sharding): the
    # prompt, then a token at a time, as the whole sequence
    model = attnjax.nnx.DecoderOnly(lm_config, decode=True, rngs=nnx.Rngs(3))
    model.init_cache(4, 8)
    want = nnx.merge(graphdef, state)(tokens[:, :6], deterministic=True)
    with jax.set_mesh(mesh):
        split = jax.device_put(tokens[:, :6], by_example)
        step = nnx.jit(lambda model, tokens: model(tokens, deterministic=True))
        got = jnp.concatenate([step(model, split[:, :3])] + [
            step(model, split[:, i:i + 1]) for i in range(3, 6)], axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert got.sharding.spec[0] == "data"


def test_arrays_of_one_call_sharded_differently_run_as_jax_nn_s(rng, own_compiled_programs):
    """On a mesh of Explicit axes, the arrays of one call split differently: keys and
    values split by examples beside a query that is not, or only the key lengths split,
    or segment ids and a bias split along the sequence. jax.nn's
    call runs (where it takes the arrays); attnjax's had been jax's errors (vmap's
    "should be sharded the same", the chunked kernel's loop carries, its backward's
    update of an unsplit accumulator by a split one). Values and gradients are the
    unsharded call's, the results sharded as the query; and greedy decoding of a split
    source with split lengths, under jax.set_mesh and without it (the decoder's tokens,
    made unsplit, had met the split memory), and generation of a split prompt with its
    lengths."""
    import attnjax
    from attnjax import masks, nn

    keys = jax.random.split(rng, 5)
    q = jax.random.normal(keys[0], (4, 6, 4, 8), jnp.float32)
    k, v = (jax.random.normal(key, (4, 5, 4, 8), jnp.float32) for key in keys[1:3])
    lengths = jax.random.randint(keys[3], (4,), 1, 6)
    mesh = jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    by_example = jax.sharding.NamedSharding(mesh, PartitionSpec("data"))

    def loss(q, k, v, lengths, implementation):
        out = attnjax.dot_product_attention(q, k, v, key_lengths=lengths,
                                            implementation=implementation)
        return jnp.sum(out ** 2), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                   static_argnums=4)
    for implementation in ("dense", "chunked"):
        (_, want), want_grads = step(q, k, v, lengths, implementation)
        for split in ("key", "lengths"):
            args = ((q, *jax.device_put((k, v), by_example), lengths) if split == "key" else
                    (q, k, v, jax.device_put(lengths, by_example)))
            (_, got), grads = step(*args, implementation)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{implementation}, {split} split")
            for g, w in zip(grads, want_grads):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{implementation}, {split} split")
            assert tuple(got.sharding.spec)[:1] in ((), (None,)), got.sharding
        # segment ids and a bias split along the sequence, beside a query split by
        # examples: their comparison of queries with keys had been split twice on an axis
        ids = jnp.sort(jax.random.randint(keys[4], (4, 6), 0, 3), axis=1)
        bias = jax.random.normal(keys[3], (4, 4, 6, 5), jnp.float32)
        call = jax.jit(lambda q, k, v, ids, key_ids, bias: attnjax.dot_product_attention(
            q, k, v, bias, masks.segments(ids, key_ids), implementation=implementation))
        want = call(q, k, v, ids, ids[:, 1:], bias)
        got = call(*jax.device_put((q, k, v), by_example),
                   jax.device_put(ids, jax.sharding.NamedSharding(mesh, PartitionSpec(
                       None, "model"))), ids[:, 1:],
                   jax.device_put(bias, jax.sharding.NamedSharding(mesh, PartitionSpec(
                       "data", None, "model"))))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=implementation)

    model = nn.Transformer(nn.TransformerConfig(
        src_vocab_size=12, tgt_vocab_size=10, d_model=32, num_heads=4, d_ff=64,
        num_encoder_layers=1, num_decoder_layers=1))
    src = jax.random.randint(keys[4], (4, 7), 3, 12)
    src_lengths = jax.random.randint(keys[3], (4,), 1, 8)
    params = model.init(keys[4], src, src[:, :3] % 10)["params"]
    decode = functools.partial(nn.greedy_decode, model, params, max_len=5, bos_id=1,
                               eos_id=2)
    want = decode(src, src_lengths)
    with jax.set_mesh(mesh):
        got = decode(*jax.device_put((src, src_lengths), by_example))
    np.testing.assert_array_equal(got, want)
    assert got.sharding.spec[0] == "data"
    got = decode(jax.device_put(src, by_example), memory_cache=False)
    np.testing.assert_array_equal(got, decode(src, memory_cache=False))
    assert got.sharding.spec[0] == "data"
    got = decode(src, jax.device_put(src_lengths, by_example))   # the lengths alone split
    np.testing.assert_array_equal(got, want)
    # parameters in the Megatron layout: the keys split by heads (the loop's empty
    # cache, made as init's, had not been: its carry changed type at the first step)
    with jax.set_mesh(mesh):
        got = nn.greedy_decode(model, jax.device_put(params, mesh_lib.shardings(params, mesh)),
                               *jax.device_put((src, src_lengths), by_example), max_len=5,
                               bos_id=1, eos_id=2)
    np.testing.assert_array_equal(got, want)

    # generation of a prompt split by examples with its lengths (the sinusoidal
    # positions of the split lengths had met an unsplit scatter), and of the lengths
    # alone split
    lm = nn.DecoderOnly(nn.DecoderOnlyConfig(vocab_size=16, d_model=32, num_heads=4,
                                             d_ff=64, num_layers=1))
    prompt = jax.random.randint(keys[4], (4, 5), 1, 16)
    prompt_lengths = jax.random.randint(keys[3], (4,), 1, 6)
    params = lm.init(keys[0], prompt)["params"]
    generate = functools.partial(nn.generate, lm, params, max_new_tokens=3)
    want = generate(prompt, prompt_lengths)
    with jax.set_mesh(mesh):
        got = generate(*jax.device_put((prompt, prompt_lengths), by_example))
    np.testing.assert_array_equal(got, want)
    assert got.sharding.spec[0] == "data"
    np.testing.assert_array_equal(generate(prompt, jax.device_put(prompt_lengths, by_example)),
                                  want)


def test_attention_on_explicit_meshes_and_inside_shard_map(rng, monkeypatch):
    """jax.make_mesh's default mesh (Explicit axes, shardings in the types) under
    jax.set_mesh, batch and heads sharded: every kernel, None and the modules run as
    unsharded (a per-example index made without a sharding had failed vmap). Inside
    jax.shard_map with check_vma on, the chunked kernel too (its loop carries,
    constants, had no varying axes; its gradients of shared arrays are summed over the
    devices)."""
    import attnjax
    from attnjax import masks, nn

    keys = jax.random.split(rng, 3)
    q, k, v = (jax.random.normal(key, (4, 6, 4, 8), jnp.float32) for key in keys)
    expected = attnjax.dot_product_attention(q, k, v, is_causal=True)
    spec = PartitionSpec("data", None, "model", None)
    mesh = jax.make_mesh((2, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    module = nn.MultiHeadDotProductAttention(num_heads=4)
    x = jax.random.normal(keys[0], (4, 6, 16), jnp.float32)
    variables = module.init(rng, x)
    with jax.set_mesh(mesh):
        sq, sk, sv = (jax.device_put(a, spec) for a in (q, k, v))
        for implementation in ("dense", None):
            got = jax.jit(lambda a, b, c, i=implementation: attnjax.dot_product_attention(
                a, b, c, is_causal=True, implementation=i))(sq, sk, sv)
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        # the chunked kernel, batch and heads sharded: values and gradients (of q, k, v,
        # a bias and sinks given whole), its heads in one pass where groups of them
        # would slice across the devices' shards (its loop carries, constants, had no
        # sharding, and the bias's and sinks' gradients those of the heads' shards)
        bias = jax.random.normal(keys[2], (4, 4, 6, 6), jnp.float32)
        sinks = jax.random.normal(keys[1], (4,), jnp.float32)

        def loss(q, k, v, bias, sinks, implementation):
            out = attnjax.dot_product_attention(
                q, k, v, bias=bias, sinks=sinks, is_causal=True,
                key_lengths=jnp.asarray([6, 2, 5, 1], jnp.int32),
                implementation=implementation,
                block_sizes=(4, 4) if implementation == "chunked" else None)
            return jnp.sum(out * jnp.sin(out))

        grads = jax.grad(loss, argnums=range(5))
        want = grads(q, k, v, bias, sinks, "dense")
        for groups_of in (chunked.LOGITS_BLOCK_BYTES, 64):
            monkeypatch.setattr(chunked, "LOGITS_BLOCK_BYTES", groups_of)
            got = jax.jit(grads, static_argnums=5)(sq, sk, sv, bias, sinks, "chunked")
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(
            attnjax.dot_product_attention(sq, sk, sv, implementation="chunked"),
            attnjax.dot_product_attention(q, k, v), rtol=1e-6, atol=1e-6)
        # a sequence sharded in its type: ring attention's work, a named error for the
        # chunked kernel; None and dense run it gathered (their products over a sharded
        # length had been jax's ShardingTypeError)
        seq = PartitionSpec("data", "model")
        with pytest.raises(ValueError, match=r"implementation='chunked' does not run on a "
                                             r"sequence sharded in its type"):
            attnjax.dot_product_attention(*(jax.device_put(a, seq) for a in (q, k, v)),
                                          implementation="chunked")
        for implementation in ("dense", None):
            np.testing.assert_allclose(attnjax.dot_product_attention(
                sq, *(jax.device_put(a, seq) for a in (k, v)), is_causal=True,
                implementation=implementation), expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(module.apply(variables, jax.device_put(x, seq)),
                                   module.apply(variables, x), rtol=1e-6, atol=1e-6)
        # keys and values made before the mesh (no sharding in their type), with the
        # query's batch sharded
        got = jax.jit(lambda a: attnjax.dot_product_attention(a, k, v, is_causal=True))(sq)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        sx = jax.device_put(x, PartitionSpec("data"))
        np.testing.assert_allclose(jax.jit(module.apply)(variables, sx),
                                   module.apply(variables, x), rtol=1e-6, atol=1e-6)
    # inside shard_map with check_vma on: values and gradients (of the sharded
    # inputs, of sinks split by heads, of a replicated bias and of a replicated table
    # a score_mod reads) equal the unsharded call's
    auto = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sinks = jax.random.normal(keys[1], (4,), jnp.float32)
    bias = jax.random.normal(keys[2], (6, 6), jnp.float32)
    table = jax.random.normal(keys[0], (11,), jnp.float32)

    def attend(q, k, v, sinks, bias, table, implementation):
        return attnjax.dot_product_attention(
            q, k, v, is_causal=True, sinks=sinks, bias=bias, implementation=implementation,
            score_mod=lambda s, b, n, i, j: s + table[i - j + 5], block_sizes=(
                (4, 4) if implementation == "chunked" else None))

    def loss(q, k, v, sinks, bias, table, implementation, check_vma):
        inner = functools.partial(attend, implementation=implementation)
        if check_vma is not None:
            inner = jax.shard_map(inner, mesh=auto, in_specs=(spec, spec, spec,
                                  PartitionSpec("model"), PartitionSpec(), PartitionSpec()),
                                  out_specs=spec, check_vma=check_vma)
        out = inner(q, k, v, sinks, bias, table)
        return jnp.sum(out * jnp.sin(out))

    # functions of positions sharded with the batch: traced on indices of their type
    positions = jnp.broadcast_to(2 * jnp.arange(6, dtype=jnp.int32), (4, 6))
    kw = dict(mask=masks.from_fn(lambda b, n, i, j: jnp.abs(i - j) <= 6),
              score_mod=lambda s, b, n, i, j: s - 0.1 * jnp.abs(i - j).astype(s.dtype))
    by_positions = jax.jit(jax.shard_map(
        lambda a, b, c, p: attnjax.dot_product_attention(
            a, b, c, positions=(p, p), implementation="chunked", block_sizes=(4, 4), **kw),
        mesh=auto, in_specs=(spec, spec, spec, PartitionSpec("data")), out_specs=spec))
    np.testing.assert_allclose(by_positions(q, k, v, positions), attnjax.dot_product_attention(
        q, k, v, positions=(positions, positions), implementation="dense", **kw),
        rtol=1e-5, atol=1e-6)
    args = (q, k, v, sinks, bias, table)
    expected = jax.grad(loss, argnums=range(6))(*args, "dense", None)
    for implementation in ("dense", "chunked"):   # (check_vma=False: ring attention's tests)
        got = jax.jit(jax.grad(loss, argnums=range(6)), static_argnums=(6, 7))(
            *args, implementation, True)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
