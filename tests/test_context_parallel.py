"""Context parallelism: sequences sharded over a "seq" mesh axis in the zig-zag layout.

The ring engine on laid-out global arrays equals dense attention in natural order
(outputs and gradients); training with --mesh data=2,seq=2 equals a one-device run
step for step, for both models; two processes (gloo) equal one."""

import collections
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh

import attnjax
from attnjax import masks
from attnjax.parallel import context, ring
from attnjax.parallel import mesh as mesh_lib
from attnjax.toy import cli, make_task, sequence_parallel
from attnjax.toy import train as training
from attnjax.toy.config import ConfigError, dump_config, load_config
from tests import children, draws, training_run
from tests.numerics import USERS_RANDOM_BITS, as_users_run, users_random_bits

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest "
                                "sets --xla_force_host_platform_device_count=4)")

ROOT = Path(__file__).resolve().parents[1]
P = 2   # the "seq" axis of a data=2, seq=2 mesh


def _mesh():
    return mesh_lib.make_mesh({"data": 2, "seq": P}, jax.devices()[:4])


def _draw(rng, *shapes):
    draw = np.random.default_rng(np.asarray(jax.random.key_data(rng))).standard_normal
    return tuple(jnp.asarray(draw(shape), jnp.float32) for shape in shapes)


def _lay_out(x, length):
    """A global array laid out as the trainer does on the host (jnp, to differentiate)."""
    pad = [(0, 0), (0, context.padded_length(length, P) - length)] + [(0, 0)] * (x.ndim - 2)
    return ring.zigzag(jnp.pad(x, pad), P)


def _close(actual, expected, tol=2e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual))
    error = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1.0)
    assert error <= tol, error


# Self-attention over T = 22 tokens (padded to 24, two chunks of 6 per device) and
# cross-attention from them to S = 14 keys (padded to 16): ids and lengths of two rows.
T, S = 22, 14
_IDS = np.asarray([[1] * 7 + [2] * 9 + [3] * 6, [1] * 15 + [0] * 7], np.int32)
_LENGTHS = np.asarray([20, 9], np.int32)


def _output_and_grads(fn, d_out, q, k, v):
    out, pullback = jax.vjp(fn, q, k, v)
    return out, pullback(d_out)


def _check_against_dense(sharded, dense, d_out, q, k, v):
    """sharded (jitted) == dense, the output and the gradients of q, k, v."""
    actual = jax.jit(functools.partial(_output_and_grads, sharded, d_out))(q, k, v)
    expected = jax.jit(functools.partial(_output_and_grads, dense, d_out))(q, k, v)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        _close(a, e)


@pytest.mark.parametrize("case", ["causal_packed", "lengths_cross"])
def test_ring_engine_in_the_layout_equals_dense(rng, case):
    """Causal packed rows (segment ids and positions laid out with their tokens), and
    the encoder's lengths (array indices, rewritten as segment ids) with
    cross-attention T ≠ S; batch and sequence both sharded; forward and gradients of
    q, k, v against dense attention in natural order."""
    s = S if case == "lengths_cross" else T
    q, k, v, d_out = _draw(rng, (2, T, 4, 8), (2, s, 2, 8), (2, s, 2, 6), (2, T, 4, 6))
    positions = None
    if case == "causal_packed":
        ids = jnp.asarray(_IDS)
        global_mask = masks.causal() & masks.segments(ids)
        local_mask = masks.causal() & masks.segments(_lay_out(ids, T))
        positions = (jnp.asarray(context.layout_positions(2, T, P)),) * 2
    else:
        global_mask = local_mask = masks.lengths(query=_LENGTHS, key=_LENGTHS[::-1] % s + 1)
    engine = context.ring_engine(_mesh())

    def sharded(q, k, v):
        out = engine(_lay_out(q, T), _lay_out(k, s), _lay_out(v, s), mask=local_mask,
                     positions=positions)
        return context.restore(out, P, T)

    def dense(q, k, v):
        return attnjax.dot_product_attention(q, k, v, mask=global_mask, implementation="dense")

    _check_against_dense(sharded, dense, d_out, q, k, v)


def test_zigzag_equals_dense_skips_invisible_steps_and_balances_causal_work(rng, monkeypatch):
    """Causal and a sliding window (3 back, 2 ahead) on 4 devices in the zig-zag layout
    equal dense attention, forward and gradients; and per device, the ring steps that
    run the kernel: under the causal mask every step of every device (each holds an
    early and a late chunk), under the window only the shards holding a neighbour."""
    runs = collections.Counter()
    attend_shard = ring._attend_shard

    def counted(query, key, value, mask, score):
        # the scale tells the two attentions apart
        jax.debug.callback(lambda case, device: runs.update([(int(case), int(device))]),
                           score.scale < 0.4, lax.axis_index("seq"))
        return attend_shard(query, key, value, mask, score)

    monkeypatch.setattr(ring, "_attend_shard", counted)
    engine = context.ring_engine(mesh_lib.make_mesh({"seq": 4}, jax.devices()[:4]))
    q, k, v, d_out = _draw(rng, (1, 32, 2, 4), (1, 32, 1, 4), (1, 32, 1, 3), (1, 32, 2, 3))
    positions = (jnp.asarray(context.layout_positions(1, 32, 4)),) * 2
    window = masks.window(3, 2)

    def sharded(q, k, v):
        q, k, v = (ring.zigzag(x, 4) for x in (q, k, v))
        causal = engine(q, k, v, is_causal=True, positions=positions, scale=0.5)
        windowed = engine(q, k, v, mask=window, positions=positions, scale=0.25)
        return ring.unzigzag(jnp.concatenate([causal, windowed], axis=-1), 4)

    def dense(q, k, v):
        return jnp.concatenate([
            attnjax.dot_product_attention(q, k, v, is_causal=True, scale=0.5,
                                          implementation="dense"),
            attnjax.dot_product_attention(q, k, v, mask=window, scale=0.25,
                                          implementation="dense")], axis=-1)

    _check_against_dense(sharded, dense, jnp.concatenate([d_out, d_out], axis=-1), q, k, v)
    jax.effects_barrier()
    assert [runs[(0, device)] for device in range(4)] == [4, 4, 4, 4]
    # Chunks of 4 positions, device i holding chunks i and 7 − i: a chunk sees its two
    # neighbours, so device 0 (chunks 0, 7) needs device 1's (1, 6), device 1 (1, 6)
    # device 0's and device 2's (2, 5), device 2 device 1's and device 3's (3, 4),
    # device 3 device 2's.
    windowed = [runs[(1, device)] for device in range(4)]
    assert windowed == [2, 3, 3, 2], windowed


def test_layout_round_trip_and_errors(rng):
    x = draws.host(rng).integers(0, 100, (3, 13, 2)).astype(np.int32)
    laid = context.lay_out(x, 3, fill=-1)
    assert laid.shape == (3, 18, 2) and np.sum(laid == -1) == 3 * 5 * 2
    np.testing.assert_array_equal(context.restore(jnp.asarray(laid), 3, 13), x)
    positions = context.layout_positions(3, 13, 3)
    np.testing.assert_array_equal(np.sort(positions, axis=1), np.tile(np.arange(18), (3, 1)))
    # device i holds chunks i and 2P - 1 - i: positions 0-2 and 15-17 on device 0
    assert set(positions[0, :6]) == {0, 1, 2, 15, 16, 17}

    engine = context.ring_engine(_mesh())
    q = jnp.ones((2, 6, 2, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"query length T=6 must be a multiple of 2P=4"):
        engine(q, q, q)
    q = jnp.ones((2, 8, 2, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"takes mask, positions, is_causal and scale only; "
                                         r"got bias=, dropout_rate > 0"):
        engine(q, q, q, bias=jnp.zeros((8, 8), jnp.float32), dropout_rate=0.1)
    with pytest.raises(ValueError, match="cannot use from_array"):
        engine(q, q, q, mask=masks.from_array(jnp.ones((8, 8), bool)))
    with pytest.raises(ValueError, match=r"axis='sequence' is not an axis of the mesh"):
        context.ring_engine(_mesh(), axis="sequence")


def test_mesh_sizes_that_divide_the_devices():
    mesh = mesh_lib.make_mesh({"data": 1, "seq": 2}, jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 1, "model": 1, "seq": 2}
    assert list(mesh.devices.flat) == jax.devices()[:2]
    with pytest.raises(ValueError, match=r"the mesh {'seq': 3} needs 3 devices; there are 4, "
                                         r"and a mesh takes a number of them that divides "
                                         r"theirs: 1, 2 or 4$"):
        mesh_lib.make_mesh({"seq": 3}, jax.devices()[:4])
    assert mesh_lib.parse_mesh("data=2,seq=2") == {"data": 2, "seq": 2}
    # an axis make_mesh does not have, or a size below 1 (a misspelled axis had been left
    # out: nothing sharded over it)
    with pytest.raises(ValueError, match=r"make_mesh's axes are \('data', 'model', 'seq'\); "
                                         r"got an axis 'sequence'"):
        mesh_lib.make_mesh({"data": 2, "sequence": 2}, jax.devices()[:4])
    for size in (0, -2):
        with pytest.raises(ValueError, match=f"make_mesh's axis sizes must be positive ints; "
                                             f"got seq={size}"):
            mesh_lib.make_mesh({"seq": size}, jax.devices()[:4])
    with pytest.raises(ValueError, match=r"shardings needs a mesh with the axis 'model'"):
        mesh_lib.shardings({"w": jnp.ones(2)}, Mesh(np.asarray(jax.devices()[:2]), ("data",)))


# Tiny models, dropout off (a sharded layout draws other dropout masks), every step logged.
TINY = ["task.num_symbols=5", "task.min_len=1", "task.max_len=6", "task.eval_size=16",
        "model.d_model=16", "model.num_heads=2", "model.d_ff=32",
        "model.num_encoder_layers=1", "model.num_decoder_layers=1", "model.max_len=16",
        "model.dropout_rate=0.0", "optim.warmup_steps=5", "batch_size=8", "log_every=1",
        "eval_batch_size=16", "steps=20", "eval_every=20", "checkpoint_every=20"]
MODELS = {"encoder_decoder": [],
          "decoder_only_packed": ["model.kind=decoder_only", "data.pack=true"]}


def _config(model: str):
    return load_config(None, TINY + MODELS[model])


@pytest.fixture(scope="module")
def one_device():
    """Losses of one-device runs of each model."""
    with as_users_run(), users_random_bits():
        one = children.one_device_mesh()
        return {model: training_run.losses(_config(model), one) for model in MODELS}


@pytest.mark.parametrize("model", list(MODELS))
def test_seq_sharded_training_equals_one_device(one_device, float32, model):
    config = _config(model)
    mesh = _mesh()
    batch = training.train_batch(make_task(config.task), config, 0, mesh)
    # the sequences are split over "seq": each device holds half of every row it has
    tokens = batch[0]
    assert tokens.sharding.spec == jax.sharding.PartitionSpec("data", "seq")
    assert {s.data.shape for s in tokens.addressable_shards} == {
        (4, tokens.shape[1] // 2)}
    with users_random_bits():
        losses = training_run.losses(config, mesh)
    assert len(losses) == 20 and losses[-1] < losses[0]
    np.testing.assert_allclose(losses, one_device[model], rtol=1e-5, atol=0)


@pytest.mark.parametrize("option, said", [
    ("model.attention_soft_cap=30", "model.attention_soft_cap=30.0"),
    # refused before the workdir is claimed and compilation begins, naming the key
    ("model.attention_score=general", "model.attention_score='general'"),
])
def test_unsupported_model_options_are_config_errors(tmp_path, option, said):
    config = load_config(None, TINY + [option])
    with pytest.raises(ConfigError, match=rf"^{re.escape(said)} is not supported with a seq "
                                          rf"mesh axis \(seq=2\)"):
        cli.run(config, tmp_path, mesh=_mesh())
    assert not tmp_path.joinpath("config.yaml").exists()
    sequence_parallel.check(config, mesh_lib.make_mesh({"data": 4}, jax.devices()[:4]))


def test_two_processes_match_one_device(tmp_path, one_device):
    """Training with --mesh data=2,seq=2 as two processes of two devices each (gloo on
    127.0.0.1): each sequence split across the two devices of a process, the batch
    across the processes; every process sees the losses of a one-device run."""
    config = tmp_path / "config.yaml"
    config.write_text(dump_config(_config("decoder_only_packed")), encoding="utf-8")
    port = children.free_port()
    env = children.environment(2, **USERS_RANDOM_BITS)
    processes = [subprocess.Popen(
        [sys.executable, "-m", "tests.training_run", str(config), "data=2,seq=2",
         f"127.0.0.1:{port}", "2", str(i)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    try:
        outputs = [p.communicate(timeout=180) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, (out, err) in zip(processes, outputs):
        assert p.returncode == 0, err[-3000:]
        losses = np.asarray(json.loads(out.splitlines()[-1]))
        assert len(losses) == 20
        np.testing.assert_allclose(losses, one_device["decoder_only_packed"], rtol=1e-5, atol=0)
