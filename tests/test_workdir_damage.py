"""A damaged workdir and a full disk, met in process: a damaged metrics.jsonl line, a file
where the checkpoints go, and a disk that fills while metrics.jsonl, TensorBoard's events
or a checkpoint is written. Each ends with one clear error (or none) and loses nothing
already saved. (The command line under the same faults, in subprocesses: test_faults.)"""

import asyncio
import errno
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from attnjax.toy import cli
from attnjax.toy.checkpoints import CheckpointError, Checkpoints
from attnjax.toy.config import dump_config, load_config
from attnjax.toy.report import MetricsLog
from tests.children import environment, one_device_mesh
from tests.test_faults import ROOT, TINY



def log_record(step: int, rng: np.random.Generator) -> dict:
    """A log record as a run writes it, of fresh numbers."""
    return {"step": step, "loss": float(rng.uniform(0.5, 3.0)),
            "accuracy": float(rng.uniform()), "learning_rate": float(rng.uniform(0, 1e-2)),
            "tokens_per_s": float(rng.uniform(1e3, 1e5)), "elapsed_s": float(rng.uniform(1, 9))}


def eval_record(step: int, rng: np.random.Generator) -> dict:
    """An evaluation record as a run writes it, of fresh numbers."""
    return {"step": step, "eval_token_accuracy": float(rng.uniform()),
            "eval_exact_match": float(rng.uniform()), "eval_s": float(rng.uniform(0.1, 2))}


RECORDS = [log_record(1, np.random.default_rng(1)), eval_record(1, np.random.default_rng(2)),
           log_record(2, np.random.default_rng(3))]


class _FullDisk(io.RawIOBase):
    """A file on a disk with no room left: every write fails with ENOSPC, as a write
    or flush on a full disk does (it names no file)."""

    def writable(self) -> bool:
        return True

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _damaged(record: dict, **changes) -> bytes:
    """record's line with changes (a value None: the key removed)."""
    changed = {**record, **changes}
    return json.dumps({k: v for k, v in changed.items() if v is not None}).encode()


@pytest.mark.parametrize("line", [
    b"\xff\xfe garbage", b"5", b"[1, 2]", _damaged(RECORDS[0])[:30],
    _damaged(RECORDS[0], step=None, loss=1.0), _damaged(RECORDS[0], step="2"),
    _damaged(RECORDS[0], step=1.5), _damaged(RECORDS[0], step=2, accuracy=None),
    _damaged(RECORDS[0], step=2, accuracy=None, accuracz=0.5),
    _damaged(RECORDS[1], step=2, eval_exact_match="1"),
    _damaged(RECORDS[1], step=2, eval_s=True), _damaged(RECORDS[0], step=2, loss=None),
    _damaged(RECORDS[0], step=2, learning_rate=float("nan")),
    _damaged(RECORDS[1], step=2, eval_token_accuracy=float("inf")),
    _damaged(RECORDS[0], step=2, eval_s=1.0), b"[" * 100_000],
    ids=lambda line: str(line[:12]))
def test_a_damaged_metrics_line_is_dropped_with_what_follows_as_a_torn_one(tmp_path, line):
    """Bytes that are not UTF-8, JSON that is not a log or an evaluation record (an int
    "step" and the finite numbers of the record's keys, no other): the line and what
    follows are dropped, as for the torn last line of a killed process, and the
    records lost with it are told; a damaged last line, or one followed only by steps
    past the resumed one (dropped anyway), is not. (A record of another key, or of a
    key missing, had ended the run in a KeyError as curves.png was drawn; JSON nested
    past Python's recursion limit, in a RecursionError.)"""
    path = tmp_path / "metrics.jsonl"
    valid = b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS)
    rng = np.random.default_rng(int.from_bytes(line[:4].ljust(4), "little"))
    later = b"".join(json.dumps(r).encode() + b"\n"
                     for r in (log_record(3, rng), log_record(4, rng)))
    for rest, resume_step, warned in ((later, 10, [f"{path} line {len(RECORDS) + 1} is "
                                                   f"damaged: it and the 2 records after "
                                                   f"it (steps 3 to 4) are dropped"]),
                                      (later, 2, []), (b"", 10, [])):
        path.write_bytes(valid + line + b"\n" + rest)
        warnings = []
        log = MetricsLog(path, resume_step=resume_step, warn=warnings.append)
        log.close()
        assert log.records == RECORDS
        assert path.read_bytes() == valid
        assert warnings == warned


@pytest.mark.parametrize("where", [2, 5, 7])
@pytest.mark.parametrize("step", ["later", "earlier", "twice"])
def test_a_step_out_of_order_is_a_damaged_line(tmp_path, where, step):
    """A run writes its records in order of step, a log record before its step's
    evaluation: a line whose step is out of that order (a digit changed since, a line
    written twice) is damaged, dropped with what follows and told (a step made later
    had been taken as the run's end: the intact records after it dropped, and the
    warning said the file held none)."""
    rng = np.random.default_rng(where)
    every = int(rng.integers(2, 5))
    records = [make(s * every, rng) for s in range(1, 6) for make in (log_record, eval_record)]
    resume = 5 * every
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    if step == "twice":
        lines[where] = lines[where - 1]
    else:
        changed = (records[where]["step"] + 10 * every + 1 if step == "later" else
                   records[where - 2]["step"] - 1)
        lines[where] = _damaged(records[where], step=changed) + b"\n"
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"".join(lines))
    warnings = []
    log = MetricsLog(path, resume_step=resume, warn=warnings.append, log_every=every)
    log.close()
    assert log.records == records[:where]
    lost = records[where + 1:]
    assert warnings == [f"{path} line {where + 1} is damaged: it and the {len(lost)} records "
                        f"after it (steps {lost[0]['step']} to {lost[-1]['step']}) are "
                        f"dropped"]


def test_records_missing_before_the_resumed_step_are_told(tmp_path):
    """A metrics.jsonl cut short (mid-line or at a line's end), or deleted, loses
    records of steps the run resumes after and never writes again: told, with the
    steps; a killed run's torn line after its last checkpoint's records is not."""
    rng = np.random.default_rng(7)
    every = int(rng.integers(2, 6))
    steps = list(range(every, 12 * every + 1, every))
    records = [log_record(s, rng) for s in steps]
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    path = tmp_path / "metrics.jsonl"
    resume = steps[-1] + int(rng.integers(0, every))   # an interruption between log steps
    cut = int(rng.integers(2, 8))
    for text, kept in ((b"".join(lines[:cut]) + lines[cut][:9], cut),   # cut mid-line
                       (b"".join(lines[:cut]), cut),                    # at a line's end
                       (None, 0),                                       # deleted
                       (b"".join(lines) + b'{"step": 9', len(lines))):  # a torn last line
        path.unlink(missing_ok=True)
        if text is not None:
            path.write_bytes(text)
        warnings = []
        MetricsLog(path, resume_step=resume, warn=warnings.append, log_every=every).close()
        last = steps[kept - 1] if kept else 0
        assert warnings == ([] if kept == len(lines) else [
            f"{path} holds no records after step {last}: the records of steps {last + 1} to "
            f"{steps[-1]}, before step {resume} that the run resumes from, are lost (they "
            f"are not written again)"])


@pytest.mark.parametrize("full", ["metrics.jsonl", "events"])
def test_a_full_disk_while_metrics_are_written_stops_the_run_with_one_line(
        tmp_path, monkeypatch, float32, full):
    """The first log line meets a full disk (metrics.jsonl, or TensorBoard's events
    beside it): the run stops with a RunFailed naming the file and the last good
    checkpoint; closing the files on the way out raises nothing over it, and nothing
    is left to fail at exit."""
    if full == "metrics.jsonl":
        real_open = Path.open

        def open_full(self, mode="r", *args, **kwargs):
            if self.name == "metrics.jsonl" and mode == "a":
                return io.TextIOWrapper(io.BufferedWriter(_FullDisk()))
            return real_open(self, mode, *args, **kwargs)

        monkeypatch.setattr(Path, "open", open_full)
    else:
        import tensorboardX.record_writer

        monkeypatch.setattr(tensorboardX.record_writer, "open_file",
                            lambda path: io.BufferedWriter(_FullDisk()))
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    workdir = tmp_path / "run"
    with pytest.raises(cli.RunFailed) as failure:
        cli.run(config, workdir, mesh=one_device_mesh(), interactive=False)
    message = str(failure.value)
    assert "\n" not in message, message
    assert message.startswith(f"[Errno {errno.ENOSPC}] No space left on device: "), message
    assert str(workdir) in message and "Last good checkpoint: none" in message, message


def test_a_file_where_the_checkpoints_go_is_refused_before_training(tmp_path, float32):
    """The run a workdir holds keeps its metrics: nothing trains from scratch over them.
    Refused as the workdir is claimed, a mistake (exit 2), before anything compiles."""
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.yaml").write_text(dump_config(config))
    saved = b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS)
    (workdir / "metrics.jsonl").write_bytes(saved)
    (workdir / "checkpoints").write_text("hi\n")
    with pytest.raises(cli.ConfigError, match=r"^cannot use --workdir .*: .*checkpoints is a "
                                              r"file, not a directory; use another --workdir"):
        cli.run(config, workdir, mesh=one_device_mesh(), interactive=False)
    assert (workdir / "metrics.jsonl").read_bytes() == saved
    assert (workdir / "checkpoints").read_text() == "hi\n"


def test_checkpoints_without_their_config_are_refused_before_training(tmp_path, float32):
    """A workdir whose config.yaml is gone but whose checkpoints are there holds a run of
    an unknown config: resuming it with this command's (another seed, say) would mix
    two runs, so it is refused as a mistake, before anything compiles."""
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    workdir = tmp_path / "run"
    Checkpoints(workdir / "checkpoints", keep=1).save(5, {"w": jnp.ones((2, 3))}, {})
    with pytest.raises(cli.ConfigError, match=r"holds checkpoints but no config.yaml, so the "
                                              r"config they were trained with is unknown"):
        cli.run(config, workdir, mesh=one_device_mesh(), interactive=False)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["5"]


def test_a_full_disk_as_a_run_starts_fails_it_and_leaves_nothing(tmp_path, monkeypatch):
    """No room for the lock's pid in a new workdir, or for the config of a run: the run
    fails (exit 1: the machine's fault, not a mistake), and no workdir, lock or
    half-written config is left behind."""
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(cli.os, "write", full)
        with pytest.raises(cli.RunFailed, match=r"^cannot use --workdir .*new: \[Errno 28\] No "
                                                r"space left on device; nothing was written$"):
            cli.run(config, tmp_path / "new", mesh=one_device_mesh(), interactive=False)
    assert list(tmp_path.iterdir()) == []
    workdir = tmp_path / "run"
    workdir.mkdir()
    real_write_text = Path.write_text

    def half_written(self, text, *args, **kwargs):
        real_write_text(self, text[:len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", half_written)
    with pytest.raises(cli.RunFailed, match=r"No space left on device; the run in it, if any, "
                                            r"is as it was$"):
        cli._begin_run(workdir, config, force_new=False)
    assert list(workdir.iterdir()) == []


class _InFlight:
    """A read or write still in flight when orbax closed its loop: it reports the closed
    loop as it ends (as tensorstore's do, with nowhere to raise it)."""

    def __init__(self, loop):
        self.loop = loop

    def __del__(self):
        self.loop.call_soon_threadsafe(lambda: None)


def _failing(monkeypatch, name: str, error: Exception):
    """orbax's (de)serialization `name` made to fail with error, leaving an operation in
    flight; returns `echoes(caplog)`: what was logged with a traceback, or reported as
    unraisable, since."""
    from orbax.checkpoint._src.serialization import serialization

    async def fail(*args, **kwargs):
        loop = asyncio.new_event_loop()
        loop.close()
        _InFlight(loop)
        raise error

    monkeypatch.setattr(serialization, name, fail)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    return lambda caplog: ([r.getMessage() for r in caplog.records if r.exc_info]
                           + [str(u.exc_value) for u in unraisable])


def test_a_failed_checkpoint_save_is_said_once(tmp_path, monkeypatch, caplog):
    """A write that fails in orbax's threads (a full disk): save raises one
    CheckpointError, without orbax's threads logging it again with a traceback, or the
    writes still in flight each reporting orbax's closed event loop."""
    echoes = _failing(monkeypatch, "async_serialize_from_host",
                      OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    with caplog.at_level(logging.INFO), pytest.raises(
            CheckpointError, match=r"^cannot save the checkpoint of step 1 in .*: OSError: "
                                   r"\[Errno 28\] No space left on device$"):
        checkpoints.save(1, {"w": jnp.ones((3, 5), jnp.float32)}, {"step": 1})
    checkpoints.close()
    assert echoes(caplog) == []


def test_a_save_that_fails_in_a_collective_says_so(tmp_path, monkeypatch, caplog):
    """A save that another process of the run left (gloo's all-gather finding the peer
    gone) is a CheckpointError marked collective, which the trainer reports as lost
    contact with the other processes (it had blamed the checkpoint); a full disk is not."""
    _failing(monkeypatch, "async_serialize_from_host", ValueError(
        "UNKNOWN: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:534] Connection closed "
        "by peer [127.0.0.1]:41234"))
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    with caplog.at_level(logging.INFO), pytest.raises(CheckpointError) as failure:
        checkpoints.save(2, {"w": jnp.asarray(np.random.default_rng().normal(size=(3, 5)),
                                              jnp.float32)}, {"step": 2})
    checkpoints.close()
    assert failure.value.collective and "Gloo AllGather failed" in str(failure.value)
    _failing(monkeypatch, "async_serialize_from_host",
             OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    checkpoints = Checkpoints(tmp_path / "other", keep=3)
    with caplog.at_level(logging.INFO), pytest.raises(CheckpointError) as failure:
        checkpoints.save(2, {"w": jnp.asarray(np.random.default_rng().normal(size=(3, 5)),
                                              jnp.float32)}, {"step": 2})
    checkpoints.close()
    assert not failure.value.collective


def test_a_checkpoint_that_does_not_restore_is_said_once(tmp_path, monkeypatch, caplog):
    """A checkpoint of another model (a hand-edited config.yaml, another run's files):
    restore raises one CheckpointError, without orbax's reads in flight each reporting
    its closed event loop (dozens of tracebacks) or its threads logging it again."""
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    checkpoints.save(4, {"w": jnp.ones((3, 5), jnp.float32)}, {"step": 4})
    checkpoints.close()
    echoes = _failing(monkeypatch, "async_deserialize", ValueError("shape (3, 5) is not (3, 6)"))
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    with caplog.at_level(logging.INFO), pytest.raises(
            CheckpointError, match=r"^checkpoint step 4 in .* is intact but does not restore "
                                   r"into this run's model \(ValueError: .*\)$"):
        checkpoints.restore_latest({"w": jnp.ones((3, 6), jnp.float32)})
    checkpoints.close()
    assert echoes(caplog) == []


RESTORE_ANOTHER_MODEL = r'''
import sys

import jax.numpy as jnp
import numpy as np

from attnjax.toy.checkpoints import CheckpointError, Checkpoints
from attnjax.toy.cli import collect_less

collect_less()   # the garbage collector as the command runs it
generator = np.random.default_rng(int(sys.argv[2]))


def state(width):
    return {f"layer_{i}": {"w": jnp.asarray(generator.normal(size=(3, width)), jnp.float32),
                           "b": jnp.asarray(generator.normal(size=width), jnp.float32)}
            for i in range(40)}


checkpoints = Checkpoints(sys.argv[1], keep=3)
checkpoints.save(4, state(5), {"step": 4})
checkpoints.close()
checkpoints = Checkpoints(sys.argv[1], keep=3)
try:
    checkpoints.restore_latest(state(6))
except CheckpointError as e:
    print(e)
finally:
    checkpoints.close()
'''


def test_a_real_checkpoint_of_another_model_is_said_once_to_the_process_s_end(tmp_path):
    """The real failure (no stand-in): 40 layers saved 5 wide, restored 6 wide. Orbax's
    reads in flight fail, and their coroutines, freed after the restore has raised (at
    close or at exit), each printed an unraisable exception's traceback (13 lines of
    stderr for the command's one)."""
    script = tmp_path / "restore.py"
    script.write_text(RESTORE_ANOTHER_MODEL)
    seed = str(np.random.default_rng().integers(1 << 30))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "checkpoints"), seed],
                          cwd=ROOT, env=environment(None), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.fullmatch(r"checkpoint step 4 in .* is intact but does not restore into this "
                        r"run's model \(ValueError: .*\)\n", done.stdout), done.stdout
    assert done.stderr == ""


def test_orbax_s_echo_of_a_stop_of_several_processes_is_not_logged(caplog):
    """A signal to a run of several processes ends it with one line: orbax's own warning
    of the step where they stop together is dropped, and only it."""
    from orbax.checkpoint._src.multihost import multihost

    with caplog.at_level(logging.WARNING, logger="absl"):
        multihost._maybe_log_reached_preemption(int(np.random.default_rng().integers(1, 99)),
                                                True)
        logging.getLogger("absl").warning("another warning")
    assert [r.getMessage() for r in caplog.records] == ["another warning"]
