"""The environment of the command-line runs the tests start, the one-device mesh of a run
in the tests' own process (both as on a user's machine, where the suite's process has
four emulated devices), and a free port for the coordinator of a run of several
processes."""

import os
import socket

import jax

from attnjax.parallel import mesh as mesh_lib


def environment(devices: int | None, **extra: str) -> dict[str, str]:
    """os.environ for a child process, with `devices` emulated CPU devices (None: one, as
    on a user's machine) and the suite's other XLA flags (its quick compilation); it
    shares the suite's compilation cache (conftest.py). `extra` overrides variables."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return dict(os.environ, XLA_FLAGS=" ".join(flags), **extra)


def one_device_mesh():
    """The mesh `attnjax.toy.cli.run` makes on a machine with one device."""
    return mesh_lib.make_mesh(devices=jax.devices()[:1])


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
