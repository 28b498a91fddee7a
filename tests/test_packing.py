"""Sequence packing and the decoder-only trainer: every example inside a packed row gets
the logits, loss and gradients it gets alone; left-padded prompts generate what they
generate alone; packed batches are a function of (seed, step); the command line trains
decoder-only models, packed or not, and resumes them exactly."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnjax import nn
from attnjax.toy import cli, make_task
from attnjax.toy import train as training
from attnjax.toy.config import load_config
from attnjax.toy.report import TIMING_KEYS
from attnjax.toy.sequences import DecoderOnlyFormat, Sequences
from attnjax.toy.tasks import BOS, EOS, PAD
from tests import children, draws, trees

ROOT = Path(__file__).resolve().parents[1]
# Examples of distinct lengths, packed into rows of 19 (room for 2 of pad after them).
LENGTHS = ((5, 9, 3), (7, 4, 6))
ROW = 19


def _perturbed(params, rng, scale=0.3):
    return trees.perturbed(params, rng, scale)


def _packed_rows(rng, vocab: int):
    """Rows of the examples of LENGTHS, one after another: tokens, segment ids (from 1,
    pad 0), positions restarting at 0; and the examples themselves."""
    tokens = np.zeros((len(LENGTHS), ROW), np.int32)
    segments, positions = np.zeros_like(tokens), np.zeros_like(tokens)
    examples = []
    generator = draws.host(rng)
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for segment, n in enumerate(lengths, 1):
            example = generator.integers(3, vocab, n).astype(np.int32)
            tokens[row, start:start + n] = example
            segments[row, start:start + n] = segment
            positions[row, start:start + n] = np.arange(n)
            examples.append((row, slice(start, start + n), example))
            start += n
    return tokens, segments, positions, examples


@pytest.mark.parametrize("positional, num_kv_heads, implementation", [
    ("sinusoidal", None, None), ("learned", 1, None), ("sinusoidal", 1, "chunked")])
def test_decoder_only_packed_row_equals_each_example_alone(rng, positional, num_kv_heads,
                                                           implementation):
    model = nn.DecoderOnly(nn.DecoderOnlyConfig(
        vocab_size=13, d_model=16, num_heads=2, num_kv_heads=num_kv_heads, d_ff=24, max_len=23,
        num_layers=2, positional=positional, dropout_rate=0.0, implementation=implementation))
    tokens, segments, positions, examples = _packed_rows(rng, 13)
    params = _perturbed(jax.jit(model.init)(rng, tokens)["params"], jax.random.fold_in(rng, 1))
    apply = jax.jit(model.apply)
    # [B, L, V]
    packed = apply({"params": params}, tokens, segment_ids=segments, positions=positions)
    chex.assert_shape(packed, (len(LENGTHS), ROW, 13))
    chex.assert_tree_all_finite(packed)
    for row, where, example in examples:
        alone = apply({"params": params}, example[None])[0]
        np.testing.assert_allclose(packed[row, where], alone, rtol=1e-5, atol=1e-5)
    # Without segment ids the second example sees the first: the test can fail.
    leaky = apply({"params": params}, tokens, positions=positions)
    row, where, _ = examples[1]
    assert not np.allclose(leaky[row, where], packed[row, where])


def test_transformer_packed_rows_equal_each_example_alone(rng):
    model = nn.Transformer(nn.TransformerConfig(
        src_vocab_size=11, tgt_vocab_size=13, d_model=16, num_heads=2, d_ff=24, max_len=23,
        num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.0))
    src, src_segments, src_positions, sources = _packed_rows(rng, 11)
    # Targets in the same rows and segments as their sources, with other lengths.
    tgt = np.zeros((len(LENGTHS), 17), np.int32)
    tgt_segments, tgt_positions = np.zeros_like(tgt), np.zeros_like(tgt)
    targets, start = [], {}
    generator = draws.host(jax.random.fold_in(rng, 2))
    for i, (row, _, _) in enumerate(sources):
        n = 2 + i % 4
        first = start.get(row, 0)
        segment = int(src_segments[row, sources[i][1].start])
        example = generator.integers(3, 13, n).astype(np.int32)
        tgt[row, first:first + n] = example
        tgt_segments[row, first:first + n] = segment
        tgt_positions[row, first:first + n] = np.arange(n)
        targets.append((slice(first, first + n), example))
        start[row] = first + n
    params = _perturbed(jax.jit(model.init)(rng, src, tgt)["params"], jax.random.fold_in(rng, 1))
    apply = jax.jit(model.apply)
    packed = apply({"params": params}, src, tgt, src_segment_ids=src_segments,
                   tgt_segment_ids=tgt_segments, src_positions=src_positions,
                   tgt_positions=tgt_positions)
    chex.assert_tree_all_finite(packed)
    for (row, _, source), (where, target) in zip(sources, targets):
        alone = apply({"params": params}, source[None], target[None])[0]
        np.testing.assert_allclose(packed[row, where], alone, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tgt_segment_ids needs src_segment_ids too"):
        apply({"params": params}, src, tgt, tgt_segment_ids=tgt_segments)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_positions_default_to_0_to_length(rng, positional):
    x = draws.normal(rng, (2, 7, 16))
    module = nn.PositionalEncoding(max_len=11, kind=positional)
    params = _perturbed(jax.jit(module.init)(rng, x), rng)
    # Applied eagerly: under jit the default positions are constants XLA may fold, which
    # need not agree bit for bit with the explicit ones computed at run time.
    explicit = module.apply(params, x, jnp.broadcast_to(jnp.arange(7), (2, 7)))
    np.testing.assert_array_equal(module.apply(params, x), explicit)
    shifted = module.apply(params, x, jnp.broadcast_to(jnp.arange(3, 10), (2, 7)))
    if positional == "sinusoidal":
        np.testing.assert_allclose(shifted[0] - x[0], nn.sinusoids(7, 16, offset=3), atol=1e-6)


def test_generate_left_padded_prompts_equal_each_prompt_alone(rng):
    model = nn.DecoderOnly(nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2,
                                                num_kv_heads=1, d_ff=24, max_len=20,
                                                positional="learned"))
    lengths = np.array([5, 2, 4], np.int32)
    prompt = draws.host(rng).integers(3, 13, (3, 5)).astype(np.int32)
    prompt[np.arange(5)[None, :] < 5 - lengths[:, None]] = PAD
    params = _perturbed(jax.jit(model.init)(rng, prompt)["params"], rng, 0.5)
    out = nn.generate(model, params, prompt, lengths, max_new_tokens=6)
    for b, n in enumerate(lengths):
        alone = nn.generate(model, params, prompt[b:b + 1, 5 - n:], max_new_tokens=6)
        np.testing.assert_array_equal(out[b, 5 - n:], alone[0])
    with pytest.raises(ValueError, match=r"prompt_lengths must have shape \[B\] = \(3,\)"):
        nn.generate(model, params, prompt, lengths[:2], max_new_tokens=6)


# --- the toy trainer -------------------------------------------------------------------


TINY = ["task.num_symbols=5", "task.min_len=1", "task.max_len=6", "task.eval_size=200",
        "model.kind=decoder_only", "model.d_model=32", "model.num_heads=2", "model.d_ff=64",
        "model.num_decoder_layers=2", "model.max_len=16", "optim.warmup_steps=10",
        "steps=60", "batch_size=16", "log_every=10", "eval_every=30", "checkpoint_every=10",
        "eval_batch_size=100"]


def tiny(*overrides):
    return load_config(ROOT / "configs" / "copy.yaml", TINY + list(overrides))


def _segments(batch: Sequences):
    """(row, index array) of every example in a batch of sequences."""
    for row, ids in enumerate(batch.segment_ids):
        for segment in range(1, ids.max() + 1):
            yield row, np.nonzero(ids == segment)[0]


def test_sequences_layout_and_packed_batches_depend_on_seed_and_step_only():
    config = tiny("data.pack=true", "data.packed_len=30")
    task = make_task(config.task)
    layout = DecoderOnlyFormat(task)
    mesh = children.one_device_mesh()
    batch = jax.device_get(training.train_batch(task, config, 7, mesh))
    assert isinstance(batch, Sequences) and batch.tokens.shape == (16, 30)
    again = jax.device_get(training.train_batch(task, config, 7, mesh))
    chex.assert_trees_all_equal(batch, again)
    assert not np.array_equal(jax.device_get(training.train_batch(task, config, 8, mesh)).tokens,
                              batch.tokens)
    count = 0
    for row, where in _segments(batch):
        count += 1
        assert np.array_equal(where, np.arange(where[0], where[-1] + 1))   # contiguous
        np.testing.assert_array_equal(batch.positions[row, where], np.arange(len(where)))
        tokens, labels = batch.tokens[row, where], batch.labels[row, where]
        n = int(np.argmax(tokens == BOS))   # source, separator, target; then labels
        np.testing.assert_array_equal(tokens[n + 1:], labels[n:-1])
        assert (labels[:n] == PAD).all() and labels[-1] == EOS
        np.testing.assert_array_equal(tokens[n + 1:], tokens[:n])   # copy
    assert count > 1.5 * 16   # packing holds more than one example per row
    assert ((batch.segment_ids == 0) == (batch.tokens == PAD)).all()
    # Unpacked: one example per row, the task's own batch of the step.
    rows = jax.device_get(training.train_batch(task, tiny(), 7, mesh))
    assert rows.tokens.shape == (16, layout.length) and rows.segment_ids.max() == 1
    with pytest.raises(ValueError, match=r"length must hold the longest example \(13 tokens\); "
                                         r"got 12"):
        layout.packed(np.random.default_rng(0), 2, 12)


def test_joint_vocabulary_keeps_target_ids():
    task = make_task(load_config(None, ["task.name=dates"]).task)
    layout = DecoderOnlyFormat(task)
    assert layout.vocab.symbols[:len(task.tgt_vocab.symbols)] == task.tgt_vocab.symbols
    assert set(layout.vocab.symbols) == set(task.src_vocab.symbols) | set(task.tgt_vocab.symbols)
    batch = task.sample(np.random.default_rng(0), 5)
    prompt, lengths = layout.prompts(batch)
    for i in range(5):
        text = layout.vocab.decode(prompt[i, -lengths[i]:-1])
        assert text == task.src_vocab.decode(batch.src[i])
        assert prompt[i, -1] == BOS and (prompt[i, :-lengths[i]] == PAD).all()


def test_packed_loss_and_gradients_equal_the_examples_alone(float32):
    config = tiny("data.pack=true", "data.packed_len=30", "batch_size=3")
    task = make_task(config.task)
    model = training.make_model(config, task)
    mesh = children.one_device_mesh()
    packed = jax.device_get(training.train_batch(task, config, 0, mesh))
    params = training.init_state(model, training.make_optimizer(config.optim, 10), task, 0,
                                 mesh).params
    params = _perturbed(params, jax.random.key(5), 0.1)
    grad = jax.jit(jax.grad(training.loss_and_metrics, has_aux=True), static_argnums=2)
    packed_grads, packed_metrics = grad(params, packed, model, 0.1)
    # Each example alone in a row of its own; the packed loss is the token-weighted mean.
    length = DecoderOnlyFormat(task).length
    alone_grads, weights, correct = [], [], 0.0
    for row, where in _segments(packed):
        alone = Sequences(*(np.zeros((1, length), np.int32) for _ in Sequences._fields))
        for field, x in zip(alone, packed):
            field[0, :len(where)] = x[row, where]
        grads, metrics = grad(params, alone, model, 0.1)
        alone_grads.append(grads)
        weights.append(float(metrics["tokens"]))
        correct += float(metrics["accuracy"]) * weights[-1]
    count = sum(weights)
    assert len(weights) > 3 and packed_metrics["tokens"] == count == (packed.labels != PAD).sum()
    np.testing.assert_allclose(packed_metrics["accuracy"], correct / count, rtol=1e-6)
    expected = jax.jit(lambda grads: jax.tree.map(
        lambda *g: sum(w * x for w, x in zip(weights, g)) / count, *grads))(alone_grads)
    chex.assert_trees_all_close(packed_grads, expected, rtol=2e-4, atol=1e-7)


def _records(workdir: Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


# Unpacked, the model has learned positions and the config's least model.max_len (source,
# separator and target: 13), which evaluation's generate must fit in.
@pytest.mark.parametrize("pack", [False, True])
def test_cli_trains_decoder_only(tmp_path, pack):
    overrides = TINY + (["data.pack=true"] if pack else
                        ["model.positional=learned", "model.max_len=13"])
    result = subprocess.run(
        [sys.executable, str(ROOT / "train_toy.py"), "--workdir", str(tmp_path / "run"),
         *(arg for o in overrides for arg in ("--set", o))],
        cwd=ROOT, env=children.environment(None), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "copy: held-out exact match" in result.stdout
    records = _records(tmp_path / "run")
    logs = [r for r in records if "loss" in r]
    assert [r["step"] for r in logs] == list(range(10, 61, 10))
    assert logs[-1]["loss"] < 0.75 * logs[0]["loss"]
    assert logs[-1]["accuracy"] > logs[0]["accuracy"]
    for name in ("config.yaml", "samples.txt", "attention.png", "curves.png"):
        assert (tmp_path / "run" / name).exists(), name
    assert load_config(tmp_path / "run" / "config.yaml").data.pack is pack


def test_packed_run_resumes_to_the_uninterrupted_metrics(tmp_path, float32, capsys):
    config = tiny("data.pack=true", "steps=40", "eval_every=20", "keep_checkpoints=4")
    cli.run(config, tmp_path / "whole", mesh=children.one_device_mesh(),
            interactive=False)
    # The run as a process killed after step 20 leaves it: the later checkpoints gone.
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    for step in (30, 40):
        shutil.rmtree(tmp_path / "resumed" / "checkpoints" / str(step))
    cli.run(config, tmp_path / "resumed", mesh=children.one_device_mesh(),
            interactive=False)
    assert f"resuming {tmp_path / 'resumed'} from step 20" in capsys.readouterr().out
    assert _records(tmp_path / "resumed") == _records(tmp_path / "whole")
