"""Feed-forward and positional-encoding modules."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnjax import heads, multi_head

POSITIONAL = ("sinusoidal", "learned", "none")
ACTIVATIONS = ("relu", "gelu")


def check_choice(name: str, value, allowed: tuple) -> None:
    """A ValueError naming the option unless value is one of allowed."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}; got {value!r}")


class FeedForward(nn.Module):
    """Position-wise Dense(d_ff) → activation → dropout → Dense(D, the input's width).

    activation: "relu" or "gelu"; dropout_rate: on the hidden units; deterministic:
    as in flax, a field or the call's (not both): False applies the dropout (with a
    "dropout" rng), True evaluates; required when dropout_rate > 0 outside `init`, so
    that dropout is never silently off in training; dtype: the computation's.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> ffn = nn.FeedForward(d_ff=64)
        >>> x = jnp.ones((2, 5, 16))                                       # [B, L, D]
        >>> ffn.apply(ffn.init(jax.random.key(0), x), x).shape
        (2, 5, 16)
    """

    d_ff: int
    dropout_rate: float = 0.0
    activation: str = "relu"
    dtype: Any = jnp.float32
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, x, *, deterministic: bool | None = None):
        check_choice("activation", self.activation, ACTIVATIONS)
        if deterministic is None and self.deterministic is None:
            if self.dropout_rate and not self.is_initializing():
                raise ValueError(
                    f"FeedForward has dropout_rate={self.dropout_rate}, so deterministic is "
                    f"required: False to train (with rngs={{'dropout': key}}), True to "
                    f"evaluate, given to the call or the constructor; got neither")
            deterministic = True
        deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        act = {"relu": nn.relu, "gelu": nn.gelu}[self.activation]
        # [B, L, F]
        hidden = act(nn.Dense(self.d_ff, dtype=self.dtype, name="wi",
                              dot_general=multi_head.dot_general)(x))
        hidden = nn.Dropout(self.dropout_rate)(hidden, deterministic=deterministic)
        # [B, L, D]
        return nn.Dense(x.shape[-1], dtype=self.dtype, name="wo",
                        dot_general=multi_head.dot_general)(hidden)


def sinusoids(length: int, d_model: int, offset=0) -> jnp.ndarray:
    """`[L, D]` sin/cos encodings of positions offset..offset+L-1 (the 2017 paper's).

    Examples:
        >>> from attnjax import nn
        >>> nn.sinusoids(10, 16).shape                                      # [L, D]
        (10, 16)
    """
    # [L]
    positions = offset + lax.broadcasted_iota(jnp.int32, (length,), 0)
    return _sinusoids_at(positions, d_model)


def _sinusoids_at(positions, d_model: int) -> jnp.ndarray:
    """`[..., L, D]` sin/cos encodings of int positions `[..., L]`."""
    # [D/2]
    rates = jnp.asarray(1.0 / (10000.0 ** (np.arange(0, d_model, 2) / d_model)), jnp.float32)
    positions = jnp.asarray(positions).astype(jnp.float32)
    # [..., L, D/2]
    angles = positions[..., None] * rates.reshape((1,) * positions.ndim + rates.shape)
    sin, cos = jnp.sin(angles), jnp.cos(angles[..., : d_model // 2])
    # sin at the even features, cos at the odd ones, interleaved (no scatter into zeros,
    # which takes no sharding from the positions: per-example ones split by examples)
    pairs = jnp.stack([sin[..., : d_model // 2], cos], axis=-1)
    encoding = pairs.reshape(angles.shape[:-1] + (2 * (d_model // 2),))
    return jnp.concatenate([encoding, sin[..., d_model // 2:]], axis=-1)


class PositionalEncoding(nn.Module):
    """Adds sinusoidal or learned position encodings to `[B, L, D]` embeddings.

    kind: "sinusoidal", "learned" (a `[max_len, D]` table) or "none". Positions are
    0..L−1 unless given: int `[B, L]`, e.g. restarting at each sequence packed into a row.
    With decode=True the module keeps its own count in the "cache" collection, so tokens
    fed a chunk at a time without positions get those of one full-length call.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> pe = nn.PositionalEncoding(max_len=32)
        >>> x = jnp.zeros((2, 5, 16))                                      # [B, L, D]
        >>> pe.apply(pe.init(jax.random.key(0), x), x).shape
        (2, 5, 16)
    """

    max_len: int
    kind: str = "sinusoidal"
    decode: bool = False

    @nn.compact
    def __call__(self, x, positions=None):
        check_choice("kind", self.kind, POSITIONAL)
        length, d_model = x.shape[-2], x.shape[-1]
        if self.kind == "none":
            return x
        offset = jnp.int32(0)
        if self.decode:
            initialised = self.has_variable("cache", "position")
            position = self.variable("cache", "position", lambda: jnp.array(0, jnp.int32))
            if initialised:
                offset = position.value
                position.value = offset + length
        if positions is None:
            # [1, L]
            positions = offset + lax.broadcasted_iota(jnp.int32, (1, length), 1)
        if self.kind == "sinusoidal":
            # [B|1, L, D]
            table = _sinusoids_at(positions, d_model)
        else:
            full = self.param("embedding", nn.initializers.normal(0.02), (self.max_len, d_model))
            # Positions past the table read its last row.
            table = heads.take_rows(full, positions, mode="clip")
        return x + table.astype(x.dtype)
