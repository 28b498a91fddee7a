"""The environment of the command-line runs the tests start, the one-device mesh of a run
in the tests' own process (both as on a user's machine, where the suite's process has
four emulated devices), and a free port for the coordinator of a run of several
processes, and the processes of such a run."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax

from attnjax.parallel import mesh as mesh_lib

ROOT = Path(__file__).resolve().parents[1]


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


def processes_of_one_run(workdir: Path, overrides: list[str], count: int = 2,
                         own_args: dict | None = None, env: dict | None = None,
                         **popen) -> list[subprocess.Popen]:
    """The training command (train_toy.py --workdir workdir --set ...) as processes 0 to
    count - 1 of one run, one device each, gloo on 127.0.0.1; `popen` for their output.
    own_args: {process id: arguments of that process alone, after the others}; env:
    variables to set besides `environment`'s."""
    port = free_port()
    settings = [arg for o in overrides for arg in ("--set", o)]
    return [subprocess.Popen(
        [sys.executable, str(ROOT / "train_toy.py"), "--workdir", str(workdir),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(count), "--process-id",
         str(i), *settings, *(own_args or {}).get(i, [])], env=environment(1, **(env or {})), text=True,
        **popen) for i in range(count)]
