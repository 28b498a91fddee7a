"""The numerics a user runs with, for tests of training: the suite itself turns on
float64 and strict promotion (conftest.py), which flax and optax are not written for."""

import contextlib

import jax


@contextlib.contextmanager
def as_users_run():
    """float32 by default and standard dtype promotion, inside this block."""
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        yield


# XLA options for tests that compile many one-off programs (one per hypothesis example):
# the same operations, compiled several times faster and run slower.
QUICK_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                 "xla_cpu_use_fusion_emitters": False}
