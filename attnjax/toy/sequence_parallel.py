"""Training batches and attention for a mesh with a "seq" axis (context parallelism).

With `--mesh data=2,seq=2` every training sequence is split over the P devices of the
"seq" axis: the batch is padded to a multiple of 2P and permuted once into the
zig-zag layout on the host (`attnjax.parallel.context.lay_out`), each token keeping
its position (and, packed, its segment id), and the model's attention runs as ring
attention over "seq" while the train step is traced (`attention`). The loss is a sum
over tokens, so it needs no undoing; the padding carries the label pad (no loss), and
no real token sees it, so the loss and the metrics are those of a one-device run.
Evaluation (greedy decoding) runs as it does on any mesh.
"""

import contextlib
import typing

import numpy as np

from attnjax.nn.attention import attention_engine
from attnjax.parallel import context
from attnjax.toy.config import ConfigError
from attnjax.toy.sequences import Sequences
from attnjax.toy.tasks import PAD, Batch


class PositionedBatch(typing.NamedTuple):
    """An encoder–decoder `Batch` in the zig-zag layout, with the positions of its
    tokens: src, tgt_in, tgt_out, src_positions, tgt_positions `[B, L']` (L' a
    multiple of 2P), src_lengths `[B]`."""

    src: np.ndarray
    src_lengths: np.ndarray
    tgt_in: np.ndarray
    tgt_out: np.ndarray
    src_positions: np.ndarray
    tgt_positions: np.ndarray


def num_shards(mesh) -> int:
    """How many devices share each sequence: the size of the mesh's "seq" axis."""
    return mesh.shape.get(context.AXIS, 1)


def check(config, mesh) -> None:
    """What ring attention cannot run, refused before anything is built."""
    if num_shards(mesh) == 1:
        return
    unsupported = {"model.attention_dropout_rate": config.model.attention_dropout_rate > 0,
                   "model.attention_soft_cap": config.model.attention_soft_cap is not None,
                   "model.attention_sinks": config.model.attention_sinks,
                   "model.attention_score": config.model.attention_score
                   not in ("scaled_dot", "dot")}
    for key, used in unsupported.items():
        if used:
            raise ConfigError(f"{key}={getattr(config.model, key.split('.')[1])!r} is not "
                              f"supported with a seq mesh axis (seq={num_shards(mesh)}): ring "
                              f"attention has no attention dropout, soft cap, sinks or "
                              f"learned alignment (attention_score general or additive)")


def lay_out(batch: Batch | Sequences, shards: int) -> Batch | PositionedBatch | Sequences:
    """A host batch in the zig-zag layout of `shards` devices (as it is for one)."""
    if shards == 1:
        return batch
    if isinstance(batch, Sequences):
        # padding as the rows already have it: pad tokens and labels, segment 0, position 0
        return Sequences(*(context.lay_out(x, shards, fill=PAD if name in ("tokens", "labels")
                                           else 0)
                           for name, x in zip(Sequences._fields, batch)))
    b = len(batch.src)
    return PositionedBatch(
        context.lay_out(batch.src, shards, fill=PAD), batch.src_lengths,
        context.lay_out(batch.tgt_in, shards, fill=PAD),
        context.lay_out(batch.tgt_out, shards, fill=PAD),
        context.layout_positions(b, batch.src.shape[1], shards),
        context.layout_positions(b, batch.tgt_in.shape[1], shards))


def attention(mesh):
    """The context in which a train step is traced: ring attention over "seq" when the
    mesh has one, attnjax's engine otherwise."""
    if num_shards(mesh) == 1:
        return contextlib.nullcontext()
    return attention_engine(context.ring_engine(mesh))
