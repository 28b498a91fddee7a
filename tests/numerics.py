"""The numerics a user runs with, for tests of training: the suite itself turns on
float64 and strict promotion (conftest.py), which flax and optax are not written for."""

import contextlib

import jax
import numpy as np


@contextlib.contextmanager
def as_users_run():
    """float32 by default and standard dtype promotion, inside this block."""
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        yield



def relative_error(actual, expected) -> float:
    """max |a − e| / max |e|: relative to the array's scale, so near-zero entries of a
    well-scaled array do not dominate. The scale is floored at 1, the scale of unit
    normal inputs: when every query sees a single key, the exact query and bias
    gradients p·(dp − Σ p·dp) cancel to zero, and float32 leaves residues of about 1e-7
    from the O(1) terms that cancel; relative to zero, any residue would be infinite."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1.0)
