"""The numerics a user runs with, for tests of training: the suite itself turns on
float64 and strict promotion (conftest.py), which flax and optax are not written for."""

import contextlib

import jax


@contextlib.contextmanager
def as_users_run():
    """float32 by default and standard dtype promotion, inside this block."""
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        yield

