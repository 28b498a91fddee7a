"""Faults, run as a user meets them: the command line under SIGINT, SIGTERM and SIGKILL
at several moments from start-up on, one process of a run of two killed or signalled,
damaged and partial checkpoints, two runs on one workdir, a read-only and a full disk,
and every kind of bad config value. Each ends with one clear line and a workdir a rerun
continues from exactly.

The command-line runs are subprocesses started side by side by one module fixture
(`runs`), sharing a compilation cache; the tests read their outcomes. A fault that
Python cannot produce unprivileged (a full or read-only disk) comes from a driver
script that makes the process's writes under one directory fail with ENOSPC or EROFS,
and can send the process a signal while a named function runs (during a compilation).
"""

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from attnjax.toy import cli, make_task
from attnjax.toy import train as training
from attnjax.toy.checkpoints import DAMAGED, MANIFEST, Checkpoints, damage
from attnjax.toy.config import dump_config, load_config
from attnjax.toy.report import TIMING_KEYS
from tests import children

ROOT = Path(__file__).resolve().parents[1]
# 20 steps, every one logged (a kill can land on any), checkpoints every 5.
TINY = ["task.num_symbols=5", "task.min_len=1", "task.max_len=6", "task.eval_size=20",
        "model.d_model=32", "model.num_heads=2", "model.d_ff=64", "model.num_encoder_layers=1",
        "model.num_decoder_layers=1", "model.max_len=16", "optim.warmup_steps=5", "steps=20",
        "batch_size=8", "log_every=1", "eval_every=20", "checkpoint_every=5",
        "keep_checkpoints=3", "eval_batch_size=20"]
STEPS, EVERY = 20, 5
TIMEOUT = 240.0

# Runs train_toy.py with faults: FAULT_ERRNO makes writes under FAULT_DIR fail (once
# FAULT_AFTER exists, if given); FAULT_SIGNAL="SIG:module:function:call:delay:times"
# sends SIG `times` times when call number `call` of module.function begins, or from
# another thread `delay` seconds later (while it runs) when delay is not 0.
DRIVER = r'''
import builtins, errno, io, os, runpy, signal, sys, threading

# as `python train_toy.py` would: the script's own directory first on the path
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
root = os.environ.get("FAULT_DIR")
code = getattr(errno, os.environ.get("FAULT_ERRNO", "ENOSPC"))
after = os.environ.get("FAULT_AFTER")


def inside(path):
    if root is None or not isinstance(path, (str, bytes, os.PathLike)):
        return False
    path = os.path.abspath(os.fsdecode(path))
    return path == root or path.startswith(root + os.sep)


def failing(path):
    return inside(path) and (after is None or os.path.exists(after))


def refuse(path):
    raise OSError(code, os.strerror(code), os.fsdecode(path))


class Faulty:
    """A file opened for writing under root, whose writes fail once the disk is full."""

    def __init__(self, file, path):
        self._file, self._path = file, path

    def write(self, data):
        if failing(self._path):
            refuse(self._path)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._file.__exit__(*exc)

    def __iter__(self):
        return iter(self._file)


real_open, real_os_open, real_mkdir = io.open, os.open, os.mkdir
real_replace, real_rename = os.replace, os.rename


def fault_open(file, mode="r", *args, **kwargs):
    writing = any(c in mode for c in "wax+")
    if writing and failing(file):
        refuse(file)
    f = real_open(file, mode, *args, **kwargs)
    return Faulty(f, file) if writing and inside(file) else f


def fault_os_open(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and failing(path):
        refuse(path)
    return real_os_open(path, flags, *args, **kwargs)


def fault_mkdir(path, *args, **kwargs):
    if failing(path) and not os.path.exists(path):
        refuse(path)
    return real_mkdir(path, *args, **kwargs)


def fault_move(real):
    def move(src, dst, *args, **kwargs):
        if failing(dst):
            refuse(dst)
        return real(src, dst, *args, **kwargs)
    return move


builtins.open = io.open = fault_open
os.open, os.mkdir = fault_os_open, fault_mkdir
os.replace, os.rename = fault_move(real_replace), fault_move(real_rename)

if os.environ.get("FAULT_SIGNAL"):
    import importlib
    name, module, function, call, delay, times = os.environ["FAULT_SIGNAL"].split(":")
    module = importlib.import_module(module)
    original = getattr(module, function)
    calls = []

    def send():
        for _ in range(int(times)):
            os.kill(os.getpid(), getattr(signal, name))

    def signalling(*args, **kwargs):
        calls.append(1)
        if len(calls) == int(call):
            if float(delay):
                threading.Timer(float(delay), send).start()
            else:
                send()
        return original(*args, **kwargs)

    setattr(module, function, signalling)

runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _records(workdir: Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def _intact(workdir: Path) -> list[int]:
    root = workdir / "checkpoints"
    steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []
    return [s for s in steps if damage(root / str(s)) is None]


class Run:
    """One train_toy.py process, its output in files (read while it runs)."""

    def __init__(self, tmp: Path, name: str, workdir: Path, *args, env=None, driver=None,
                 overrides=TINY):
        self.name, self.workdir = name, workdir
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        command = [sys.executable, str(ROOT / "train_toy.py"), "--workdir", str(workdir),
                   *(arg for o in overrides for arg in ("--set", o)), *args]
        if driver is not None:
            command = [sys.executable, str(driver), *command[1:]]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err,
                                            env={**os.environ, **(env or {})})
        self.returncode = None

    @property
    def stdout(self) -> str:
        return self.out.read_text()

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def wait_for(self, text: str, timeout: float = TIMEOUT) -> None:
        """Until text is on stdout (polled every 10 ms)."""
        deadline = time.monotonic() + timeout
        while text not in self.stdout:
            assert self.process.poll() is None, f"{self.name} ended: {self.stderr[-2000:]}"
            assert time.monotonic() < deadline, f"{self.name}: no {text!r} in time"
            time.sleep(0.01)

    def wait(self) -> "Run":
        self.returncode = self.process.wait(timeout=TIMEOUT)
        return self


def _wait_until(condition, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST),
               key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every command-line fault, side by side; the outcomes by name."""
    tmp = tmp_path_factory.mktemp("faults")
    driver = tmp / "driver.py"
    driver.write_text(DRIVER)
    # one device, and a compilation cache of their own, filled by the reference run
    env = children.environment(1, PYTHONUNBUFFERED="1",
                               JAX_COMPILATION_CACHE_DIR=str(tmp / "compilation_cache"))
    # the line of the step right after a checkpoint: the save just before must be durable
    kill_at = random.choice(range(EVERY + 1, STEPS, EVERY))
    done = {"kill_at": kill_at}
    started = []

    def start(name, *args, workdir=None, **kwargs):
        run = Run(tmp, name, workdir or tmp / name, *args, env={**env, **kwargs.pop("env", {})},
                  **kwargs)
        started.append(run)
        return run

    try:
        # Start-up: no compilation yet, so these overlap the reference's compilation.
        whole = start("whole")
        early = start("early_sigint")
        time.sleep(random.uniform(0.3, 0.8))   # somewhere in the imports
        early.process.send_signal(signal.SIGINT)
        readonly_dir = tmp / "readonly"
        readonly_dir.mkdir()
        readonly = start("readonly", workdir=readonly_dir, driver=driver,
                         env={"FAULT_DIR": str(readonly_dir), "FAULT_ERRNO": "EROFS"})
        _wait_until(lambda: (whole.workdir / cli.LOCK).exists()
                    and (whole.workdir / cli.LOCK).read_text().strip())
        second = start("second", workdir=whole.workdir)
        for run in (early, readonly, second):
            done[run.name] = run.wait()

        # Once the reference has compiled (the cache is filled), the faults in training.
        whole.wait_for(f"step 1/{STEPS}")
        killed = start("killed")
        again = start("again")   # the same command from scratch: the same records
        # at given steps: a step takes milliseconds, faster than a signal sent on a line
        stopped = start("sigterm", driver=driver,
                        env={"FAULT_SIGNAL": "SIGTERM:attnjax.toy.train:train_batch:8:0:1"})
        twice = start("sigint_twice", driver=driver,
                      env={"FAULT_SIGNAL": "SIGINT:attnjax.toy.train:train_batch:8:0:2"})
        # while the parameters' initialisation compiles, and as the first step's begins
        compiling = start("sigint_compiling_init", driver=driver,
                          env={"FAULT_SIGNAL": "SIGINT:attnjax.toy.train:init_state:1:0.05:1"})
        first_step = start("sigint_compiling_step", driver=driver,
                           env={"FAULT_SIGNAL": "SIGINT:attnjax.toy.train:train_batch:1:0:1"})
        full = start("disk_full", driver=driver,
                     env={"FAULT_DIR": str(tmp / "disk_full" / "checkpoints"),
                          "FAULT_AFTER": str(tmp / "disk_full" / "checkpoints" / "10" / MANIFEST)})
        killed.wait_for(f"step {kill_at}/{STEPS}")
        killed.process.send_signal(signal.SIGKILL)
        done["intact_when_killed"] = _intact(killed.workdir)
        for run in (whole, again, killed, stopped, twice, compiling, first_step, full):
            done[run.name] = run.wait()
        done["intact_when_stopped"] = _intact(stopped.workdir)
        done["intact_when_full"] = _intact(full.workdir)
        for run in (twice, compiling, first_step):
            done[f"intact_when_{run.name}"] = _intact(run.workdir)

        # The reruns: after the kill; once the disk has room, its last checkpoint damaged
        # since (the truncated and other kinds of damage: test_checkpoint_damage_...).
        _flip(_largest_file(full.workdir / "checkpoints" / "10"))
        reruns = [start("killed_rerun", workdir=killed.workdir),
                  start("interrupted_rerun", workdir=twice.workdir),
                  start("damaged_rerun", workdir=full.workdir)]
        for run in reruns:
            done[run.name] = run.wait()
        return done
    finally:
        for run in started:
            if run.process.poll() is None:
                run.process.kill()


def _one_error_line(run: Run, code: int, *parts: str) -> str:
    """The run exited with code and one line on stderr holding every part."""
    assert run.returncode == code, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr[-3000:]
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


# --- signals ---------------------------------------------------------------------------


def test_sigint_during_start_up_exits_130_saying_nothing_was_saved(runs):
    _one_error_line(runs["early_sigint"], 130, "interrupted (SIGINT) before the first step; "
                                               "this run saved nothing")
    assert _intact(runs["early_sigint"].workdir) == []


@pytest.mark.parametrize("name, said", [
    ("sigint_compiling_init", "before the first step; this run saved nothing"),
    ("sigint_compiling_step", "at step 1; saved a checkpoint of step 1"),
])
def test_sigint_during_compilation_exits_130_when_it_is_done(runs, name, said):
    """The signal lands while the initialisation compiles, or as the first train step
    (and its compilation) begins; the run stops at the next safe point and says what it
    saved, which is on disk and intact."""
    _one_error_line(runs[name], 130, f"interrupted (SIGINT) {said}")
    assert runs[f"intact_when_{name}"] == ([1] if "step 1" in said else [])


def test_the_same_command_again_and_after_an_interruption_ends_with_the_same_records(runs):
    """Run again from scratch, and rerun after Ctrl-C twice mid-run (exit 130, stopped at
    once in step 8, the last checkpoint step 5 and steps 6 and 7 logged): both end with
    the uninterrupted run's metrics, record for record (every step logged)."""
    whole = _records(runs["whole"].workdir)
    assert len(whole) == STEPS + 1   # a record a step and the evaluation
    assert runs["again"].returncode == 0, runs["again"].stderr[-3000:]
    assert _records(runs["again"].workdir) == whole
    assert "rerun the same command to resume" in runs["sigint_compiling_step"].stderr
    rerun = runs["interrupted_rerun"]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming {rerun.workdir} from step 5" in rerun.stdout
    assert _records(rerun.workdir) == whole


def test_sigterm_mid_run_checkpoints_the_step_and_exits_143(runs):
    """SIGTERM during step 8: the step ends, is checkpointed, and the run says so."""
    _one_error_line(runs["sigterm"], 143, "interrupted (SIGTERM) at step 8; saved a "
                                          "checkpoint of step 8 in ",
                    "rerun the same command to resume")
    assert runs["intact_when_stopped"] == [5, 8]


def test_a_second_sigint_stops_at_once_and_still_exits_130(runs):
    """A second SIGINT before the first is honoured stops the run at once, naming the
    last complete checkpoint."""
    _one_error_line(runs["sigint_twice"], 130, "interrupted again (SIGINT): stopped at once; "
                                               "the last complete checkpoint is step 5")
    assert runs["intact_when_sigint_twice"] == [5]


def test_sigkill_at_a_random_step_loses_only_the_steps_since_the_last_checkpoint(runs):
    """Every checkpoint before the step being logged is durable when its line appears,
    and the rerun ends with the uninterrupted run's metrics."""
    kill_at = runs["kill_at"]
    assert runs["killed"].returncode == -signal.SIGKILL
    intact = runs["intact_when_killed"]
    assert intact and intact[-1] >= kill_at - 1, (kill_at, intact)
    rerun = runs["killed_rerun"]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming {rerun.workdir} from step {intact[-1]}" in rerun.stdout
    assert _records(rerun.workdir) == _records(runs["whole"].workdir), kill_at


# --- runs of several processes ---------------------------------------------------------


def _two_processes_training(workdir: Path) -> list[subprocess.Popen]:
    """Two processes of one long run (stderr piped), once they have logged 12 steps; no
    checkpoint falls due."""
    processes = children.processes_of_one_run(
        workdir, TINY + ["steps=5000", "eval_every=5000", "checkpoint_every=5000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 12):
        if time.monotonic() > deadline or processes[0].poll() is not None:
            for p in processes:
                p.kill()
            raise AssertionError(f"no training after 180 s: {processes[0].communicate()[1]}")
        time.sleep(0.2)
    return processes


def test_processes_given_different_commands_stop_before_writing_anything(tmp_path):
    """Process 1 given a seed and a workdir of its own: the run had trained a mix of the
    two seeds that config.yaml called seed 0 (a model of another size: a collective
    that blamed the network; a workdir of its own: a hang no signal ended, in the first
    save). Both processes now exit 2 with one line naming what differs, before anything
    is written."""
    own = tmp_path / "own"
    processes = children.processes_of_one_run(
        tmp_path / "run", TINY, own_args={1: ["--seed", "1", "--workdir", str(own)]},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        outcomes = [p.communicate(timeout=120) for p in processes]
    finally:
        for p in processes:
            p.kill()
    for i, (p, (_, err)) in enumerate(zip(processes, outcomes)):
        assert p.returncode == 2, err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert lines[0].startswith("error: the processes of this run were given different "
                                   f"--workdir, seed (this is process {i}, with --workdir="), \
            lines[0]
        assert lines[0].endswith("start every process with the same --config, --set, --seed, "
                                 "--workdir and --mesh"), lines[0]
    assert not (tmp_path / "run").exists() and not own.exists()


def test_a_process_that_dies_stops_the_other_with_one_line(tmp_path):
    """Process 1 of two is killed mid-training: process 0 stops at its next step (not
    after jax.distributed's shutdown barrier gives up and aborts it), exit status 1, with
    one line that says what happened and which checkpoint is kept."""
    # no checkpoint is due: the kill does not land in a save (which fails on its own
    # terms, and whose process then waits at most 30 s for the others)
    processes = _two_processes_training(tmp_path)
    try:
        processes[1].kill()
        _, err = processes[0].communicate(timeout=60)
    finally:
        for p in processes:
            p.kill()
    assert processes[0].returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "lost contact with the other processes of the run" in lines[0]
    assert lines[0].endswith("Last good checkpoint: none; start every process again to "
                             "resume"), lines[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_one_process_stops_every_process_at_one_checkpointed_step(tmp_path, sig):
    """SIGTERM or Ctrl-C to process 1 alone: both processes stop at the same step,
    checkpoint it together and exit 128 + their signal (process 0 was told by jax's
    preemption service: SIGTERM). jax's service takes SIGTERM from the process, which
    trained on as if nothing came."""
    processes = _two_processes_training(tmp_path)
    try:
        processes[1].send_signal(sig)
        errs = [p.communicate(timeout=60)[1] for p in processes]
    finally:
        for p in processes:
            p.kill()
    steps = set()
    for p, err, told in zip(processes, errs, (signal.SIGTERM, sig)):
        assert p.returncode == 128 + told, err[-3000:]
        last = err.strip().splitlines()[-1]
        match = re.fullmatch(rf"interrupted \({told.name}\) at step (\d+); saved a checkpoint "
                             rf"of step \1 in .*: rerun the same command to resume", last)
        assert match, last
        steps.add(int(match[1]))
    assert len(steps) == 1
    assert (tmp_path / "checkpoints" / str(steps.pop())).is_dir()


# --- checkpoints -----------------------------------------------------------------------


def test_damaged_checkpoints_are_reported_and_skipped_for_the_newest_intact(runs):
    """After the full disk, step 10 (the newest) has a flipped byte, and the failed save
    of step 15 left its temporary files: the rerun moves step 10 aside with a warning,
    resumes from step 5 and ends as the uninterrupted run."""
    rerun = runs["damaged_rerun"]
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Traceback" not in rerun.stderr and "Event loop is closed" not in rerun.stderr
    warnings = rerun.stderr.strip().splitlines()
    assert len(warnings) == 1, rerun.stderr
    assert warnings[0].startswith("warning: checkpoint step 10 is damaged (")
    assert "checksum mismatch" in warnings[0]
    assert f"resuming {rerun.workdir} from step 5" in rerun.stdout
    assert sorted(p.name for p in (rerun.workdir / DAMAGED).iterdir()) == ["10"]
    assert _records(rerun.workdir) == _records(runs["whole"].workdir)


def _state(value: float) -> dict:
    return {"w": jnp.full((3, 5), value, jnp.float32), "b": jnp.arange(7, dtype=jnp.int32)}


def _damage_file(kind: str):
    """Ways to damage a step directory, by the name of the case."""
    def find(name):
        return lambda d: next(p for p in sorted(d.rglob(name)) if p.is_file())

    files = {"array data": _largest_file, "ocdbt manifest": find("manifest.ocdbt"),
             "array metadata": find("_METADATA"), "record": find("metadata"),
             "checkpoint metadata": find("_CHECKPOINT_METADATA"), "manifest": find(MANIFEST)}
    what, how = kind.split(": ")
    action = {"flipped": _flip, "truncated": _truncate, "missing": Path.unlink,
              "garbled": lambda p: p.write_text("{not json"),
              # JSON of another shape: files a list, an entry without its size
              "listed": lambda p: p.write_text('{"files": []}'),
              "emptied": lambda p: p.write_text(json.dumps(
                  {"files": {k: None for k in json.loads(p.read_text())["files"]}}))}[how]
    return lambda d: action(files[what](d))


@pytest.mark.parametrize("kind", [
    "array data: flipped", "array data: truncated", "array data: missing",
    "ocdbt manifest: flipped", "array metadata: flipped", "record: garbled",
    "checkpoint metadata: truncated", "manifest: garbled", "manifest: missing",
    "manifest: listed", "manifest: emptied"])
def test_checkpoint_damage_of_every_kind_is_found_and_skipped(tmp_path, kind):
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    for step in (1, 2, 3):
        checkpoints.save(step, _state(step), {"step": step})
        assert damage(tmp_path / "checkpoints" / str(step)) is None  # durable on return
    checkpoints.close()
    _damage_file(kind)(tmp_path / "checkpoints" / "3")
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    assert checkpoints.latest_intact() == 2   # what the NaN stop calls "last good"
    warnings = []
    step, state, record = checkpoints.restore_latest(_state(0), warnings.append)
    checkpoints.close()
    assert (step, record) == (2, {"step": 2})
    np.testing.assert_array_equal(state["w"], np.full((3, 5), 2, np.float32))
    assert len(warnings) == 1 and warnings[0].startswith("checkpoint step 3 is damaged (")
    assert (tmp_path / DAMAGED / "3").is_dir()


def test_every_checkpoint_damaged_is_set_aside_saying_the_run_starts_again(tmp_path):
    """Every step damaged: each is moved aside with its warning, and one more says that
    no intact checkpoint is left, so the run starts again from step 0 (the warnings
    alone had not said so)."""
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    for step in (1, 2):
        checkpoints.save(step, _state(step), {"step": step})
    checkpoints.close()
    for step, kind in ((1, "manifest: missing"), (2, "array data: flipped")):
        _damage_file(kind)(tmp_path / "checkpoints" / str(step))
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    warnings = []
    assert checkpoints.restore_latest(_state(0), warnings.append) is None
    checkpoints.close()
    assert [w.split(" (")[0] for w in warnings[:2]] == [
        "checkpoint step 2 is damaged", "checkpoint step 1 is damaged"]
    assert warnings[2:] == [f"no intact checkpoint is left in {tmp_path / 'checkpoints'}: "
                            f"the run starts again from step 0"]
    assert sorted(p.name for p in (tmp_path / DAMAGED).iterdir()) == ["1", "2"]


def test_parameters_that_are_not_finite_are_never_checkpointed(tmp_path):
    """A checkpoint on disk is one to resume from: NaN parameters (whose loss was still
    finite) stop the run instead of becoming the "last good" checkpoint."""
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=3)
    good = training.TrainState(jnp.int32(4), _state(1.0), ())
    cli._save(checkpoints, 4, good, {})
    bad = training.TrainState(jnp.int32(5), {"w": good.params["w"].at[1, 2].set(jnp.nan)}, ())
    with pytest.raises(cli.TrainingDiverged, match="the parameters are not finite after "
                                                   "step 5"):
        cli._save(checkpoints, 5, bad, {})
    assert checkpoints.latest_intact() == 4 and checkpoints.manager.all_steps() == [4]
    checkpoints.close()


# --- one run per workdir ---------------------------------------------------------------


def test_a_second_run_on_a_busy_workdir_exits_2_naming_the_holder(runs):
    whole = runs["whole"]
    _one_error_line(runs["second"], 2, f"{whole.workdir} is in use by another run (pid "
                                       f"{whole.process.pid})")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert len(_records(whole.workdir)) == STEPS + 1   # nothing lost to the second run


def test_another_config_or_seed_on_a_workdir_is_refused_naming_the_difference(tmp_path,
                                                                              capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    (workdir / "config.yaml").write_text(dump_config(config))
    argv = ["--workdir", str(workdir), *(a for o in TINY for a in ("--set", o))]
    assert cli.main(argv + ["--seed", "7"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "differs in seed): seed=0 there, 7 here" in err
    assert "--force-new" in err


def test_force_new_replaces_the_run_a_workdir_holds(tmp_path):
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "5").mkdir(parents=True)
    (workdir / "metrics.jsonl").write_text('{"step": 5}\n')
    (workdir / "notes.txt").write_text("mine")
    old = load_config(ROOT / "configs" / "copy.yaml", TINY)
    (workdir / "config.yaml").write_text(dump_config(old))
    new = dataclasses.replace(old, seed=7)
    with pytest.raises(cli.ConfigError, match="differs in seed"):
        cli._claim_workdir(workdir, new, force_new=False)
    os.close(cli._claim_workdir(workdir, new, force_new=True))
    # nothing is deleted until the run begins (cli._begin_run)
    assert (workdir / "metrics.jsonl").exists() and load_config(workdir / "config.yaml") == old
    cli._begin_run(workdir, new, force_new=True)
    assert sorted(p.name for p in workdir.iterdir()) == [".lock", "config.yaml", "notes.txt"]
    assert load_config(workdir / "config.yaml") == new


# --- disks -----------------------------------------------------------------------------


def test_read_only_workdir_exits_2_with_one_line(runs):
    run = runs["readonly"]
    _one_error_line(run, 2, f"error: cannot use --workdir {run.workdir}: ",
                    "Read-only file system")


def test_full_disk_stops_the_run_keeping_the_last_checkpoint(runs):
    """The disk fills once step 10 is saved: saving step 15 fails, and the run exits 1
    naming step 10, which is intact (the rerun: test_damaged_checkpoints_...)."""
    run = runs["disk_full"]
    _one_error_line(run, 1, "error: cannot save the checkpoint of step 15", "No space left",
                    "training stopped at step 15. Last good checkpoint: step 10 in ")
    assert runs["intact_when_full"] == [5, 10]


def test_workdir_that_is_a_file_exits_2(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert cli.main(["--workdir", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err == f"error: --workdir {tmp_path / 'file'} is a file, not a " \
                                      f"directory\n"


# --- config mistakes -------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["seed=-1"], "seed must lie in [0, 2147483647]; got -1"),
    (["seed=4294967296"], "seed must lie in [0, 2147483647]; got 4294967296"),
    (["task.num_symbols=0"], "task.num_symbols must lie in [2, 36]; got 0"),
    (["task.num_symbols=100"], "task.num_symbols must lie in [2, 36]; got 100"),
    (["task.eval_size=0"], "task.eval_size must lie in [1, inf); got 0"),
    (["optim.learning_rate=-1"], "optim.learning_rate must lie in (0, inf); got -1.0"),
    (["optim.learning_rate=.nan"], "optim.learning_rate must lie in (0, inf); got nan"),
    (["optim.b1=1.5"], "optim.b1 must lie in [0, 1); got 1.5"),
    (["optim.b2=-0.1"], "optim.b2 must lie in [0, 1); got -0.1"),
    (["optim.warmup_steps=-10"], "optim.warmup_steps must lie in [0, 2147483647]; got -10"),
    (["optim.end_learning_rate=-1"], "optim.end_learning_rate must lie in [0, inf); got -1.0"),
    (["optim.weight_decay=.inf"], "optim.weight_decay must lie in [0, inf); got inf"),
    (["optim.clip_norm=0"], "optim.clip_norm must lie in (0, inf); got 0.0"),
    (["steps=3000000000"], "steps must lie in [1, 2147483647]; got 3000000000"),
    (["data.packed_len=0"], "data.packed_len must lie in [1, inf); got 0"),
    (["model.implementation=fast"], "implementation must be one of (None, 'dense', "),
    (["model.num_decoder_layers=0"], "num_decoder_layers must be a positive int; got 0"),
    # (found once the model was traced, naming the library's score_fn, not these keys)
    (["model.attention_score=additive", "model.implementation=chunked"],
     "model: attention_score='additive' is a learned alignment, which runs on "
     "implementation='dense' (or None); got implementation='chunked'"),
])
def test_bad_config_values_exit_2_with_one_line(tmp_path, capsys, overrides, message):
    argv = ["--workdir", str(tmp_path / "w"), *(a for o in overrides for a in ("--set", o))]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "w").exists()   # checked before anything is made


@pytest.mark.parametrize("text, message", [
    (b"- 1\n- 2\n", "the config must be a mapping of sections and keys; got list [1, 2]"),
    (b"task:\n  name: copy\xff\xfe\n", "is not UTF-8 text: byte 0xff at offset"),
    (b"steps: [1\n", "is not valid YAML"),
    (b"17\n", "the config must be a mapping of sections and keys; got int 17"),
    # yaml keeps the last silently; a merged key given again overrides it (test_toy_config)
    (b"steps: 50\noptim:\n  b1: 0.9\nsteps: 500\n",
     "is not valid YAML: found the key 'steps' twice in one mapping (line 4)"),
    (b"optim: {b1: 0.9, warmup_steps: 10, b1: 0.8}\n",
     "is not valid YAML: found the key 'b1' twice in one mapping (line 1)"),
])
def test_bad_config_files_exit_2_with_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    assert cli.main(["--config", str(path), "--set", "steps=5", "--workdir",
                     str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_plotting_a_chunked_model_reads_the_dense_weights(tmp_path, float32):
    """`--set model.implementation=chunked` trained, then failed drawing attention.png:
    only the dense kernel returns weights, for the same parameters."""
    config = load_config(ROOT / "configs" / "copy.yaml", TINY + ["model.implementation=chunked"])
    task = make_task(config.task)
    model = training.make_model(config, task)
    batch = training.eval_set(task, config)
    optimizer = training.make_optimizer(config.optim, config.steps)
    params = training.init_state(model, optimizer, task, config.seed,
                                 children.one_device_mesh()).params
    cli.plot_attention(tmp_path / "attention.png",
                       *cli._attention_of_first(model, params, task, batch, batch.tgt_out))
    assert (tmp_path / "attention.png").read_bytes()[:4] == b"\x89PNG"
