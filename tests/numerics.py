"""The numerics a user runs with, for tests of training: the suite itself turns on
float64 and strict promotion (conftest.py), which flax and optax are not written for."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np


@contextlib.contextmanager
def as_users_run():
    """float32 by default and standard dtype promotion, inside this block."""
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        yield



# A child process's environment for the same random bits (see users_random_bits).
USERS_RANDOM_BITS = {"JAX_THREEFRY_PARTITIONABLE": "1"}


@contextlib.contextmanager
def users_random_bits():
    """jax's threefry in its partitionable form, jax's default and a user's, inside this
    block, for tests that compare training on a mesh with training on one device. The
    suite draws its keys' bits in the classic form (conftest.py: its programs compile
    faster), in which a run with dropout on 2 devices left a one-device run's losses by
    1e-4 from its 21st step on (the copy test config of tests/test_parallel.py); without
    dropout, or in the partitionable form, they stayed within 1e-6 for 50 steps."""
    with jax.threefry_partitionable(True):
        yield


def relative_error(actual, expected) -> float:
    """max |a − e| / max |e|: relative to the array's scale, so near-zero entries of a
    well-scaled array do not dominate. The scale is floored at 1, the scale of unit
    normal inputs: when every query sees a single key, the exact query and bias
    gradients p·(dp − Σ p·dp) cancel to zero, and float32 leaves residues of about 1e-7
    from the O(1) terms that cancel; relative to zero, any residue would be infinite."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1.0)


def softmax_float64(q, k, v, scale, *, causal=False, bias=None):
    """softmax(q·kᵀ·scale + bias) v `[B, T, N, V]` in float64, differentiable (jax):
    the exact value of the inputs as they are rounded. k and v may have fewer heads
    (grouped-query attention); causal is square (T = S)."""
    q, k, v = (x.astype(jnp.float64) for x in (q, k, v))
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + bias
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones(logits.shape[-2:], bool)), logits, -jnp.inf)
    return jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(logits, axis=-1), v)
