"""The suite's XLA flags that the installed jax's XLA knows.

XLA ends the process when XLA_FLAGS names a flag it does not know (a fatal "Unknown
flag in XLA_FLAGS"), before any test runs, and a flag can leave XLA between jax
versions: under jax 0.11.2 (on a GPU machine) every pytest-xdist worker died at start-up
("node down") with the suite's quick-compilation flags, and ran without them. So the
flags are tried first, in a child process (about a second, once a run); this module
imports nothing of the suite, so that conftest.py can call it before jax is imported."""

import os
import subprocess
import sys


def start_backend(flags: list[str], timeout: float) -> subprocess.CompletedProcess:
    """A child process that starts jax's CPU backend with these XLA flags, run to its
    end (its output captured as text)."""
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _taken(flags: list[str], timeout: float) -> bool:
    """Whether a CPU backend starts with these XLA flags (XLA refuses a flag at once: a
    child that is still starting after `timeout` seconds is on a slow machine, and the
    flags count as taken)."""
    try:
        return start_backend(flags, timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return True


def known(flags: list[str], timeout: float = 120.0) -> list[str]:
    """The flags that XLA takes: all of them when it takes them together (one child
    process), else each that it takes alone."""
    if _taken(flags, timeout):
        return list(flags)
    return [flag for flag in flags if _taken([flag], timeout)]
