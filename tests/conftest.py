"""Strict numerics and runtime shape checks for the whole suite.

The CPU is split into four emulated devices for the multi-device tests (computations
not given a mesh run on the first). float64 is enabled so references and gradient checks
can run in double precision; every test therefore names its dtype, and the library must
never promote silently. Rank and dtype promotion are strict, and jaxtyping checks every
annotated argument of the library: attnjax and its nn, nnx, parallel and kv_cache
modules, and the toy trainer, attnjax.toy (the hook must be installed before they are
first imported; the command-line runs the tests start are not checked). A test of
attnjax's own error messages takes the `own_checks_only` fixture.
"""

import ctypes
import ctypes.util
import gc
import os
import shutil
import tempfile
import zlib

# The suite runs on the CPU, also where jax has a GPU or TPU (JAX_PLATFORMS=cuda, say,
# overrides it): its multi-device tests emulate CPU devices, some tests check what
# implementation=None picks on a CPU (and, with jax.default_backend patched, on a GPU),
# and float32 comparisons assume full-precision products, which GPUs compute in TF32 by
# default (attnjax and jax.nn alike: 1.2e-3 against 6e-7 on an H100). Inherited by the
# command-line runs the tests start.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Four emulated CPU devices for the multi-device tests; set before jax is imported. The
# suite's programs are small and it spends most of its time compiling them: XLA's CPU
# backend compiles them at LLVM optimisation level 0, without LLVM's expensive passes and
# with its older elemental emitters rather than the fusion emitters (the same operations
# in the same order, compiled several times faster, running slower), each program as one
# LLVM module (split into parts, a small program spends longer splitting than the second
# core saves: test_packing 57 -> 50 s). Inherited by the command-line runs the tests
# start.
# Of those flags, the ones this jax's XLA knows (tests/xla_flags.py): tried once, by the
# first process, whose choice its workers inherit.
QUICK_COMPILATION = ["--xla_backend_optimization_level=0",
                     "--xla_llvm_disable_expensive_passes=true",
                     "--xla_cpu_use_fusion_emitters=false",
                     "--xla_cpu_parallel_codegen_split_count=1"]
# The first two apply to every backend: where the suite runs on a GPU (JAX_PLATFORMS
# names another platform), they are left out, as XLA's GPU backend at optimisation
# level 0 computed wrong numbers (an H200, jax 0.11.2: a causal float64 chunked call
# 0.25 off in its output, passing at the default level).
if os.environ["JAX_PLATFORMS"] != "cpu":
    QUICK_COMPILATION = [f for f in QUICK_COMPILATION if f.startswith("--xla_cpu_")]
if "ATTNJAX_TEST_XLA_FLAGS" not in os.environ:
    from tests import xla_flags

    os.environ["ATTNJAX_TEST_XLA_FLAGS"] = " ".join(xla_flags.known(QUICK_COMPILATION))
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4",
     os.environ["ATTNJAX_TEST_XLA_FLAGS"]]
).strip()
# The training command keeps the memory it frees (attnjax.toy.cli.keep_freed_memory);
# the suite's processes, the xdist workers above all, return it, as their memory is
# what the suite's budget counts.
os.environ["ATTNJAX_KEEP_FREED_MEMORY"] = "0"
# One compilation cache for the whole run, made by the first process (xdist's controller)
# and inherited by its workers and every command-line run they start: the same train
# step compiles once, not once per subprocess. Every program goes in, however small:
# loading one costs less than compiling it again in the other worker or after a module
# has dropped its programs. Deleted at the end of the run, so every run starts cold, as
# a fresh clone does.
if "ATTNJAX_TEST_CACHE" not in os.environ:
    os.environ["ATTNJAX_TEST_CACHE"] = tempfile.mkdtemp(prefix="attnjax-test-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["ATTNJAX_TEST_CACHE"]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    _CACHE_OWNER = True
else:
    _CACHE_OWNER = False
# The test data is drawn on the host (tests/draws.py); the keys the tests hand to the
# library (initialisation, dropout) use threefry in its classic (non-partitionable)
# form, whose programs XLA compiles about three times faster on CPU; every test draws
# fresh data either way, and command-line runs the tests start inherit the same setting.
os.environ["JAX_THREEFRY_PARTITIONABLE"] = "0"

import jax  # noqa: E402


def _xla_threads_on_this_workers_share_of_the_cores() -> None:
    """Each xdist worker's XLA runs its programs on its own share of the cores (one of
    two, on two cores): its CPU client sizes and starts its thread pools while the
    process may run on that share alone, which it may use again once they have started.
    Every worker's pools spanned every core: on two cores the suite's programs ran 2
    workers × 2 threads on 2 cores, and took 268-270 s (458 s of CPU); 235-247 s (408-424)
    on one core each. The worker's own thread (tracing, compiling) and the processes it
    starts (the command line, as a user runs it) keep every core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")   # gw0, gw1, ...
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    first = int(worker.removeprefix("gw")) * share % (len(cores) - share + 1)
    os.sched_setaffinity(0, cores[first:first + share])
    try:
        jax.devices()
    finally:
        os.sched_setaffinity(0, cores)


_xla_threads_on_this_workers_share_of_the_cores()
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

from jaxtyping import install_import_hook  # noqa: E402

# The libraries attnjax imports, imported before the hook: while the hook loads a module
# of attnjax, Python looks for the compiled bytecode of every module that module imports
# first under a name of the hook's own, finds none and compiles the source (1,389
# modules, 3 s of each of the suite's processes, where PYTHONDONTWRITEBYTECODE is set).
import beartype  # noqa: E402,F401
import flax.linen  # noqa: E402,F401
import flax.nnx  # noqa: E402,F401
import optax  # noqa: E402,F401
import orbax.checkpoint  # noqa: E402,F401
import yaml  # noqa: E402,F401

with install_import_hook("attnjax", "beartype.beartype"):
    import attnjax  # noqa: E402,F401
    import attnjax.kv_cache  # noqa: E402,F401
    import attnjax.nn  # noqa: E402,F401
    import attnjax.nnx  # noqa: E402,F401
    import attnjax.parallel.context  # noqa: E402,F401
    import attnjax.parallel.ring  # noqa: E402,F401
    import attnjax.toy.cli  # noqa: E402,F401

import pytest  # noqa: E402

# pytest --suite-profile: where the suite's time goes
pytest_plugins = ("tests.suite_profile",)


# (xdist's loadfile hands out the modules with the most tests first. Handing out the
# longest first, --no-loadscope-reorder, measured slower: the two modules that start
# many command-line runs side by side then overlap.)
def pytest_collection_finish(session):
    """Once the tests are collected, the cyclic garbage collector as the command line
    runs it (`collect_less`): it took 5 of test_masks' 39 s, 1 s after."""
    from attnjax.toy.cli import collect_less

    collect_less()


def pytest_unconfigure(config):
    if _CACHE_OWNER:
        shutil.rmtree(os.environ["ATTNJAX_TEST_CACHE"], ignore_errors=True)


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


_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME else None


def _give_memory_back() -> None:
    """Return freed heap pages to the system (glibc only): the C allocator keeps what
    XLA's dropped programs held, so without this a worker's memory only ever grows to
    its heaviest module and then creeps on."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@pytest.fixture(autouse=True, scope="module")
def _one_module_of_compiled_programs():
    """Compiled programs are dropped after each module, so a worker holds those of one
    module at a time rather than of every module it has run."""
    yield
    jax.clear_caches()
    _give_memory_back()


@pytest.fixture
def own_checks_only():
    """attnjax's own checks and messages, as a user without runtime type checks meets
    them: jaxtyping's checks are off while the test runs."""
    from tests.checks import own_checks_only

    with own_checks_only():
        yield


@pytest.fixture
def own_compiled_programs():
    """For a test that runs much code eagerly (one compiled program per operation): its
    programs are dropped when it ends, not at the end of its module."""
    yield
    jax.clear_caches()
    _give_memory_back()
