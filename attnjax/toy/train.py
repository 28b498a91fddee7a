"""Model, optimiser, the jit-compiled train step, and greedy evaluation.

Two kinds of model (`config.model.kind`): the encoder–decoder `Transformer` trains on the
task's batches as they are; the `DecoderOnly` model on one causal sequence per example,
or several packed into a row (`attnjax.toy.sequences`). Both are scored on the same
held-out batch, by greedy decoding on the KV cache. With `config.model.api` "nnx" the
train step runs the `attnjax.nnx` counterpart of the model on the same parameters.

Everything random is a function of the seed and the step: the batch of step s comes
from `np.random.default_rng([seed, 0, s])` and its dropout key is
`fold_in(dropout_key(seed), s)`, so a run resumed from a checkpoint continues exactly as an
uninterrupted one.

The same train step runs on one device or many: it is jit-compiled with the shardings
of a ("data", "model", "seq") mesh (`attnjax.parallel.mesh`), which on one device are
trivial; over "seq" each sequence is split across devices and attention runs as a ring
(`attnjax.toy.sequence_parallel`). The global batch is the same whatever the mesh, so
the results are too.
"""

import concurrent.futures
import dataclasses
import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.experimental import multihost_utils

from attnjax.nn import (
    DecoderOnly,
    DecoderOnlyConfig,
    Transformer,
    TransformerConfig,
    generate,
    greedy_decode,
)
from attnjax.parallel import mesh as mesh_lib
from attnjax.toy import sequence_parallel
from attnjax.toy.sequences import DecoderOnlyFormat, Sequences
from attnjax.toy.tasks import BOS, EOS, PAD, Batch, exact_matches

TRAIN_STREAM, EVAL_STREAM = 0, 1
# A training batch: the task's (laid out for a "seq" mesh axis with its positions), or
# the decoder-only model's sequences.
TrainBatch = Batch | sequence_parallel.PositionedBatch | Sequences
# XLA's CPU options for a program that runs once or costs next to nothing to run, so
# that compiling it is nearly all its cost (the checkpoints' finiteness check, the
# attention plot's forward pass): LLVM at level 0 without its expensive passes, XLA's
# elemental emitters, one LLVM module. On a 2-core CPU they compile those two in 0.2-0.4 s
# rather than 0.5-1.3 s. Not for a program whose numbers are kept: at level 0 some floats
# round differently (the initialisation's parameters differ in their last bit, and one
# sequence of seed 0's copy run then ends wrong).
QUICK_COMPILATION = {"xla_backend_optimization_level": 0,
                     "xla_llvm_disable_expensive_passes": True,
                     "xla_cpu_use_fusion_emitters": False,
                     "xla_cpu_parallel_codegen_split_count": 1}


@functools.cache   # tried once a process, once jax's backend is up
def quick_compilation() -> dict:
    """`QUICK_COMPILATION` on a CPU, less the options this jax's XLA does not know (XLA
    refuses a program given one, and a newer XLA drops options: jax 0.11's has no
    `xla_cpu_use_fusion_emitters`); elsewhere XLA's defaults (XLA's GPU backend does not
    support level 0)."""
    if jax.default_backend() != "cpu":
        return {}
    if _compiles_with(QUICK_COMPILATION):
        return QUICK_COMPILATION
    return {name: value for name, value in QUICK_COMPILATION.items()
            if _compiles_with({name: value})}


def _compiles_with(options: dict) -> bool:
    """Whether XLA compiles a one-operation program with these compiler options."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=options).lower(np.float32(0)).compile()
    except jax.errors.JaxRuntimeError:
        return False
    return True


def init_key(seed: int | jax.Array) -> jax.Array:
    """The parameters' key: of an int, or of an int32 scalar inside the
    initialisation's program (the same key)."""
    return jax.random.fold_in(jax.random.key(seed), 0)


def dropout_key(seed: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), 1)


@flax.struct.dataclass
class TrainState:
    """What a checkpoint holds: the step, the parameters and the optimiser state. (A
    pytree: jax.tree.map and jax.eval_shape rebuild it with other leaves, shapes or
    shardings, so the fields are annotated by structure.)"""

    step: Any   # an int32 scalar array
    params: dict
    opt_state: optax.OptState


def make_model(config, task) -> Transformer | DecoderOnly:
    """The model `config.model` names, sized for the task's vocabularies: the
    encoder–decoder, or the decoder-only model over their joint vocabulary."""
    fields = dataclasses.asdict(config.model)
    fields.pop("api")
    if fields.pop("kind") == "decoder_only":
        fields.pop("num_encoder_layers")
        layers = fields.pop("num_decoder_layers")
        return DecoderOnly(DecoderOnlyConfig(**fields, num_layers=layers,
                                             vocab_size=DecoderOnlyFormat(task).vocab.size))
    return Transformer(TransformerConfig(**fields, src_vocab_size=task.src_vocab.size,
                                         tgt_vocab_size=task.tgt_vocab.size))


def learning_rate_schedule(optim, steps: int) -> optax.Schedule:
    """Linear warmup to learning_rate, then cosine decay to end_learning_rate at the
    last step, or the 2017 paper's inverse square root (peak at the end of warmup).
    Without warmup (warmup_steps=0) the first step takes the peak rate, as optax's."""
    warmup = optim.warmup_steps
    if optim.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, optim.learning_rate, warmup, max(steps, warmup + 1), optim.end_learning_rate)
    warmup = max(warmup, 1)

    def inverse_sqrt(step):
        step = jnp.maximum(step, 1).astype(jnp.float32)
        return optim.learning_rate * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

    return inverse_sqrt


def make_optimizer(optim, steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the schedule."""
    return optax.chain(
        optax.clip_by_global_norm(optim.clip_norm),
        optax.adamw(learning_rate_schedule(optim, steps), b1=optim.b1, b2=optim.b2,
                    weight_decay=optim.weight_decay))


def example_batch(task, size: int) -> Batch:
    """A batch of the task's shapes, for initialisation and tracing."""
    return task.sample(np.random.default_rng(0), size)


def _model_batch(model, task, batch: Batch) -> Batch | Sequences:
    """A task's batch as `model` reads it: as it is for the encoder–decoder, one
    sequence per row for the decoder-only model."""
    if isinstance(model, DecoderOnly):
        return DecoderOnlyFormat(task).rows(batch)
    return batch


@functools.lru_cache(maxsize=1)   # abstract_state, then init_state: one trace
def _init(model, optimizer, task, mesh):
    """The initialisation as a function of the seed (an int32 scalar: data to the
    program, not a constant in it, so that runs of every seed share it in jax's
    compilation cache), its output's shapes and their shardings."""
    batch = _model_batch(model, task, example_batch(task, 2))

    def init(seed):
        params = model.init(init_key(seed), *_inputs(batch), deterministic=True)["params"]
        return TrainState(jnp.int32(0), params, optimizer.init(params))

    shapes = jax.eval_shape(init, jax.ShapeDtypeStruct((), jnp.int32))
    return init, shapes, mesh_lib.shardings(shapes, mesh)


def abstract_state(model, optimizer, task, mesh) -> TrainState:
    """What `init_state` returns, as shapes, dtypes and shardings
    (`jax.ShapeDtypeStruct`s): enough to compile the train step before the state exists."""
    _, shapes, shardings = _init(model, optimizer, task, mesh)
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding,
                                                 weak_type=s.weak_type), shapes, shardings)


def init_state(model, optimizer, task, seed: int, mesh, *, alongside=()) -> TrainState:
    """Fresh parameters from `key(seed)` and a zero optimiser state, laid out on the
    mesh (Megatron layout over "model", replicated over "data").

    alongside: `(jitted function, args)` pairs to trace and compile while the
    initialisation compiles on another thread (XLA compiles a program on one core, and
    lets go of Python's lock while it does). The train step, given `abstract_state` for
    its state, is then in the jitted function's cache when it first runs: on a 2-core CPU
    the copy config reaches its first step about 2 s sooner from an empty cache."""
    init, _, shardings = _init(model, optimizer, task, mesh)
    seed = mesh_lib.put(np.array(seed, np.int32), mesh_lib.replicated(mesh))
    lowered = jax.jit(init, out_shardings=shardings).lower(seed)
    if not alongside:
        return lowered.compile()(seed)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        compiling = pool.submit(lowered.compile)
        for fn, args in alongside:
            fn.lower(*args).compile()
        compiled = compiling.result()
    return compiled(seed)


def _inputs(batch: TrainBatch) -> tuple:
    """The positional arguments of the model a batch is for."""
    if isinstance(batch, Sequences):
        return (batch.tokens,)
    return batch.src, batch.tgt_in, batch.src_lengths


def _logits_and_labels(model, params, batch: TrainBatch, **kwargs):
    """`[B, L, V]` logits and `[B, L]` labels (pad: no loss) of either kind of batch."""
    if isinstance(batch, Sequences):
        logits = model.apply({"params": params}, batch.tokens, segment_ids=batch.segment_ids,
                             positions=batch.positions, **kwargs)
        return logits, batch.labels
    if isinstance(batch, sequence_parallel.PositionedBatch):
        logits = model.apply({"params": params}, *_inputs(batch),
                             src_positions=batch.src_positions,
                             tgt_positions=batch.tgt_positions, **kwargs)
        return logits, batch.tgt_out
    return model.apply({"params": params}, *_inputs(batch), **kwargs), batch.tgt_out


def loss_and_metrics(params, batch: TrainBatch, model,
                     label_smoothing: float | jax.Array, rng=None):
    """Label-smoothed cross-entropy averaged over the target tokens (eos included; pad
    and, for the decoder-only model, the prompt excluded); dropout when an rng is given.
    metrics["tokens"] counts those target tokens: the same for an example wherever it
    sits, packed or not. A batch without target tokens has loss and accuracy 0."""
    deterministic = rng is None
    # [B, L, V], [B, L]
    logits, labels = _logits_and_labels(model, params, batch, deterministic=deterministic,
                                        rngs=None if deterministic else {"dropout": rng})
    # [B, L]
    weights = (labels != PAD).astype(jnp.float32)
    smoothed = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
    tokens = weights.sum()
    counted = jnp.maximum(tokens, 1.0)   # (no target token: 0, not 0 / 0)
    loss = (optax.softmax_cross_entropy(logits, smoothed) * weights).sum() / counted
    correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
    return loss, {"loss": loss, "accuracy": correct / counted, "tokens": tokens}


class NnxForward:
    """`model.apply` for the loss, run by the `attnjax.nnx` counterpart of a linen
    `model` on the same parameter tree (`attnjax.nnx.from_linen_params`)."""

    def __init__(self, model: Transformer | DecoderOnly):
        # flax.nnx is imported by the runs that use it only: a third of the command's
        # start-up otherwise
        from flax import nnx

        from attnjax.nnx import models as nnx_models

        abstract = nnx.eval_shape(lambda: nnx_models.counterpart(model, rngs=nnx.Rngs(0)))
        self.graphdef, self.state = nnx.split(abstract)

    def apply(self, variables, *args, rngs=None, **kwargs):
        # a fresh copy of the abstract state, so that loading the parameters fills
        # variables made in this trace
        from flax import nnx

        from attnjax.nnx import from_linen_params

        state = jax.tree.map(lambda x: x, self.state)
        model = from_linen_params(nnx.merge(self.graphdef, state), variables["params"])
        return model(*args, rngs=None if rngs is None else nnx.Rngs(**rngs), **kwargs)


def make_train_step(model: Transformer | DecoderOnly, optimizer, optim, steps: int, seed: int,
                    state, mesh, api: str = "linen"):
    """`(state, batch) -> (state, metrics)`, jit-compiled with the state donated; the
    state keeps the layout it has, the batch is split over "data". api "nnx": the
    forward and backward passes run the `attnjax.nnx` counterpart of `model` on the
    same parameters (`NnxForward`)."""
    schedule = learning_rate_schedule(optim, steps)
    grad_fn = jax.grad(loss_and_metrics, has_aux=True)
    forward = NnxForward(model) if api == "nnx" else model

    state_shardings = jax.tree.map(lambda x: x.sharding, state)

    # The batch keeps the layout `train_batch` gives it (split over "seq" too).
    @functools.partial(jax.jit, donate_argnums=0, in_shardings=(state_shardings, None),
                       out_shardings=(state_shardings, mesh_lib.replicated(mesh)))
    def train_step(state: TrainState, batch: TrainBatch):
        key = jax.random.fold_in(dropout_key(seed), state.step)
        with sequence_parallel.attention(mesh):
            grads, metrics = grad_fn(state.params, batch, forward, optim.label_smoothing, key)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["learning_rate"] = schedule(state.step)
        return TrainState(state.step + 1, params, opt_state), metrics

    return train_step


def all_finite(tree) -> jax.Array:
    """Whether every value of a tree of float arrays is finite."""
    return _finite_check()(tree)


@functools.cache   # made at the first call, once jax's backend is up
def _finite_check():
    def all_finite(tree):
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))

    return jax.jit(all_finite, compiler_options=quick_compilation())


def eval_set(task, config) -> Batch:
    """The held-out set: config.task.eval_size examples from the held-out part."""
    return task.sample(np.random.default_rng([config.seed, EVAL_STREAM]), config.task.eval_size,
                       held=True)


def train_batch(task, config, step: int, mesh) -> TrainBatch:
    """The global training batch of `step`, a function of (seed, step) alone, split over
    the mesh's "data" axis. Every process draws it whole and places its own shards.

    config.batch_size examples for the encoder–decoder, as many sequences for the
    decoder-only model, or with data.pack config.batch_size rows of packed examples.
    With a "seq" mesh axis, in the zig-zag layout over it (`sequence_parallel.lay_out`)
    and split over it."""
    return _draw_batch(task, config, step, mesh)


def abstract_batch(task, config, mesh) -> TrainBatch:
    """Every step's `train_batch` as shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        _draw_batch(task, config, 0, mesh))


def _draw_batch(task, config, step: int, mesh) -> TrainBatch:
    # train_batch's body, which abstract_batch draws through too: train_batch itself is
    # called once a step, by the training loop alone
    rng = np.random.default_rng([config.seed, TRAIN_STREAM, step])
    if config.data.pack:
        layout = DecoderOnlyFormat(task)
        batch = layout.packed(rng, config.batch_size, config.data.packed_len or layout.length)
    elif config.model.kind == "decoder_only":
        batch = DecoderOnlyFormat(task).rows(task.sample(rng, config.batch_size))
    else:
        batch = task.sample(rng, config.batch_size)
    batch = sequence_parallel.lay_out(batch, sequence_parallel.num_shards(mesh))
    return type(batch)(*(mesh_lib.put(x, mesh_lib.batch_sharding(mesh, np.ndim(x)))
                         for x in batch))


def predict(model, task, params, batch: Batch, batch_size: int, mesh) -> np.ndarray:
    """Greedy decoding with the KV cache, in chunks: `[B, T]` target tokens, eos then
    pad. The encoder–decoder decodes from the source; the decoder-only model continues
    source and separator, in a vocabulary that keeps the target ids and adds the
    source-only symbols after them (never a target: counted wrong)."""
    chunks = np.array_split(np.arange(len(batch.src)), -(-len(batch.src) // batch_size))
    max_len = batch.tgt_out.shape[1]
    everywhere = mesh_lib.replicated(mesh)
    if isinstance(model, DecoderOnly):
        prompt, lengths = DecoderOnlyFormat(task).prompts(batch)
        decode = lambda c: generate(  # noqa: E731
            model, params, mesh_lib.put(prompt[c], everywhere),
            mesh_lib.put(lengths[c], everywhere), max_new_tokens=max_len)[:, prompt.shape[1]:]
    else:
        decode = lambda c: greedy_decode(  # noqa: E731
            model, params, mesh_lib.put(batch.src[c], everywhere),
            mesh_lib.put(batch.src_lengths[c], everywhere), max_len=max_len, bos_id=BOS,
            eos_id=EOS, pad_id=PAD)
    tokens = np.concatenate([multihost_utils.process_allgather(decode(c), tiled=True)
                             for c in chunks])
    # pad after the first eos, as greedy_decode leaves it
    return np.where(np.cumsum(tokens == EOS, axis=1) - (tokens == EOS) > 0, PAD, tokens)


def accuracies(predictions: np.ndarray, targets: np.ndarray) -> dict:
    """Token accuracy over the target tokens (eos included) and exact-match accuracy."""
    valid = targets != PAD
    right = (predictions == targets) & valid
    return {"token_accuracy": float(right.sum() / valid.sum()),
            "exact_match": float(np.mean(exact_matches(predictions, targets)))}
