"""Boolean masks (True = may attend) and the visibility rule behind them.

Causal masks and windows align the *last* query with the *last* key: query i sits at
position i' = i + (S − T) of the key sequence. With T = S this is the usual triangle;
with T < S (a KV-cache step, a chunked prefill) the new queries see the whole prefix.
`jax.nn.dot_product_attention` aligns top-left instead (i' = i).
"""

import functools

import jax.numpy as jnp
from jax import lax
from jaxtyping import ArrayLike, Bool, Int

from attnjax import _checks


def visible(
    q_pos: Int[ArrayLike, "t 1"],
    k_pos: Int[ArrayLike, "1 s"],
    *,
    num_queries: int,
    num_keys: int,
    is_causal: bool = False,
    window: tuple[int, int] | None = None,
    query_length: Int[ArrayLike, ""] | None = None,
    key_length: Int[ArrayLike, ""] | None = None,
) -> Bool[ArrayLike, "#t #s"] | None:
    """Which (query, key) pairs of one example may interact; None when all of them may.

    Positions are int32 indices into the full sequences (a block of them, for the
    chunked implementation). Lengths are this example's valid lengths.
    """
    aligned = q_pos + (num_keys - num_queries)
    conditions = []
    if is_causal:
        conditions.append(k_pos <= aligned)
    if window is not None:
        left, right = window
        conditions.append(k_pos >= aligned - left)
        conditions.append(k_pos <= aligned + right)
    if query_length is not None:
        conditions.append(q_pos < query_length.astype(jnp.int32))
    if key_length is not None:
        conditions.append(k_pos < key_length.astype(jnp.int32))
    if not conditions:
        return None
    return functools.reduce(jnp.logical_and, conditions)


def positions(num_queries: int, num_keys: int) -> tuple[Int[ArrayLike, "T 1"], Int[ArrayLike, "1 S"]]:
    """Query positions as a column and key positions as a row, int32."""
    q_pos = lax.broadcasted_iota(jnp.int32, (num_queries, 1), 0)
    k_pos = lax.broadcasted_iota(jnp.int32, (1, num_keys), 1)
    return q_pos, k_pos


def _full(num_queries: int, num_keys: int, **rule) -> Bool[ArrayLike, "T S"]:
    q_pos, k_pos = positions(num_queries, num_keys)
    mask = visible(q_pos, k_pos, num_queries=num_queries, num_keys=num_keys, **rule)
    return jnp.broadcast_to(mask, (num_queries, num_keys))


def causal_mask(num_queries: int, num_keys: int | None = None) -> Bool[ArrayLike, "T S"]:
    """`[T, S]`: key j is visible to query i when j ≤ i + (S − T). S defaults to T."""
    num_keys = num_queries if num_keys is None else num_keys
    return _full(num_queries, num_keys, is_causal=True)


def sliding_window_mask(
    num_queries: int, num_keys: int, window: int | tuple[int, int]
) -> Bool[ArrayLike, "T S"]:
    """`[T, S]`: query i sees key j when i' − left ≤ j ≤ i' + right, i' = i + (S − T)."""
    return _full(num_queries, num_keys, window=_checks.resolve_window(window))


def padding_mask(lengths: Int[ArrayLike, " B"], max_length: int) -> Bool[ArrayLike, "B L"]:
    """`[B, L]`: position l of example b is real (not padding) when l < lengths[b]."""
    lengths = jnp.asarray(lengths)
    _checks.check_rank("lengths", lengths, (1,), "[B]")
    _checks.check_lengths("lengths", lengths, lengths.shape, "[B]")
    # [1, L]
    pos = lax.broadcasted_iota(jnp.int32, (1, max_length), 1)
    return pos < lengths.astype(jnp.int32)[:, None]


def query_key_mask(
    query_lengths: Int[ArrayLike, " B"], key_lengths: Int[ArrayLike, " B"], num_queries: int, num_keys: int
) -> Bool[ArrayLike, "B 1 T S"]:
    """`[B, 1, T, S]`: both query i and key j are real positions of example b."""
    # [B, T]
    q_valid = padding_mask(query_lengths, num_queries)
    # [B, S]
    k_valid = padding_mask(key_lengths, num_keys)
    return (q_valid[:, :, None] & k_valid[:, None, :])[:, None, :, :]


def combine_masks(*masks: Bool[ArrayLike, "..."] | None) -> Bool[ArrayLike, "..."] | None:
    """Logical AND of the masks that are not None, broadcast together; None if none is."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    for i, m in enumerate(present):
        _checks.check_mask(f"masks[{i}]", m, m.shape, "its own shape")
    rank = max(m.ndim for m in present)
    # Left-pad ranks explicitly: the project runs with implicit rank promotion off.
    present = [m.reshape((1,) * (rank - m.ndim) + m.shape) for m in present]
    return functools.reduce(jnp.logical_and, present)
