"""Masks: which keys each query may see, as one composable value.

A `Mask` is an immutable pytree: a small tree of rules combined with `&` and `|`, and
the per-example metadata the rules read (positions, segment ids, lengths, arrays):

    mask = masks.causal() & masks.segments(ids)          # packed causal sequences
    mask = masks.causal() | masks.prefix(n)               # prefix-LM
    mask = masks.window(128, 0) & masks.lengths(key=lens) # sliding window over padded keys

Every rule answers two questions, and nothing else in attnjax decides visibility:

- `visible(at)`: elementwise, may query i see key j? `at` is a `Coords`: the example b,
  the query head n, the array indices of a block of queries and keys, and their
  positions. The dense kernel asks it for the whole `[T, S]` grid, the chunked kernel
  for each partial block.
- `classify(blocks)`: for every (query block, key block) pair, SKIP (no pair visible),
  FULL (every pair visible) or PARTIAL, from per-block minima and maxima of positions,
  indices and segment ids. `&` takes the minimum of its parts' classes, `|` the
  maximum. The chunked kernel visits only blocks that are not SKIP and evaluates
  `visible` only on PARTIAL ones.

Positions. Rules of order (causal, window, prefix, chunked causal) and `score_mod`s read
positions, not array indices. By default they align the *last* query with the *last*
key: query i sits at position i + (S − T), key j at j; with T = S this is the usual
triangle, and with T < S (a KV-cache step, a chunked prefill) the new queries see the
whole prefix. `jax.nn.dot_product_attention` aligns top-left instead. Explicit int
positions `[B, T]` / `[B, S]` (a KV cache, packed sequences, sequence shards) replace
them. `lengths` and `from_array` read array indices.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Int

from attnjax import _checks, _pytree

SKIP, PARTIAL, FULL = 0, 1, 2

# Positions are int32; a range over no valid entry is (_BIG, −_BIG), which every rule
# reads as "nothing here".
_BIG = np.iinfo(np.int32).max // 2


# --------------------------------------------------------------------------------------
# What a rule reads.


@dataclasses.dataclass(frozen=True)
class Coords:
    """Where a block of queries and keys of one example and one query head sits.

    b, n: int32 scalars, the example and the query head. q_idx `[bq, 1]` and k_idx
    `[1, bk]`: indices into the query and key arrays; q_pos / k_pos: their positions.
    """

    b: Array
    n: Array
    q_idx: Array
    k_idx: Array
    q_pos: Array
    k_pos: Array


@dataclasses.dataclass(frozen=True)
class Grid:
    """The block layout of a chunked call: T queries and S keys in blocks.

    T queries and S keys in blocks of block_q × block_k; the last block of each may
    hold padding."""

    t: int
    s: int
    block_q: int
    block_k: int

    @property
    def num_q_blocks(self) -> int:
        return -(-self.t // self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return -(-self.s // self.block_k)

    @property
    def padded_t(self) -> int:
        return self.num_q_blocks * self.block_q

    @property
    def padded_s(self) -> int:
        return self.num_k_blocks * self.block_k


@dataclasses.dataclass(frozen=True)
class Blocks(Grid):
    """The block grid of one head, with per-block ranges of indices and positions.

    Query block i covers indices [i·bq, (i + 1)·bq) ∩ [0, T), key block j likewise;
    ranges are taken over the valid (unpadded) entries only. Arrays are `[nq, 1]` for
    query blocks and `[1, nk]` for key blocks, so rules broadcast them to `[nq, nk]`.
    """

    q_pos: Array = None  # [T] int32
    k_pos: Array = None  # [S] int32

    def query_range(self, x):
        """(min, max) of a `[T]` int array over each query block: `[nq, 1]` each."""
        lo, hi = _block_range(x, self.t, self.block_q)
        return lo[:, None], hi[:, None]

    def key_range(self, x):
        """(min, max) of a `[S]` int array over each key block: `[1, nk]` each."""
        lo, hi = _block_range(x, self.s, self.block_k)
        return lo[None, :], hi[None, :]

    @functools.cached_property
    def q_pos_range(self):
        return self.query_range(self.q_pos)

    @functools.cached_property
    def k_pos_range(self):
        return self.key_range(self.k_pos)

    @functools.cached_property
    def q_idx_range(self):
        first = np.arange(self.num_q_blocks) * self.block_q
        last = np.minimum(first + self.block_q, self.t) - 1
        return jnp.asarray(first[:, None], jnp.int32), jnp.asarray(last[:, None], jnp.int32)

    @functools.cached_property
    def k_idx_range(self):
        first = np.arange(self.num_k_blocks) * self.block_k
        last = np.minimum(first + self.block_k, self.s) - 1
        return jnp.asarray(first[None, :], jnp.int32), jnp.asarray(last[None, :], jnp.int32)

    def shape(self) -> tuple[int, int]:
        return self.num_q_blocks, self.num_k_blocks


def _block_range(x, length: int, block: int):
    """Per-block (min, max) of `x [length]`; padding past `length` is ignored."""
    count = -(-length // block)
    pad = count * block - length
    x = x[:length].astype(jnp.int32)
    lo = jnp.pad(x, (0, pad), constant_values=_BIG).reshape(count, block).min(axis=1)
    hi = jnp.pad(x, (0, pad), constant_values=-_BIG).reshape(count, block).max(axis=1)
    return lo, hi


def _classes(every: ArrayLike, none: ArrayLike) -> Array:
    """FULL where every pair of a block is visible, SKIP where none is, else PARTIAL."""
    return jnp.where(every, FULL, jnp.where(none, SKIP, PARTIAL)).astype(jnp.int8)


def _full_grid(blocks: Blocks, value: int) -> Array:
    return jnp.full(blocks.shape(), value, jnp.int8)


# --------------------------------------------------------------------------------------
# Binding: the batched API checks a rule's arrays against the call's shapes once, and
# lays every array out as [B|1, N|1, ...] (shared axes kept at size 1), so that one
# vmap over examples and heads hands each head its own slice.


@dataclasses.dataclass(frozen=True)
class Shape:
    """The sizes of one attention call, and how to lay out per-call arrays."""

    b: int
    t: int
    s: int
    n: int
    unbatched: bool = False

    def per_example(self, name: str, x, tail: tuple[int, ...], layout: str,
                    count: bool = False) -> Array:
        """Integer `x` of shape `[B, *tail]` (or `tail` alone, shared by the batch;
        unbatched calls take `tail` alone) as int32 `[B|1, 1, *tail]`.

        Any integer dtype. Values the int32 rules cannot hold are an error when they are
        known (outside jit); traced ones saturate at int32's bounds, which is exact for
        lengths (any length past the sequence means all of it). count: x counts
        positions (a length), so a known negative value is an error too; a traced one
        means none, as 0 does."""
        low, high = np.iinfo(np.int32).min, np.iinfo(np.int32).max
        if isinstance(x, jax.core.Tracer):
            if not jnp.issubdtype(x.dtype, jnp.integer):
                raise TypeError(f"{name} must have an integer dtype; got {x.dtype}")
            if x.dtype.itemsize > 4 or x.dtype == jnp.uint32:
                x = jnp.clip(x, max(low, jnp.iinfo(x.dtype).min), high)
        else:
            # Known values are read before jnp.asarray, which without x64 wraps int64
            # to int32 silently.
            try:
                known = np.asarray(x)
            except OverflowError:
                raise ValueError(f"{name} must lie in int32's range [{low}, {high}]; got "
                                 f"{x!r}") from None
            if not np.issubdtype(known.dtype, np.integer):
                raise TypeError(f"{name} must have an integer dtype; got {known.dtype}")
            bad = _checks.outside(known, low, high)
            if bad is not None:
                raise ValueError(f"{name} must lie in int32's range [{low}, {high}]; got "
                                 f"{bad} (dtype {known.dtype})")
            if count:
                _check_counts(name, known)
            # laid out on the host and put on the device as it is: no program compiles
            # (jnp.asarray, astype and indexing would each compile one per shape)
            x = known.astype(np.int32)
        batched = () if self.unbatched else (self.b,)
        shapes = {tuple(tail), batched + tuple(tail)}
        if tuple(x.shape) not in shapes:
            expected = " or ".join(_checks.shape_str(s) for s in sorted(shapes, key=len))
            raise ValueError(f"{name} must have shape {layout} = {expected}; got "
                             f"{_checks.shape_str(x.shape)}")
        if x.ndim == len(tail):
            x = x[None]
        if isinstance(x, np.ndarray):
            return jax.device_put(x[:, None])
        return x.astype(jnp.int32)[:, None]


# --------------------------------------------------------------------------------------
# Rules. Each is a frozen pytree dataclass: arrays are its pytree children, sizes and
# functions its static fields.


class Rule:
    """A predicate over (query, key) pairs; see the module docstring."""

    kind: ClassVar[str] = "rule"
    # Data fields indexed by key: they travel with a key/value shard (ring attention).
    key_fields: ClassVar[tuple[str, ...]] = ()
    # Rules that read array indices rather than positions cannot follow a shard.
    by_index: ClassVar[bool] = False

    def visible(self, at: Coords) -> Bool[Array, "#bq #bk"]:
        raise NotImplementedError

    def classify(self, blocks: Blocks) -> Int[Array, "nq nk"]:
        raise NotImplementedError

    def bind(self, shape: Shape) -> Rule:
        """This rule with its arrays checked and laid out as `[B|1, N|1, ...]`."""
        return self

    def padded(self, t: int, s: int) -> Rule:
        """This rule with its per-query and per-key arrays zero-padded to t queries and
        s keys (the chunked kernel's whole blocks). Padding is along the trailing axes,
        so it applies to one head's arrays and to a bound mask's alike."""
        return self

    def parts(self) -> tuple[Rule, ...]:
        return (self,)

    def describe(self) -> str:
        """The rule in a line, as it would be built: `causal & segments`."""
        return self.kind


@_pytree.dataclass()
class Everything(Rule):
    """Every key is visible to every query."""

    kind = "everything"

    def visible(self, at):
        return jnp.ones((at.q_idx.shape[0], at.k_idx.shape[1]), bool)

    def classify(self, blocks):
        return _full_grid(blocks, FULL)


@_pytree.dataclass()
class Causal(Rule):
    """Key j is visible to query i when k_pos ≤ q_pos."""

    kind = "causal"

    def visible(self, at):
        return at.k_pos <= at.q_pos

    def classify(self, blocks):
        (q_lo, q_hi), (k_lo, k_hi) = blocks.q_pos_range, blocks.k_pos_range
        return _classes(k_hi <= q_lo, k_lo > q_hi)


@_pytree.dataclass(meta=("left", "right"))
class Window(Rule):
    """q_pos − left ≤ k_pos ≤ q_pos + right.

    Compared as −left ≤ k_pos − q_pos ≤ right: q_pos ± a side wraps around in int32 for
    sides near its limit (a window of 2**31 − 1, unbounded, hid keys), the difference of
    two positions does not (positions less than 2**31 apart)."""

    left: int
    right: int
    kind = "window"

    def describe(self):
        return f"window({self.left}, {self.right})"

    def visible(self, at):
        offset = at.k_pos - at.q_pos
        return (offset >= -self.left) & (offset <= self.right)

    def classify(self, blocks):
        (q_lo, q_hi), (k_lo, k_hi) = blocks.q_pos_range, blocks.k_pos_range
        every = (k_lo - q_hi >= -self.left) & (k_hi - q_lo <= self.right)
        none = (k_hi - q_lo < -self.left) | (k_lo - q_hi > self.right)
        return _classes(every, none)


@_pytree.dataclass(meta=("size",))
class ChunkedCausal(Rule):
    """Causal within fixed chunks of positions: k_pos ≤ q_pos and both in one chunk."""

    size: int
    kind = "chunked_causal"

    def describe(self):
        return f"chunked_causal({self.size})"

    def visible(self, at):
        same = (at.k_pos // self.size) == (at.q_pos // self.size)
        return same & (at.k_pos <= at.q_pos)

    def classify(self, blocks):
        (q_lo, q_hi), (k_lo, k_hi) = blocks.q_pos_range, blocks.k_pos_range
        one_chunk = ((q_lo // self.size == q_hi // self.size)
                     & (k_lo // self.size == k_hi // self.size)
                     & (q_lo // self.size == k_lo // self.size))
        every = one_chunk & (k_hi <= q_lo)
        none = (k_lo > q_hi) | (k_hi // self.size < q_lo // self.size) | (
            k_lo // self.size > q_hi // self.size)
        return _classes(every, none)


@_pytree.dataclass(data=("length",))
class Prefix(Rule):
    """A prefix every query sees (prefix-LM).

    Keys at positions below `length` are visible to every query (prefix-LM, with
    `causal() | prefix(n)`)."""

    length: Any
    kind = "prefix"

    def visible(self, at):
        return at.k_pos < self.length

    def classify(self, blocks):
        k_lo, k_hi = blocks.k_pos_range
        return jnp.broadcast_to(_classes(k_hi < self.length, k_lo >= self.length),
                                blocks.shape())

    def bind(self, shape):
        return Prefix(shape.per_example("prefix length", self.length, (), "[B]", count=True))


@_pytree.dataclass(data=("query", "key"))
class Lengths(Rule):
    """Valid lengths: queries and keys past them are padding.

    Query rows at or past `query` and keys at or past `key` (array indices) are
    padding: they see, and are seen by, nothing."""

    query: Any
    key: Any
    kind = "lengths"
    by_index = True

    def visible(self, at):
        out = jnp.ones((at.q_idx.shape[0], at.k_idx.shape[1]), bool)
        if self.query is not None:
            out = out & (at.q_idx < self.query)
        if self.key is not None:
            out = out & (at.k_idx < self.key)
        return out

    def classify(self, blocks):
        every, none = True, False
        if self.query is not None:
            q_lo, q_hi = blocks.q_idx_range
            every, none = every & (q_hi < self.query), none | (q_lo >= self.query)
        if self.key is not None:
            k_lo, k_hi = blocks.k_idx_range
            every, none = every & (k_hi < self.key), none | (k_lo >= self.key)
        return jnp.broadcast_to(_classes(every, none), blocks.shape())

    def bind(self, shape):
        bound = [None if x is None else shape.per_example(name, x, (), "[B]", count=True)
                 for name, x in (("query lengths", self.query), ("key lengths", self.key))]
        return Lengths(*bound)


@_pytree.dataclass(data=("query", "key"))
class Segments(Rule):
    """A query sees only keys of its own segment (sequence packing)."""

    query: Any
    key: Any
    kind = "segments"
    key_fields = ("key",)

    def visible(self, at):
        q = lax.dynamic_slice_in_dim(self.query, at.q_idx[0, 0], at.q_idx.shape[0])
        k = lax.dynamic_slice_in_dim(self.key, at.k_idx[0, 0], at.k_idx.shape[1])
        return q[:, None] == k[None, :]

    def classify(self, blocks):
        q_lo, q_hi = blocks.query_range(self.query)
        k_lo, k_hi = blocks.key_range(self.key)
        every = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
        return _classes(every, (q_hi < k_lo) | (k_hi < q_lo))

    def bind(self, shape):
        query = shape.per_example("segment ids (query)", self.query, (shape.t,), "[B, T]")
        key = self.query if self.key is None else self.key
        if self.key is None and shape.t != shape.s:
            raise ValueError(f"segments(query_ids) alone needs T = S (self-attention); got "
                             f"T={shape.t}, S={shape.s}: pass key_ids too")
        key = shape.per_example("segment ids (key)", key, (shape.s,), "[B, S]")
        return Segments(query, key)

    def padded(self, t, s):
        return Segments(pad_axis(self.query, t, -1), pad_axis(self.key, s, -1))


@_pytree.dataclass(data=("array",))
class FromArray(Rule):
    """A boolean array broadcastable to `[B, N, T, S]` (True = visible)."""

    array: Any
    kind = "from_array"
    by_index = True

    def visible(self, at):
        return slice_block(self.array, at.q_idx[0, 0], at.q_idx.shape[0],
                         at.k_idx[0, 0], at.k_idx.shape[1])

    def classify(self, blocks):
        # Reduce the array block by block: exact, and cheap next to attention itself. The
        # barrier keeps XLA from folding the reductions of a constant mask (one closed
        # over, as flax users build theirs) at compile time: seconds for a 4096² mask.
        x = lax.optimization_barrier(self.array)
        t, s = x.shape
        nq, nk = blocks.shape()
        rows = blocks.block_q if t > 1 else 1
        cols = blocks.block_k if s > 1 else 1
        padded_any = jnp.pad(x, ((0, nq * rows - t if t > 1 else 0),
                                 (0, nk * cols - s if s > 1 else 0)), constant_values=False)
        padded_all = jnp.pad(x, ((0, nq * rows - t if t > 1 else 0),
                                 (0, nk * cols - s if s > 1 else 0)), constant_values=True)
        grid_any = padded_any.reshape(-1, rows, padded_any.shape[1] // cols, cols).any((1, 3))
        grid_all = padded_all.reshape(-1, rows, padded_all.shape[1] // cols, cols).all((1, 3))
        return jnp.broadcast_to(_classes(grid_all, ~grid_any), blocks.shape())

    def bind(self, shape):
        layout = "[N, T, S]" if shape.unbatched else "[B, N, T, S]"
        target = (shape.n, shape.t, shape.s) if shape.unbatched else (
            shape.b, shape.n, shape.t, shape.s)
        _checks.check_mask("mask", self.array, target, layout)
        x = jnp.asarray(self.array)
        x = x.reshape((1,) * (len(target) - x.ndim) + x.shape)
        return FromArray(x if not shape.unbatched else x[None])

    def padded(self, t, s):
        return FromArray(pad_axis(pad_axis(self.array, t, -2, broadcast=True), s, -1,
                                   broadcast=True))


def pad_axis(x, size: int, axis: int, *, broadcast: bool = False):
    """Pads an axis of a boolean mask with False up to `size`.

    Zero-pad (False-pad) axis to `size`. With broadcast=True a unit axis stays as it
    is: it applies to every row (or column), padding included."""
    if x.shape[axis] == size or (broadcast and x.shape[axis] == 1):
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis % x.ndim] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def slice_block(x, row, rows: int, col, cols: int):
    """x[row:row+rows, col:col+cols], a unit (broadcast) axis kept whole."""
    if x.shape[0] > 1:
        x = lax.dynamic_slice_in_dim(x, row, rows, 0)
    if x.shape[1] > 1:
        x = lax.dynamic_slice_in_dim(x, col, cols, 1)
    return x


@_pytree.dataclass(data=("consts",), meta=("fn",))
class FromFn(Rule):
    """A rule given by a function of the indices, like FlexAttention's `mask_mod`.

    `fn(b, n, q_pos, k_pos) -> bool`, elementwise (FlexAttention's `mask_mod`): b and
    n are int32 scalars, q_pos `[bq, 1]` and k_pos `[1, bk]`. Every block is PARTIAL:
    combine it with a structural rule (`causal() & from_fn(f)`) for block skipping.
    consts: arrays fn takes after those four, where a kernel has made the arrays it
    closes over its arguments (`Mask.with_functions`)."""

    fn: Callable
    consts: tuple = ()
    kind = "from_fn"

    def visible(self, at):
        out = self.fn(at.b, at.n, at.q_pos, at.k_pos, *self.consts)
        try:
            out = jnp.asarray(out)
        except (TypeError, ValueError):   # None, a string, ...
            raise TypeError(f"from_fn's function must return an array of booleans; got "
                            f"{type(out).__name__}") from None
        if out.dtype != jnp.bool_:
            raise TypeError(f"from_fn's function must return booleans; got dtype {out.dtype}")
        grid = jnp.broadcast_shapes(at.q_pos.shape, at.k_pos.shape)
        try:
            fits = out.ndim <= len(grid) and jnp.broadcast_shapes(out.shape, grid) == grid
        except ValueError:  # shapes that do not broadcast
            fits = False
        if not fits:
            raise ValueError(f"from_fn's function must return one boolean per query and key: "
                             f"a shape that broadcasts with q_pos "
                             f"{_checks.shape_str(at.q_pos.shape)} and k_pos "
                             f"{_checks.shape_str(at.k_pos.shape)} to "
                             f"{_checks.shape_str(grid)}; got {_checks.shape_str(out.shape)}")
        return out

    def classify(self, blocks):
        return _full_grid(blocks, PARTIAL)


class _Pair(Rule):
    """Two rules combined: `combine` their elementwise answers, `pick` their classes."""

    combine: ClassVar[Callable]
    pick: ClassVar[Callable]

    def visible(self, at):
        return self.combine(self.left.visible(at), self.right.visible(at))

    def classify(self, blocks):
        return self.pick(self.left.classify(blocks), self.right.classify(blocks))

    def bind(self, shape):
        return type(self)(self.left.bind(shape), self.right.bind(shape))

    def padded(self, t, s):
        return type(self)(self.left.padded(t, s), self.right.padded(t, s))

    def parts(self):
        return self.left.parts() + self.right.parts()

    def describe(self):
        return f"({self.left.describe()} {self.symbol} {self.right.describe()})"


@_pytree.dataclass(data=("left", "right"))
class And(_Pair):
    """Visible where both are: SKIP if either skips, FULL if both are full."""

    left: Rule
    right: Rule
    kind, symbol = "and", "&"
    combine, pick = staticmethod(jnp.logical_and), staticmethod(jnp.minimum)


@_pytree.dataclass(data=("left", "right"))
class Or(_Pair):
    """Visible where either is: FULL if either is full, SKIP if both skip."""

    left: Rule
    right: Rule
    kind, symbol = "or", "|"
    combine, pick = staticmethod(jnp.logical_or), staticmethod(jnp.maximum)


# --------------------------------------------------------------------------------------
# The value users build and pass.


@_pytree.dataclass(data=("rule", "q_positions", "k_positions", "example", "head"))
class Mask:
    """Which keys each query may see: a rule tree and the metadata it reads.

    Build one with the constructors of this module and combine them with `&` and `|`.
    `positions` (set by `dot_product_attention(..., positions=...)`) and the example
    and head indices are filled in when a call binds the mask to its shapes.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import masks
        >>> mask = masks.causal() & masks.segments(jnp.array([[0, 0, 1, 1]]))
        >>> q = k = v = jnp.ones((1, 4, 2, 8))                             # [B, T, N, H]
        >>> attnjax.dot_product_attention(q, k, v, mask=mask).shape
        (1, 4, 2, 8)
    """

    rule: Rule = Everything()
    q_positions: Any = None
    k_positions: Any = None
    example: Any = None
    head: Any = None

    def __repr__(self) -> str:
        placed = "" if self.q_positions is None else ", with positions"
        return f"Mask({self.rule.describe()}{placed})"

    def __and__(self, other: Mask) -> Mask:
        return self._combine(other, And, "&")

    def __or__(self, other: Mask) -> Mask:
        return self._combine(other, Or, "|")

    def _combine(self, other, op, symbol: str) -> Mask:
        if not isinstance(other, Mask):
            raise TypeError(f"a Mask combines with {symbol} only with another Mask; got "
                            f"{type(other).__name__} (wrap arrays in masks.from_array)")
        for mask in (self, other):
            if mask.q_positions is not None or mask.example is not None:
                raise ValueError("combine masks before positions are set; pass positions= "
                                 "to the attention call instead")
        if isinstance(self.rule, Everything):
            return other if op is And else self
        if isinstance(other.rule, Everything):
            return self if op is And else other
        return Mask(op(self.rule, other.rule))

    @property
    def is_everything(self) -> bool:
        return isinstance(self.rule, Everything)

    def bind(self, shape: Shape, positions=None, *, traced: bool = False) -> Mask:
        """The mask with its arrays checked against `shape` and laid out per head, its
        positions (given, or bottom-right aligned) and the example and head indices.

        traced: the call's arrays are traced. Its default positions and indices are then
        iotas of its program; otherwise they are made on the host and put on the device,
        which compiles nothing (see per_example). (Made on the host under jit, they
        would be constants of the program, growing it with T.)"""
        xp = jnp if traced else np
        if positions is None:
            q_pos = xp.arange(shape.t, dtype=np.int32) + np.int32(shape.s - shape.t)
            k_pos = xp.arange(shape.s, dtype=np.int32)
        else:
            if not isinstance(positions, (tuple, list)) or len(positions) != 2:
                raise TypeError(f"positions must be a pair (query_positions [B, T], "
                                f"key_positions [B, S]); got {type(positions).__name__}")
            q_pos, k_pos = positions
        q_pos = shape.per_example("query positions", q_pos, (shape.t,), "[B, T]")
        k_pos = shape.per_example("key positions", k_pos, (shape.s,), "[B, S]")
        indices = (xp.arange(shape.b, dtype=np.int32)[:, None],
                   xp.arange(shape.n, dtype=np.int32)[None, :])
        return Mask(self.rule.bind(shape), q_pos, k_pos,
                    *(indices if traced else jax.device_put(indices)))

    # What the kernels ask of a bound mask, for one head.

    def padded(self, t: int, s: int) -> Mask:
        """The mask with its arrays zero-padded to t queries and s keys (see
        `Rule.padded`)."""
        return Mask(self.rule.padded(t, s), pad_axis(self.q_positions, t, -1),
                    pad_axis(self.k_positions, s, -1), self.example, self.head)

    def blocks(self, grid: Grid) -> Blocks:
        """The block grid of one head, with this mask's positions."""
        return Blocks(grid.t, grid.s, grid.block_q, grid.block_k, self.q_positions,
                      self.k_positions)

    def coords(self, q_start, bq: int, k_start, bk: int) -> Coords:
        """The coordinates of the block of bq queries from q_start and bk keys from
        k_start (positions zero-padded past the ends)."""
        q_idx = q_start + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
        k_idx = k_start + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        q_pos = lax.dynamic_slice_in_dim(self.q_positions, q_start, bq)[:, None]
        k_pos = lax.dynamic_slice_in_dim(self.k_positions, k_start, bk)[None, :]
        return Coords(self.example, self.head, q_idx, k_idx, q_pos, k_pos)

    def functions(self) -> tuple[Callable, ...]:
        """The user's functions in the rule tree (`from_fn`'s), in order."""
        return tuple(_functions(self.rule))

    def with_functions(self, convert) -> Mask:
        """This mask with each `from_fn` function fn replaced: `convert(fn)` gives a
        function of the four indices and then some arrays, and those arrays."""
        return dataclasses.replace(self, rule=_with_functions(self.rule, convert))

    def key_side(self) -> list:
        """The arrays indexed by key — key positions, then the rules' key-side arrays —
        that travel with a key/value shard from device to device (ring attention)."""
        return [self.k_positions] + _key_arrays(self.rule)

    def with_key_side(self, arrays) -> Mask:
        """This mask with the key-side arrays of another shard (`key_side`'s order)."""
        arrays = iter(arrays)
        k_positions = next(arrays)
        return dataclasses.replace(self, rule=_with_key_arrays(self.rule, arrays),
                                   k_positions=k_positions)

    def visible(self, at: Coords) -> Bool[Array, "bq bk"]:
        return jnp.broadcast_to(self.rule.visible(at), (at.q_idx.shape[0], at.k_idx.shape[1]))

    def classify(self, blocks: Blocks) -> Int[Array, "nq nk"]:
        return self.rule.classify(blocks)


def _rules(rule: Rule):
    """The rules of a tree, each before its children."""
    yield rule
    for field in dataclasses.fields(rule):
        child = getattr(rule, field.name)
        if isinstance(child, Rule):
            yield from _rules(child)


def _functions(rule: Rule) -> list:
    return [r.fn for r in _rules(rule) if isinstance(r, FromFn)]


def _with_functions(rule: Rule, convert) -> Rule:
    if isinstance(rule, FromFn):
        fn, consts = convert(rule.fn)
        return FromFn(fn, tuple(consts))
    updates = {field.name: _with_functions(getattr(rule, field.name), convert)
               for field in dataclasses.fields(rule)
               if isinstance(getattr(rule, field.name), Rule)}
    return dataclasses.replace(rule, **updates) if updates else rule


def _key_arrays(rule: Rule) -> list:
    return [getattr(r, name) for r in _rules(rule) for name in r.key_fields]


def _with_key_arrays(rule: Rule, arrays) -> Rule:
    updates = {name: next(arrays) for name in rule.key_fields}
    for field in dataclasses.fields(rule):
        child = getattr(rule, field.name)
        if isinstance(child, Rule):
            updates[field.name] = _with_key_arrays(child, arrays)
    return dataclasses.replace(rule, **updates) if updates else rule


def everything() -> Mask:
    """Every key visible to every query.

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax import masks
        >>> q = k = v = jnp.ones((2, 6, 4, 8))                             # [B, T, N, H]
        >>> import attnjax
        >>> attnjax.dot_product_attention(q, k, v, mask=masks.everything()).shape   # no mask
        (2, 6, 4, 8)
    """
    return Mask()


def causal() -> Mask:
    """Key j is visible to query i when k_pos ≤ q_pos (bottom-right aligned by default).

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import masks
        >>> q = k = v = jnp.ones((2, 6, 4, 8))                             # [B, T, N, H]
        >>> attnjax.dot_product_attention(q, k, v, mask=masks.causal()).shape
        (2, 6, 4, 8)
    """
    return Mask(Causal())


def window(left: int, right: int | None = None) -> Mask:
    """q_pos − left ≤ k_pos ≤ q_pos + right; `window(w)` is `window(w, w)`.

    A side of 2**31 − 1 or more (positions are int32) is unbounded.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import masks
        >>> q = k = v = jnp.ones((2, 6, 4, 8))                             # [B, T, N, H]
        >>> attnjax.dot_product_attention(q, k, v, mask=masks.causal() & masks.window(2, 0)).shape
        (2, 6, 4, 8)
    """
    left, right = _checks.resolve_window(left if right is None else (left, right))
    return Mask(Window(left, right))


def lengths(query: Int[ArrayLike, "*B"] | None = None,
            key: Int[ArrayLike, "*B"] | None = None) -> Mask:
    """Valid query and key lengths per example; the rest is padding.

    Valid lengths per example: rows at or past `query[b]` are padding (zeros out)
    and keys at or past `key[b]` are never seen.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import masks
        >>> q = k = v = jnp.ones((2, 6, 4, 8))                             # [B, T, N, H]
        >>> lengths = jnp.array([6, 3])                                    # [B]
        >>> out = attnjax.dot_product_attention(q, k, v, mask=masks.lengths(lengths))
        >>> out.shape, float(out[1, 3:].sum())                             # padded rows are zeros
        ((2, 6, 4, 8), 0.0)
    """
    if query is None and key is None:
        raise ValueError("lengths needs query= or key= (int [B]); got neither")
    # lists as the lengths keywords take them (jax.nn's)
    query, key = (_checks.as_array(f"lengths {name}", x) if isinstance(x, (list, tuple)) else x
                  for name, x in (("query", query), ("key", key)))
    for name, x in (("query", query), ("key", key)):
        if x is not None and not hasattr(x, "dtype") and not isinstance(x, int):
            raise TypeError(f"lengths {name} must be an int array [B]; got {type(x).__name__}")
    return Mask(Lengths(query, key))


def segments(query_ids: Int[ArrayLike, "*B T"], key_ids: Int[ArrayLike, "*B S"] | None = None
             ) -> Mask:
    """Sequence packing: a query sees only keys of its own segment.

    Sequence packing: query i sees key j only when they carry the same segment id.
    key_ids defaults to query_ids (self-attention).

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import masks
        >>> ids = jnp.array([[0, 0, 0, 1, 1, 1]])                          # [B, T]: two documents
        >>> q = k = v = jnp.ones((1, 6, 2, 8))
        >>> attnjax.dot_product_attention(q, k, v, mask=masks.causal() & masks.segments(ids)).shape
        (1, 6, 2, 8)
    """
    return Mask(Segments(query_ids, key_ids))


def _check_counts(name: str, counts) -> None:
    """Known numbers of positions (an int or an array; a traced one is not known) must be
    non-negative."""
    if isinstance(counts, jax.core.Tracer) or not np.size(counts):
        return
    shortest = np.min(np.asarray(counts))
    if shortest < 0:
        raise ValueError(f"{name} must be non-negative (a number of positions); got "
                         f"{shortest}")


def prefix(length: int | Int[ArrayLike, "*B"]) -> Mask:
    """Keys below `length` are seen by every query (prefix-LM).

    Keys at positions below `length` (an int, or int `[B]`) are seen by every query;
    prefix-LM is `causal() | prefix(n)`.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import masks
        >>> q = k = v = jnp.ones((1, 6, 2, 8))
        >>> prefix_lm = masks.causal() | masks.prefix(3)       # the first 3 see each other
        >>> attnjax.dot_product_attention(q, k, v, mask=prefix_lm).shape
        (1, 6, 2, 8)
    """
    if isinstance(length, (list, tuple)):
        length = _checks.as_array("prefix length", length)
    if isinstance(length, bool) or not (isinstance(length, (int, np.integer))
                                        or hasattr(length, "dtype")):
        raise TypeError(f"prefix length must be an int or an int array [B]; got {length!r}")
    _check_counts("prefix length", length)   # when made, as a call checked it
    return Mask(Prefix(length))


def chunked_causal(size: int) -> Mask:
    """Causal attention within chunks of `size` positions.

    Causal attention within chunks of `size` positions (chunk c holds positions
    [c·size, (c + 1)·size)); nothing across chunks.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import masks
        >>> q = k = v = jnp.ones((1, 8, 2, 8))                             # [B, T, N, H]
        >>> attnjax.dot_product_attention(q, k, v, mask=masks.chunked_causal(4)).shape
        (1, 8, 2, 8)
    """
    return Mask(ChunkedCausal(_checks.positive_int("chunked_causal size", size)))


def from_array(mask: Bool[ArrayLike, "..."]) -> Mask:
    """A boolean array broadcastable to `[B, N, T, S]`, True = may attend.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import masks
        >>> allowed = jnp.tril(jnp.ones((6, 6), bool))                     # [T, S]
        >>> q = k = v = jnp.ones((1, 6, 2, 8))
        >>> attnjax.dot_product_attention(q, k, v, mask=masks.from_array(allowed)).shape
        (1, 6, 2, 8)
    """
    return Mask(FromArray(mask))


def from_fn(fn: Callable) -> Mask:
    """A mask rule from any elementwise function of the indices.

    `fn(b, n, q_pos, k_pos) -> bool`, elementwise on broadcastable int32 arrays
    (FlexAttention's `mask_mod`, with positions for indices).

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> from attnjax import masks
        >>> even = masks.from_fn(lambda b, n, q_pos, k_pos: (q_pos - k_pos) % 2 == 0)
        >>> q = k = v = jnp.ones((1, 6, 2, 8))                             # [B, T, N, H]
        >>> attnjax.dot_product_attention(q, k, v, mask=masks.causal() & even).shape
        (1, 6, 2, 8)
    """
    if not callable(fn):
        raise TypeError(f"from_fn needs a callable fn(b, n, q_pos, k_pos); got "
                        f"{type(fn).__name__}")
    _checks.check_arguments("from_fn's fn", fn, "fn(b, n, q_pos, k_pos)", 4)
    return Mask(FromFn(fn))


# --------------------------------------------------------------------------------------
# Dense boolean masks, for users who want the [T, S] arrays themselves.


def _grid(mask: Mask, num_queries: int, num_keys: int) -> Bool[Array, "T S"]:
    num_queries = _checks.positive_int("num_queries", num_queries)
    num_keys = _checks.positive_int("num_keys", num_keys)
    bound = mask.bind(Shape(1, num_queries, num_keys, 1, unbatched=True))
    head = jax.tree.map(lambda x: x[0, 0], bound)
    return head.visible(head.coords(0, num_queries, 0, num_keys))


def causal_mask(num_queries: int, num_keys: int | None = None) -> Bool[Array, "T S"]:
    """`[T, S]`: key j is visible to query i when j ≤ i + (S − T). S defaults to T.

    Examples:
        >>> from attnjax import masks
        >>> masks.causal_mask(2, 3).astype(int).tolist()                   # [T, S], bottom-right
        [[1, 1, 0], [1, 1, 1]]
    """
    return _grid(causal(), num_queries, num_queries if num_keys is None else num_keys)


def sliding_window_mask(num_queries: int, num_keys: int, window_size: int | tuple[int, int]
                        ) -> Bool[Array, "T S"]:
    """`[T, S]`: query i sees key j when i' − left ≤ j ≤ i' + right, i' = i + (S − T).

    Examples:
        >>> from attnjax import masks
        >>> masks.sliding_window_mask(3, 3, (1, 0)).astype(int).tolist()   # [T, S]
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    left, right = _checks.resolve_window(window_size)
    return _grid(window(left, right), num_queries, num_keys)


def padding_mask(lengths: Int[ArrayLike, " B"], max_length: int) -> Bool[Array, "B L"]:
    """`[B, L]`: position l of example b is real (not padding) when l < lengths[b].

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax import masks
        >>> masks.padding_mask(jnp.array([3, 1]), 4).astype(int).tolist()  # [B, L]
        [[1, 1, 1, 0], [1, 0, 0, 0]]
    """
    lengths = jnp.asarray(lengths)
    _checks.check_rank("lengths", lengths, (1,), "[B]")
    _checks.check_lengths("lengths", lengths, lengths.shape, "[B]")
    try:
        max_length = operator.index(max_length)
    except TypeError:
        max_length = -1
    if max_length < 0:
        raise ValueError(f"max_length must be an int ≥ 0; got {max_length!r}")
    _check_counts("lengths", lengths)
    # [1, L]
    pos = lax.broadcasted_iota(jnp.int32, (1, max_length), 1)
    return pos < lengths.astype(jnp.int32)[:, None]


def query_key_mask(query_lengths: Int[ArrayLike, " B"], key_lengths: Int[ArrayLike, " B"],
                   num_queries: int, num_keys: int) -> Bool[Array, "B 1 T S"]:
    """`[B, 1, T, S]`: both query i and key j are real positions of example b.

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax import masks
        >>> masks.query_key_mask(jnp.array([2, 1]), jnp.array([3, 2]), 2, 3).shape   # [B, 1, T, S]
        (2, 1, 2, 3)
    """
    # [B, T], [B, S]
    q_valid = padding_mask(query_lengths, num_queries)
    k_valid = padding_mask(key_lengths, num_keys)
    if 1 not in (q_valid.shape[0], k_valid.shape[0]) and q_valid.shape[0] != k_valid.shape[0]:
        raise ValueError(f"query_lengths and key_lengths must have one length an example, "
                         f"[B] alike; got {_checks.shape_str(np.shape(query_lengths))} and "
                         f"{_checks.shape_str(np.shape(key_lengths))}")
    return (q_valid[:, :, None] & k_valid[:, None, :])[:, None, :, :]


def combine_masks(*masks: Bool[ArrayLike, "..."] | None) -> Bool[Array, "..."] | None:
    """The logical AND of boolean masks, skipping None.

    Logical AND of the boolean arrays that are not None, broadcast together; None if
    none is.

    Examples:
        >>> from attnjax import masks
        >>> both = masks.combine_masks(masks.causal_mask(3), None,
        ...                            masks.sliding_window_mask(3, 3, 1))
        >>> both.shape                                                 # [T, S]
        (3, 3)
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    for i, m in enumerate(present):
        if isinstance(m, Mask):
            raise TypeError(f"combine_masks combines boolean arrays; got a Mask as masks[{i}] "
                            f"(Masks combine with & and |; masks.from_array makes one of an "
                            f"array)")
        _checks.check_mask(f"masks[{i}]", m, np.shape(m), "its own shape")
    rank = max(m.ndim for m in present)
    # Left-pad ranks explicitly: the project runs with implicit rank promotion off.
    present = [m.reshape((1,) * (rank - m.ndim) + m.shape) for m in present]
    try:
        np.broadcast_shapes(*(m.shape for m in present))
    except ValueError:
        shapes = ", ".join(_checks.shape_str(m.shape) for m in masks if m is not None)
        raise ValueError(f"combine_masks needs masks that broadcast together; got shapes "
                         f"{shapes}") from None
    return functools.reduce(jnp.logical_and, present)
