"""The training objective and schedule: padding never counts, label smoothing is the
cross-entropy against smoothed targets, and the learning-rate schedules have their shape."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnjax.toy import make_task
from attnjax.toy import train as training
from attnjax.toy.config import OptimConfig, load_config
from attnjax.toy.sequences import DecoderOnlyFormat
from attnjax.toy.tasks import PAD, Batch

# The model runs under jax.jit: eagerly, XLA compiles every primitive of init, apply and
# the loss as a program of its own (hundreds per test); jitted, one program each.
# The model and the label smoothing stay Python values, as in an eager call.
_loss_and_metrics = jax.jit(training.loss_and_metrics, static_argnums=(2, 3))


def _logits(model, params, *inputs):
    return jax.jit(functools.partial(model.apply, deterministic=True))({"params": params},
                                                                       *inputs)


@pytest.fixture
def setup(float32):
    config = load_config(None, ["model.d_model=32", "model.num_heads=2", "model.d_ff=48",
                                "task.max_len=9"])
    task = make_task(config.task)
    model = training.make_model(config, task)
    batch = task.sample(np.random.default_rng(7), 13)
    params = jax.jit(model.init)(jax.random.key(3), batch.src, batch.tgt_in,
                                 batch.src_lengths)["params"]
    return model, params, batch


def test_loss_ignores_padding(setup):
    model, params, batch = setup
    rng = np.random.default_rng(0)
    # Fill every padded source and decoder-input position with random symbols.
    src = np.where(batch.src == PAD, rng.integers(3, 13, batch.src.shape), batch.src)
    tgt_in = np.where(batch.tgt_out == PAD, rng.integers(3, 13, batch.tgt_in.shape),
                      batch.tgt_in)
    noisy = Batch(src.astype(np.int32), batch.src_lengths, tgt_in.astype(np.int32),
                  batch.tgt_out)
    assert (noisy.src != batch.src).any() and (noisy.tgt_in != batch.tgt_in).any()
    loss, metrics = _loss_and_metrics(params, batch, model, 0.1)
    noisy_loss, noisy_metrics = _loss_and_metrics(params, noisy, model, 0.1)
    np.testing.assert_allclose(noisy_loss, loss, rtol=1e-5)
    assert metrics["tokens"] == (batch.tgt_out != PAD).sum()
    np.testing.assert_allclose(noisy_metrics["accuracy"], metrics["accuracy"], rtol=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_loss_is_smoothed_cross_entropy_over_target_tokens(setup, smoothing):
    model, params, batch = setup
    loss, _ = _loss_and_metrics(params, batch, model, smoothing)
    logits = np.asarray(_logits(model, params, batch.src, batch.tgt_in, batch.src_lengths),
                        np.float64)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    vocab = logits.shape[-1]
    total, count = 0.0, 0
    for b, t in zip(*np.nonzero(batch.tgt_out != PAD)):
        target = np.full(vocab, smoothing / vocab)
        target[batch.tgt_out[b, t]] += 1.0 - smoothing
        total -= (target * log_p[b, t]).sum()
        count += 1
    np.testing.assert_allclose(loss, total / count, rtol=1e-5)


def test_decoder_only_loss_counts_target_tokens_only(float32):
    config = load_config(None, ["model.kind=decoder_only", "model.d_model=32",
                                "model.num_heads=2", "model.d_ff=48", "task.max_len=9"])
    task = make_task(config.task)
    model = training.make_model(config, task)
    examples = task.sample(np.random.default_rng(7), 13)
    batch = DecoderOnlyFormat(task).rows(examples)
    params = jax.jit(model.init)(jax.random.key(3), batch.tokens)["params"]
    loss, metrics = _loss_and_metrics(params, batch, model, 0.2)
    # the encoder–decoder's labels: each target and its eos, nothing of the prompt
    assert metrics["tokens"] == (examples.tgt_out != PAD).sum() == (batch.labels != PAD).sum()
    logits = np.asarray(_logits(model, params, batch.tokens), np.float64)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    vocab = logits.shape[-1]
    rows, cols = np.nonzero(batch.labels != PAD)
    target = np.full((len(rows), vocab), 0.2 / vocab)
    target[np.arange(len(rows)), batch.labels[rows, cols]] += 0.8
    np.testing.assert_allclose(loss, -(target * log_p[rows, cols]).sum() / len(rows), rtol=1e-5)


def test_a_batch_without_target_tokens_has_loss_0_not_nan(float32):
    """(0 / 0 made the loss, the accuracy and every gradient NaN; the trainer never
    draws such a batch, a caller of loss_and_metrics may)"""
    config = load_config(None, ["model.kind=decoder_only", "model.d_model=32",
                                "model.num_heads=2", "model.d_ff=48", "task.max_len=9"])
    task = make_task(config.task)
    model = training.make_model(config, task)
    batch = DecoderOnlyFormat(task).rows(task.sample(np.random.default_rng(), 5))
    params = jax.jit(model.init)(jax.random.key(3), batch.tokens)["params"]
    unlabelled = batch._replace(labels=np.full_like(batch.labels, PAD))
    loss, metrics = _loss_and_metrics(params, unlabelled, model, 0.1)
    assert (float(loss), float(metrics["accuracy"]), float(metrics["tokens"])) == (0.0, 0.0, 0.0)
    grads = jax.jit(jax.grad(training.loss_and_metrics, has_aux=True),
                    static_argnums=(2, 3))(params, unlabelled, model, 0.1)[0]
    assert all(bool(jnp.all(g == 0)) for g in jax.tree.leaves(grads))
    labelled, _ = _loss_and_metrics(params, batch, model, 0.1)
    assert float(labelled) > 0.5


def test_schedules():
    cosine = jax.jit(training.learning_rate_schedule(
        OptimConfig(learning_rate=2e-3, warmup_steps=10, end_learning_rate=1e-5), 100))
    np.testing.assert_allclose([cosine(0), cosine(5), cosine(10), cosine(100)],
                               [0.0, 1e-3, 2e-3, 1e-5], rtol=1e-5, atol=1e-9)
    assert cosine(50) > cosine(80) > cosine(99)
    # no warmup: the first update takes the peak rate (it was 0: a step that trained nothing)
    for schedule in ("cosine", "inverse_sqrt"):
        cold = training.learning_rate_schedule(
            OptimConfig(learning_rate=2e-3, warmup_steps=0, schedule=schedule), 100)
        np.testing.assert_allclose(cold(0), 2e-3, rtol=1e-6)
        assert cold(1) <= cold(0)
    paper = jax.jit(training.learning_rate_schedule(
        OptimConfig(learning_rate=2e-3, warmup_steps=16, schedule="inverse_sqrt"), 100))
    np.testing.assert_allclose([paper(4), paper(16), paper(64)], [5e-4, 2e-3, 1e-3], rtol=1e-6)
    assert jnp.isfinite(paper(0))
