"""The KV cache of the attention modules: one implementation for `attnjax.nn` (linen)
and `attnjax.nnx`.

A cache is three arrays, flax's: cached_key `[batch..., L, K, H]`, cached_value
`[batch..., L, K, V]` and cache_index (int32 scalar, the filled length). Each module
keeps them in its own kind of variable (linen's "cache" collection, nnx.Cache) and hands
them here: `append` writes the new keys and values at the index and says where the new
queries sit, and `visible` turns that into the Mask the engine reads — the filled slots,
by positions, never a T×S array — so a long cache decodes on the chunked kernel too.
"""

import contextlib
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnjax import _checks, heads, masks

_LOG = logging.getLogger("attnjax")
# Whether appends skip the overrun check: part of jit's cache key, so that a step
# traced outside `sized_for_every_append` and called inside it (or the other way round)
# is traced anew rather than reused with the other setting.
_SIZED = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def sized_for_every_append():
    """Inside it, appends skip the overrun check: each cache holds every token.

    Under `jax.jit` the cache index is known only when a step runs, so each append checks
    for an overrun with a host callback (inside a `lax.cond`: called only on an
    overrun). A program that may call the host loses jit's C++ dispatch and never enters
    jax's persistent compilation cache: one attention layer decoding a `[1, 1, 256]`
    token took 284 µs a token with the check, 161 µs without it, flax's own layer 184 µs
    (`python benchmarks/decode.py --layer-only`, 2-core CPU). Size each cache with `init`
    on a full-length input `[B, L, D]`, then call the step inside this, as a context
    manager (the setting is part of jit's cache key: a step traced outside it is traced
    again inside), or as a decorator under `jax.jit`, so that every trace of the step is.
    An append past the cache is then not reported; its tokens are written over the
    cache's last slots.
    attnjax's own decoding loops (`greedy_decode`, `generate`) always trace this way;
    `attnjax.nn` and `attnjax.nnx` caches alike.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> layer = nn.MultiHeadDotProductAttention(num_heads=2, decode=True)
        >>> x = jnp.ones((1, 8, 16))                      # [B, L, D]: a cache of 8 tokens
        >>> variables = layer.init(jax.random.key(0), x)
        >>> @jax.jit
        ... @nn.sized_for_every_append()
        ... def step(variables, token):                   # token [B, 1, D]
        ...     out, cache = layer.apply(variables, token, mutable=["cache"])
        ...     return out, {**variables, **cache}
        >>> for i in range(8):
        ...     out, variables = step(variables, x[:, i:i + 1])
        >>> out.shape, int(variables["cache"]["cache_index"])
        ((1, 1, 16), 8)
    """
    with _SIZED(True):
        yield


class Appended(NamedTuple):
    """The cache after an append, and where the new tokens sit in it."""

    key: jax.Array             # [batch..., L, K, H]
    value: jax.Array           # [batch..., L, K, V]
    index: jax.Array           # int32 []: the filled length, start + T
    positions: tuple           # (query [T] at start..start+T−1, key [L] at 0..L−1)


def append(cached_key, cached_value, index, key, value) -> Appended:
    """Write the new keys `[batch..., T, K, H]` and values `[batch..., T, K, V]` at the
    cache index. Any T: one token, or a chunk of a prefill that then attends to everything
    cached before it (and, with a causal mask, to its own earlier tokens)."""
    cache_shape = cached_key.shape
    if cached_value.shape[:-1] != cache_shape[:-1]:
        expected = _checks.shape_str(cache_shape[:-1] + ("V",))
        raise ValueError(
            f"decode=True: the cached values must have the cached keys' batch axes, length "
            f"and heads, [batch..., L, K, V] = {expected}; got "
            f"{_checks.shape_str(cached_value.shape)}")
    for name, new, cached in (("keys", key, cached_key), ("values", value, cached_value)):
        if new.dtype != cached.dtype:
            raise TypeError(
                f"decode=True: the new {name} are {new.dtype} but the cache holds "
                f"{cached.dtype}: make the cache in the keys' dtype (attnjax.nnx: "
                f"init_cache(..., dtype={new.dtype}))")
    if key.shape[:-3] != cache_shape[:-3] or key.shape[-2:] != cache_shape[-2:]:
        expected = _checks.shape_str(cache_shape[:-3]) + " T " + _checks.shape_str(
            cache_shape[-2:])
        raise ValueError(
            f"decode=True: new keys must have the cache's batch axes and heads, "
            f"[batch..., T, K, H] = {expected}; got {_checks.shape_str(key.shape)} (a cache "
            f"is sized for inputs [batch..., L, features]: attnjax.nnx's init_cache takes "
            f"their whole shape)")
    value_shape = key.shape[:-1] + cached_value.shape[-1:]
    if value.shape != value_shape:
        raise ValueError(
            f"decode=True: new values must have the keys' batch axes, T and heads and the "
            f"cache's V, [batch..., T, K, V] = {_checks.shape_str(value_shape)}; got "
            f"{_checks.shape_str(value.shape)}")
    integer_array = (hasattr(index, "dtype") and np.ndim(index) == 0
                     and jnp.issubdtype(index.dtype, jnp.integer))
    traced = isinstance(index, jax.core.Tracer)
    if not (_checks.is_int(index) or integer_array):
        got = f"a traced {index.dtype}{list(index.shape)}" if traced else repr(index)
        raise TypeError(f"the cache index must be an int (a slot); got {got}")
    if not traced and int(index) < 0:
        raise ValueError(f"the cache index must be >= 0 (the first free slot); got "
                         f"{int(index)}")
    capacity, new = cache_shape[-3], key.shape[-3]
    check_room(index, new, capacity)
    # int32 whatever integer type it came as (lax's update takes one index type); a
    # negative one, possible only traced, writes at slot 0 (check_room reports it)
    start = jnp.maximum(jnp.asarray(index).astype(jnp.int32), 0) if traced else jnp.int32(index)
    zero = jnp.int32(0)
    at = (zero,) * (key.ndim - 3) + (start, zero, zero)
    cached_key, cached_value = _sharded_as_new(cached_key, cached_value, key)
    cached_key = lax.dynamic_update_slice(cached_key, key, at)
    cached_value = lax.dynamic_update_slice(cached_value, value, at)
    positions = (start + jnp.arange(new, dtype=jnp.int32),
                 jnp.arange(capacity, dtype=jnp.int32))
    return Appended(cached_key, cached_value, start + new, positions)


def _sharded_as_new(cached_key, cached_value, key):
    """The caches sharded as the new keys (their length axis whole), where those are
    sharded in their type (a mesh of Explicit axes) and the caches are not so: a cache
    made from a shape alone (`init_cache`) meets keys of a batch split over devices."""
    spec = heads.explicit_spec(key)
    if spec is None:
        return cached_key, cached_value
    entries = list(tuple(spec) + (None,) * (key.ndim - len(spec)))
    entries[-3] = None
    return tuple(x if heads.explicit_spec(x) == jax.sharding.PartitionSpec(*entries)
                 else heads.reshard(x, entries, key) for x in (cached_key, cached_value))


def visible(mask: masks.Mask, appended: Appended) -> masks.Mask:
    """`mask` restricted to the filled slots of the cache."""
    return mask & masks.lengths(key=appended.index)


def filled_slots(appended: Appended, batch: tuple[int, ...]) -> jax.Array:
    """flax's cache mask, for an attention function with flax's signature: every filled
    slot for each new token, bool `[batch..., 1, 1, L]`."""
    capacity = appended.key.shape[-3]
    return jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32) < appended.index,
                            batch + (1, 1, capacity))


def check_room(start, new: int, capacity: int) -> None:
    """Appending past the cache is a ValueError at trace time when the index is known.

    Under jit the index is known only when the step runs, where an exception could only
    surface as an XLA INTERNAL error: the overrun (or a negative index) is logged instead
    (logger "attnjax", ERROR, on stderr by default), and the write stays inside the cache
    (XLA clamps the update to the last slots; a negative index writes from slot 0), so
    the step's output is finite but no longer that of the sequence. Size the cache for
    the longest sequence. (Not checked while tracing inside `sized_for_every_append`,
    the way to `jax.export` a step: a host callback cannot be exported.)"""
    message = "KV cache overrun: {} new tokens at position {} exceed the cache length {}"
    if new > capacity:   # past the cache wherever it starts: known while tracing
        raise ValueError(message.format(new, "any" if isinstance(start, jax.core.Tracer)
                                        else int(start), capacity))
    if isinstance(start, jax.core.Tracer):
        if _SIZED.value:
            return

        def report(position):
            if int(position) < 0:
                _LOG.error(f"the cache index must be >= 0 (the first free slot); got "
                           f"{int(position)}: the tokens were written from slot 0")
            elif int(position) + new > capacity:
                _LOG.error(message.format(new, int(position), capacity)
                           + "; the tokens were written over the cache's last slots")
        # the host is called only on an overrun: a callback costs ~0.5 ms on a CPU, for
        # each layer at every step (1 of the 9 ms of a dates decoding step)
        lax.cond((start < 0) | (start + new > capacity),
                 lambda: jax.debug.callback(report, start), lambda: None)
    elif int(start) + new > capacity:
        raise ValueError(message.format(new, int(start), capacity))
