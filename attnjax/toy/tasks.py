"""Toy sequence-to-sequence tasks, generated on the fly: copy, reverse, sort, dates.

Every task makes fixed-shape batches of token ids (pad 0, bos 1, eos 2) from a NumPy
generator, so the batch of step s is a function of (seed, s) alone. Each example is
either held out or not by a hash of its content (its source symbols, or for dates the
day itself), and training batches never contain a held-out example: the held-out set is
disjoint from everything training can see, not only drawn from another seed.

The one exception is short sequences, too few to split: with 10 symbols there are only
10 sources of length 1, and holding one out would test a pattern no example of its
length ever showed. Sources with fewer than `MIN_SPLIT` possible sequences of their
length are shared by training and the held-out set, each drawn for either at the split's
own rate, so that both keep the uniform distribution of lengths.
"""

import dataclasses
import typing

import numpy as np

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")
HELD_OUT_ONE_IN = 10
MIN_SPLIT = 1000
_SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyz"
MAX_SYMBOLS = len(_SYMBOLS)


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Token ids 0, 1, 2 are pad, bos, eos; the symbols follow in order."""

    symbols: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(SPECIALS) + len(self.symbols)

    def token(self, i: int) -> str:
        return (SPECIALS + self.symbols)[i]

    def encode(self, text) -> list[int]:
        index = {s: i + len(SPECIALS) for i, s in enumerate(self.symbols)}
        return [index[s] for s in text]

    def decode(self, ids, *, join: str = "") -> str:
        """Symbols up to the first eos; pad and bos are dropped."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= len(SPECIALS):
                out.append(self.symbols[i - len(SPECIALS)])
        return join.join(out)


class Batch(typing.NamedTuple):
    """One batch of examples, padded to the task's fixed lengths.

    src `[B, S]` symbols then pad; src_lengths `[B]`; tgt_in `[B, T]` is bos + target
    (teacher forcing); tgt_out `[B, T]` is target + eos, pad after: the labels.
    A NamedTuple, so a pytree that jit takes as it is.
    """

    src: np.ndarray
    src_lengths: np.ndarray
    tgt_in: np.ndarray
    tgt_out: np.ndarray


def exact_matches(predictions: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """`[B]` bool: each prediction equals its target at every target token and the eos
    (what follows, pad in the target, is not compared)."""
    valid = targets != PAD
    return ((predictions == targets) | ~valid).all(axis=-1)


_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 words that spreads every bit over
    all of them (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX[0]
    x = (x ^ (x >> np.uint64(27))) * _MIX[1]
    return x ^ (x >> np.uint64(31))


def held_out(keys: np.ndarray) -> np.ndarray:
    """`[B]` bool: whether each example, identified by a uint64 key, is held out."""
    mixed = (keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return mixed % np.uint64(HELD_OUT_ONE_IN) == 0


def make_batch(sources: list[list[int | np.integer]], targets: list[list[int | np.integer]],
               src_len: int, tgt_len: int) -> Batch:
    """Pads token lists (of Python or numpy ints) to `[B, src_len]` and
    `[B, tgt_len + 1]` (room for bos/eos)."""
    b = len(sources)
    src = np.full((b, src_len), PAD, np.int32)
    tgt_in = np.full((b, tgt_len + 1), PAD, np.int32)
    tgt_out = np.full((b, tgt_len + 1), PAD, np.int32)
    for i, (s, t) in enumerate(zip(sources, targets)):
        src[i, : len(s)] = s
        tgt_in[i, : len(t) + 1] = [BOS] + t
        tgt_out[i, : len(t) + 1] = t + [EOS]
    lengths = np.array([len(s) for s in sources], np.int32)
    return Batch(src, lengths, tgt_in, tgt_out)


class SequenceTask:
    """copy (target = source), reverse, or sort a sequence of random symbols.

    Sources have min_len..max_len symbols drawn uniformly from num_symbols; source and
    target share one vocabulary.
    """

    def __init__(self, name: str, num_symbols: int, min_len: int, max_len: int):
        if name not in ("copy", "reverse", "sort"):
            raise ValueError(f"name must be copy, reverse or sort; got {name!r}")
        if not 2 <= num_symbols <= MAX_SYMBOLS:
            raise ValueError(f"num_symbols must lie in [2, {MAX_SYMBOLS}]; got {num_symbols}")
        self.name, self.min_len, self.max_len = name, min_len, max_len
        self.src_vocab = self.tgt_vocab = Vocab(tuple(_SYMBOLS[:num_symbols]))
        self.src_len, self.tgt_len = max_len, max_len
        # the shortest source length with at least MIN_SPLIT sequences: split from there on
        self.split_len = next(n for n in range(1, 64) if num_symbols ** n >= MIN_SPLIT)

    def _keys(self, symbols: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """`[B]` uint64 identity of each source: its length and symbols, each mixed into
        all 64 bits (keys * base + symbol had pushed the first symbols off the word for
        an even base: with 31 symbols every source of length 3 was held out)."""
        keys = _mix(lengths.astype(np.uint64))
        for j in range(self.max_len):
            keys = _mix(keys + np.where(j < lengths, symbols[:, j] + 1, 0).astype(np.uint64))
        return keys

    def _draw(self, rng: np.random.Generator, size: int):
        lengths = rng.integers(self.min_len, self.max_len + 1, size)
        symbols = rng.integers(0, len(self.src_vocab.symbols), (size, self.max_len))
        return symbols, lengths

    def sample(self, rng: np.random.Generator, size: int, *, held: bool = False) -> Batch:
        """size examples from the held-out part (held=True) or from the rest."""
        chosen_symbols, chosen_lengths = [], []
        count = 0
        while count < size:
            symbols, lengths = self._draw(rng, max(size, 64) * (HELD_OUT_ONE_IN if held else 2))
            # a short source goes to either side at the split's rate (kept whatever its
            # side, short lengths had been ten times as common in the held-out set)
            by_chance = rng.random(len(lengths)) * HELD_OUT_ONE_IN < 1
            keep = np.where(lengths < self.split_len, by_chance,
                            held_out(self._keys(symbols, lengths))) == held
            chosen_symbols.append(symbols[keep])
            chosen_lengths.append(lengths[keep])
            count += int(keep.sum())
        symbols = np.concatenate(chosen_symbols)[:size] + len(SPECIALS)
        lengths = np.concatenate(chosen_lengths)[:size]
        return self._batch(symbols, lengths)

    def _batch(self, symbols: np.ndarray, lengths: np.ndarray) -> Batch:
        """`make_batch` of the rows' first `lengths` tokens and their targets, the whole
        batch at once: the copy config's batch of 128 takes about 0.4 ms of the host's
        time, 2 ms a row at a time."""
        b = len(lengths)
        # [B, L]
        valid = np.arange(self.max_len) < lengths[:, None]
        if self.name == "reverse":
            backwards = np.maximum(lengths[:, None] - 1 - np.arange(self.max_len), 0)
            targets = np.take_along_axis(symbols, backwards, axis=1)
        elif self.name == "sort":   # the padding sorts last
            targets = np.sort(np.where(valid, symbols, np.iinfo(symbols.dtype).max), axis=1)
        else:
            targets = symbols
        src = np.where(valid, symbols, PAD).astype(np.int32)
        # [B, L + 1]
        tgt_in = np.full((b, self.tgt_len + 1), PAD, np.int32)
        tgt_in[:, 0] = BOS
        tgt_in[:, 1:] = np.where(valid, targets, PAD)
        tgt_out = np.full((b, self.tgt_len + 1), PAD, np.int32)
        tgt_out[:, :-1] = tgt_in[:, 1:]
        tgt_out[np.arange(b), lengths] = EOS
        return Batch(src, lengths.astype(np.int32), tgt_in, tgt_out)

