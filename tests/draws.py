"""Test data drawn on the host with numpy's generator.

`jax.random` compiles a program for every shape and dtype it draws: a few hundred in the
suite, about 0.1 s each at its compiler settings. numpy draws the same distributions
without one, and the arrays then go to the device as the dtype asked for. Every draw is
fresh random data, seeded from a jax key (the `rng` fixture's, or `jax.random.key(n)`),
an int, or a generator already made from one, whose later draws then differ.
"""

import jax
import jax.numpy as jnp
import numpy as np

Source = jax.Array | int | np.random.Generator


def host(source: Source) -> np.random.Generator:
    """numpy's generator for a key, an int or (itself) a generator."""
    if isinstance(source, np.random.Generator):
        return source
    if isinstance(source, jax.Array):
        source = np.asarray(jax.random.key_data(source)).ravel().tolist()
    return np.random.default_rng(source)


def _on_device(x: np.ndarray, dtype) -> jax.Array:
    return jax.device_put(np.asarray(x, dtype=jnp.dtype(dtype)))


def normal(source: Source, shape: tuple[int, ...], dtype=jnp.float32,
           scale: float = 1.0) -> jax.Array:
    """Normal draws with mean 0 and standard deviation `scale` (float32 ones for
    narrower dtypes, rounded to them)."""
    draw = scale * host(source).standard_normal(shape)
    if jnp.dtype(dtype).itemsize < 4:
        draw = draw.astype(np.float32)
    return _on_device(draw, dtype)


def normals(source: Source, *shapes: tuple[int, ...], dtype=jnp.float32) -> tuple:
    """One normal array per shape, drawn one after another from one generator."""
    generator = host(source)
    return tuple(normal(generator, shape, dtype) for shape in shapes)


def randint(source: Source, shape: tuple[int, ...], low: int, high: int,
            dtype=jnp.int32) -> jax.Array:
    """Integers uniform in [low, high)."""
    return _on_device(host(source).integers(low, high, shape), dtype)


def bernoulli(source: Source, p: float, shape: tuple[int, ...],
              always: int | None = None) -> jax.Array:
    """True with probability p; along the last axis, index `always` is always True (a
    random mask in which every query sees that key, so no row is empty)."""
    draw = host(source).random(shape) < p
    if always is not None:
        draw[..., always] = True
    return _on_device(draw, jnp.bool_)
