"""Strict numerics and runtime shape checks for the whole suite.

The CPU is split into four emulated devices for the multi-device tests (computations
not given a mesh run on the first). float64 is enabled so references and gradient checks
can run in double precision; every test therefore names its dtype, and the library must
never promote silently. Rank and
dtype promotion are strict, and jaxtyping checks every annotated argument of attnjax
(the hook must be installed before attnjax is first imported).
"""

import os
import zlib

# Four emulated CPU devices for the multi-device tests; set before jax is imported.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

from jaxtyping import install_import_hook  # noqa: E402

with install_import_hook("attnjax", "beartype.beartype"):
    import attnjax  # noqa: E402,F401

import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A key per test, different for every test and stable across runs (from its id)."""
    return jax.random.key(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def float32():
    """Training tests run as a user runs it: float32 and standard dtype promotion."""
    from tests.numerics import as_users_run

    with as_users_run():
        yield
