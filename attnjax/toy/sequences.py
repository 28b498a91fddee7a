"""A task as decoder-only sequences, one example per row or several packed into a row.

One example is one causal sequence: the source, a separator (bos), the target and eos.
The model reads every token but the last and learns to predict the next one; the loss
counts only the predictions of the target tokens and of eos, exactly the labels of the
encoder–decoder:

    tokens   s1 s2 s3 <bos> t1 t2 t3
    labels   .  .  .  t1    t2 t3 <eos>        (. = pad: no loss)

Source and target vocabularies may differ (dates): both map into one vocabulary, the
target symbols first, so that a target token keeps its id and predictions compare
with the task's targets as they are.

Packing fills a row with whole examples, one after another, and starts the next row
when the next example does not fit; segment ids (1, 2, ... in each row, 0 for padding)
keep the examples from seeing each other, and positions restart at 0 in each, so every
example gets the logits it would get alone.
"""

import typing

import numpy as np

from attnjax.toy.tasks import BOS, PAD, SPECIALS, Batch, Vocab

SEPARATOR = BOS


class Sequences(typing.NamedTuple):
    """A decoder-only batch, all int32 `[B, L]`: tokens; labels (the next token where
    it is a target token or eos, pad elsewhere); segment_ids (the example of each
    token within its row, from 1; 0 for padding); positions (from 0 in each example).
    """

    tokens: np.ndarray
    labels: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray


class DecoderOnlyFormat:
    """How a decoder-only model reads a task: its vocabulary, its rows and its prompts."""

    def __init__(self, task):
        self.task = task
        target = task.tgt_vocab.symbols
        self.vocab = Vocab(target + tuple(s for s in task.src_vocab.symbols if s not in target))
        ids = {s: i for i, s in enumerate(SPECIALS + self.vocab.symbols)}
        # [V_src]: source token id -> its id in the joint vocabulary
        self.src_ids = np.array([ids[s] for s in SPECIALS + task.src_vocab.symbols], np.int32)
        self.src_len, self.tgt_len = task.src_len, task.tgt_len
        # the longest example: source, separator, target (eos is only a label)
        self.length = task.src_len + task.tgt_len + 1

    def examples(self, batch: Batch):
        """(tokens, labels) of each example, unpadded."""
        target_lengths = (batch.tgt_out != PAD).sum(1)
        for src, n, tgt_in, tgt_out, m in zip(batch.src, batch.src_lengths, batch.tgt_in,
                                               batch.tgt_out, target_lengths):
            tokens = np.concatenate([self.src_ids[src[:n]], tgt_in[:m]])
            labels = np.concatenate([np.full(n, PAD, np.int32), tgt_out[:m]])
            yield tokens, labels

    def rows(self, batch: Batch) -> Sequences:
        """One example per row, padded to the longest example."""
        return _fill(self.examples(batch), len(batch.src), self.length, pack=False)

    def packed(self, rng: np.random.Generator, rows: int, length: int) -> Sequences:
        """`[rows, length]`, filled with whole training examples drawn from rng in
        order; an example that does not fit starts the next row (the one that fits in
        no row left is dropped)."""
        if length < self.length:
            raise ValueError(f"length must hold the longest example ({self.length} tokens); "
                             f"got {length}")
        # enough examples for every row in one draw, in the usual case
        draw = 2 * rows * (length // self.length)

        def examples():
            while True:
                yield from self.examples(self.task.sample(rng, draw))

        return _fill(examples(), rows, length, pack=True)

    def prompts(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """Source and separator of each example, left-padded to `[B, src_len + 1]`,
        and their lengths `[B]` (`attnjax.nn.generate`'s prompt_lengths)."""
        b = len(batch.src)
        prompt = np.full((b, self.src_len + 1), PAD, np.int32)
        for i, (src, n) in enumerate(zip(batch.src, batch.src_lengths)):
            prompt[i, self.src_len - n:self.src_len] = self.src_ids[src[:n]]
        prompt[:, -1] = SEPARATOR
        return prompt, (batch.src_lengths + 1).astype(np.int32)


def _fill(examples, rows: int, length: int, *, pack: bool) -> Sequences:
    """Places (tokens, labels) pairs into `[rows, length]` arrays in order: one per row,
    or as many as fit (pack)."""
    out = Sequences(*(np.full((rows, length), PAD, np.int32) for _ in Sequences._fields))
    row, used, segment = 0, 0, 0
    for tokens, labels in examples:
        n = len(tokens)
        if used and (not pack or used + n > length):
            row, used, segment = row + 1, 0, 0
            if row == rows:
                break
        segment += 1
        where = (row, slice(used, used + n))
        out.tokens[where], out.labels[where] = tokens, labels
        out.segment_ids[where], out.positions[where] = segment, np.arange(n)
        used += n
    return out
