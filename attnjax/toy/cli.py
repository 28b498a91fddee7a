"""`train_toy.py` / `attnjax-train`: train a toy task, resumably.

    attnjax-train                                        # the shipped copy config -> runs/copy
    attnjax-train --config dates --set optim.learning_rate=1e-3
    attnjax-train --config my_config.yaml                # a file of your own
    python train_toy.py --set steps=1200                 # the same program, from a clone
    python train_toy.py --set model.kind=decoder_only --set data.pack=true
    python train_toy.py --mesh data=2,model=2            # 4 devices: data and heads split
    python train_toy.py --mesh data=2,seq=2              # 4 devices: data and sequences split
    python train_toy.py --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 0

Rerunning the same command in the same workdir resumes from the latest intact
checkpoint and ends with the metrics an uninterrupted run has. One run at a time holds a
workdir. Exit status: 0 done; 1 the run stopped (the loss became NaN/inf, a file
could not be written, another process of the run stopped, or the processes did not
all connect within --join-timeout); 2 a bad config or command line, or a workdir that
cannot be used; 130 or 143 interrupted by SIGINT or SIGTERM (saying what was saved).
"""

import argparse
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import fnmatch
import functools
import gc
import math
import os
import resource
import shutil
import signal
import socket
import sys
import threading
import time
import zlib
from pathlib import Path

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils

from attnjax.nn import DecoderOnly, attention_maps
from attnjax.parallel import mesh as mesh_lib
from attnjax.toy import make_task, sequence_parallel
from attnjax.toy import train as training
from attnjax.toy.checkpoints import DAMAGED, CheckpointError, Checkpoints
from attnjax.toy.config import (
    DEFAULT_CONFIG,
    Config,
    ConfigError,
    dump_config,
    load_config,
    shipped_configs,
)
from attnjax.toy.report import (
    EVENT_FILES,
    MetricsLog,
    Progress,
    plot_attention,
    plot_curves,
    write_samples,
)
from attnjax.toy.sequences import DecoderOnlyFormat
from attnjax.toy.tasks import BOS, EOS

# The run's resolved config, written as it begins.
CONFIG = "config.yaml"
# What a run leaves in its workdir; --force-new deletes these and nothing else.
RUN_FILES = (CONFIG, "metrics.jsonl", EVENT_FILES, "samples.txt", "attention.png",
             "curves.png", "checkpoints", DAMAGED)
LOCK = ".lock"
# What an interrupted run says when it stops before its first step (`_before_training`).
BEFORE_TRAINING = "before the first step; this run saved nothing"


class RunFailed(RuntimeError):
    """The run stopped before its end (exit status 1); the message says what is kept."""


class TrainingDiverged(RunFailed):
    """The loss or the parameters stopped being finite; the last good checkpoint is kept."""


class ProcessLost(RunFailed):
    """A collective between the processes of a run failed: another process stopped or
    cannot be reached. The message says which checkpoint is kept."""


def _lost_contact(error: Exception) -> str:
    """What a run of several processes says when a collective fails (jax's first line)."""
    return (f"this process lost contact with the other processes of the run: one of them "
            f"stopped or cannot be reached ({str(error).splitlines()[0]})")


class Interrupted(Exception):
    """A SIGINT or SIGTERM honoured at a safe point; the message says what was saved."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_status = 128 + signum


def _before_training(workdir: Path) -> str:
    """What a run interrupted before its first step says: it saved nothing, and the
    checkpoints of the run the workdir already holds are as they were."""
    held = Path(workdir) / "checkpoints"
    with contextlib.suppress(OSError):
        if held.is_dir() and any(p.name.isdigit() for p in held.iterdir()):
            return f"{BEFORE_TRAINING}; the checkpoints already in {held} are as they were"
    return BEFORE_TRAINING


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _run_entries(workdir: Path) -> list[Path]:
    """The entries of a run (RUN_FILES) the workdir holds, links to nothing included
    (which glob leaves out)."""
    return sorted(p for p in workdir.iterdir()
                  if any(fnmatch.fnmatchcase(p.name, name) for name in RUN_FILES))


# The run's entries that are directories; the others are files.
RUN_DIRECTORIES = ("checkpoints", DAMAGED)


def _check_workdir_entries(workdir: Path) -> None:
    """Each entry of a run the workdir holds is of its kind (a file or a directory) and
    not a link to nothing: found before anything compiles, not when the run first writes
    there (a file named checkpoints failed the run after its compilation)."""
    for path in _run_entries(workdir):
        directory = path.name in RUN_DIRECTORIES
        if path.is_symlink() and not path.exists():
            wrong = "a link to nothing"
        elif directory != path.is_dir():
            wrong = "a directory, not a file" if path.is_dir() else "a file, not a directory"
        else:
            continue
        raise ConfigError(f"cannot use --workdir {workdir}: {path} is {wrong}; use another "
                          f"--workdir, or --force-new to delete that run and start anew")


def _check_workdir_config(workdir: Path, config: Config) -> None:
    """A workdir holds one run, of one config (seed included): continuing it with
    another is an error, but for a larger `steps`, which continues the run (finished
    or not) to the new last step. A key the saved config lacks (written before the key
    existed) has its default."""
    saved_path = workdir / CONFIG
    advice = "use another --workdir, or --force-new to delete that run and start anew"
    if not saved_path.exists():
        checkpoints = workdir / "checkpoints"
        if checkpoints.is_dir() and any(checkpoints.iterdir()):
            # its config is unknown: resuming it with this one could mix two runs
            raise ConfigError(f"{workdir} holds checkpoints but no config.yaml, so the "
                              f"config they were trained with is unknown; put that run's "
                              f"config.yaml back, or {advice}")
        return
    try:
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8"))
        if saved is None:  # emptied: reading it as all defaults would misname the difference
            raise ValueError("empty")
        if not isinstance(saved, dict):
            raise ValueError(f"a {type(saved).__name__}, not a mapping")
    except (OSError, ValueError, RecursionError, yaml.YAMLError) as e:
        raise ConfigError(f"{saved_path} is unreadable ({str(e).splitlines()[0]}); "
                          f"{advice}") from None
    saved = _flatten(saved)
    current = _flatten(dataclasses.asdict(config))
    default = _flatten(dataclasses.asdict(Config()))
    differ = sorted(k for k in saved.keys() | current.keys()
                    if saved.get(k, default.get(k)) != current.get(k))
    saved_steps = saved.get("steps", default["steps"])
    if "steps" in differ and isinstance(saved_steps, int) and current["steps"] > saved_steps:
        differ.remove("steps")   # a longer run of the same config: continued
    if differ:
        values = "; ".join(f"{k}={saved.get(k, default.get(k))!r} there, {current.get(k)!r} "
                           f"here" for k in differ)
        grow = "; steps may only grow, which continues the run" if "steps" in differ else ""
        raise ConfigError(f"{workdir} holds a run with another config (it differs in "
                          f"{', '.join(differ)}{grow}): {values}; {advice}")


def _lock_workdir(workdir: Path) -> int:
    """An exclusive lock on the workdir (released by the OS when the process ends, however
    it ends); a second run on the workdir is refused, naming the holder. Returns the
    lock's file descriptor, to close when the run is over."""
    fd = os.open(workdir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"{workdir} is in use by another run (pid {holder}); wait for it "
                          f"to end or use another --workdir") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:
        os.close(fd)
        raise
    return fd


def _write_atomically(path: Path, text: str) -> None:
    """Readers (other processes) see the old file or the new one, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


# What the machine, not the command, is short of: the run fails (exit 1) rather than
# being refused as a mistake (exit 2).
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _workdir_error(workdir: Path, error: OSError, kept: str) -> Exception:
    message = f"cannot use --workdir {workdir}: {error}"
    if error.errno in OUT_OF_SPACE:
        return RunFailed(f"{message}; {kept}")
    return ConfigError(message)


def _claim_workdir(workdir: Path, config: Config, force_new: bool,
                   created: bool = False) -> int | None:
    """Makes, locks and checks the workdir of a run; the lock's descriptor, or None in a
    process other than the first (which holds the lock for all). Nothing in it changes
    yet: `_begin_run` does that once the run has started (see there). created: the
    workdir does not exist yet (where this fails, it is removed again)."""
    primary = jax.process_index() == 0
    lock = None
    try:
        if "[" in str(workdir.absolute()):
            # orbax finds a checkpoint's parts by a glob of its path: under a "[", a
            # character class, it found none, and every checkpoint failed to restore
            raise ConfigError(f"--workdir {workdir}: its path has a '[', which the "
                              f"checkpoints cannot be read back from (orbax takes it "
                              f"for a pattern); use another --workdir")
        if workdir.exists() and not workdir.is_dir():
            raise ConfigError(f"--workdir {workdir} is a file, not a directory")
        if workdir.is_symlink() and not workdir.exists():
            raise ConfigError(f"--workdir {workdir} is a link to nothing "
                              f"({os.readlink(workdir)}): make its target, or use another "
                              f"--workdir")
        workdir.mkdir(parents=True, exist_ok=True)
        if primary:
            lock = _lock_workdir(workdir)
        if not force_new:
            _check_workdir_entries(workdir)
            _check_workdir_config(workdir, config)
    except OSError as e:
        if lock is not None:
            os.close(lock)
        if created and primary:   # the workdir this call made (a full disk, say) goes
            with contextlib.suppress(OSError):
                _remove_unbegun(workdir)
        raise _workdir_error(workdir, e, "nothing was written") from None
    except ConfigError:
        if lock is not None:
            os.close(lock)
        raise
    return lock


def _begin_run(workdir: Path, config: Config, force_new: bool) -> str:
    """Deletes the run the workdir held (force_new) and writes this run's config.yaml:
    done once the model is built and compiled, so that a mistake found, or a Ctrl-C,
    before then leaves the workdir as it was (a config.yaml written earlier refused the
    corrected command; --force-new had deleted the old run). Returns what a run
    interrupted from here to its first step says."""
    if jax.process_index():
        return BEFORE_TRAINING
    try:
        entries = _run_entries(workdir) if force_new else []
        for path in entries:
            is_dir = path.is_dir() and not path.is_symlink()
            shutil.rmtree(path) if is_dir else path.unlink(missing_ok=True)
        _write_atomically(workdir / CONFIG, dump_config(config))
    except OSError as e:
        raise _workdir_error(workdir, e, "the run in it, if any, is as it was" if not force_new
                             else "its old run may be partly deleted") from None
    deleted = f" (--force-new deleted the run {workdir} held)" if entries else ""
    return f"{BEFORE_TRAINING} but its config.yaml{deleted}: rerun the same command to start it"


class _Window:
    """Per-step metrics since the last log line: device values until fetched, then floats."""

    def __init__(self, fetched: list[dict]):
        self.fetched, self.pending = list(fetched), []
        self.start = time.perf_counter()

    def add(self, metrics) -> None:
        self.pending.append(metrics)

    def fetch(self, step: int) -> list[dict]:
        """The metrics of the window so far, which ends at step; NaN/inf raises."""
        for metrics in jax.device_get(self.pending):
            self.fetched.append({k: float(v) for k, v in metrics.items()})
        self.pending = []
        bad = [i for i, m in enumerate(self.fetched) if not math.isfinite(m["loss"])]
        if bad:
            raise TrainingDiverged(f"the loss is {self.fetched[bad[0]]['loss']} at step "
                                   f"{step - len(self.fetched) + bad[0] + 1}")
        return self.fetched

    def close(self, step: int) -> dict:
        """The log record of the window ending at step; NaN/inf raises."""
        steps = self.fetch(step)
        elapsed = time.perf_counter() - self.start
        record = {"step": step,
                  "loss": float(np.mean([m["loss"] for m in steps])),
                  "accuracy": float(np.mean([m["accuracy"] for m in steps])),
                  "learning_rate": steps[-1]["learning_rate"],
                  "tokens_per_s": sum(m["tokens"] for m in steps) / max(elapsed, 1e-9)}
        self.fetched = []
        self.start = time.perf_counter()
        return record


def _stops_agreed() -> bool:
    """Whether the processes of this run agree on the step a signal stops them at:
    several processes, with jax's preemption service (JAX_ENABLE_PREEMPTION_SERVICE
    unset or true). Without it each process stops on its own signals. (Asked before
    jax.distributed started, jax.process_count would start jax's backend alone.)"""
    return (jax.distributed.is_initialized() and jax.process_count() > 1
            and jax.config.jax_enable_preemption_service)


class StopRequests:
    """SIGINT and SIGTERM as requests that the run honours at its next safe point: after
    the step in progress, which it checkpoints first, or between the phases of start-up
    and of the end (`stop_if_requested`). Nothing is cut short in the middle of a
    compilation or a save, where Python cannot be left safely.

    A second signal ends the process at once, saying which checkpoint is the last
    complete one (`saved`). early: signals received before this was made (train_toy.py
    catches them while the libraries load). With several processes (`_stops_agreed`), a
    signal to any of them stops all at the same step: the training loop asks jax's
    preemption service at every step (`sync_stop`).
    """

    def __init__(self, early=()):
        self.signum = early[0] if early else None
        self.forwarded = None   # a signal passed on to the other processes of the run
        self.saved = None
        self.undo = None        # what stopping at once first undoes (`run`: a new workdir)
        self.joining = False    # waiting for the other processes of the run to connect
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._request)
        return self

    def _request(self, signum, frame):
        if self.signum is None and self.forwarded is None:
            # (while the processes connect, jax's backend must not start: it would
            # start alone)
            if not self.joining and _stops_agreed():
                # every process must stop at the same step: jax's preemption service,
                # which takes SIGTERM, tells them all (`sync_stop`)
                self.forwarded = signum
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                self.signum = signum
            return
        saved = ("this run saved no checkpoint" if self.saved is None else
                 f"the last complete checkpoint is step {self.saved}")
        os.write(2, f"interrupted again ({signal.Signals(signum).name}): stopped at once; "
                    f"{saved}\n".encode())
        if self.undo is not None:
            with contextlib.suppress(Exception):
                self.undo()
        # Unwinding from here could stop a save or a compilation halfway; the OS frees
        # all, and the next run ignores a step that was not complete.
        os._exit(128 + signum)

    def sync_stop(self, step: int) -> None:
        """With several processes, called at every step: once one of them is told to
        stop (SIGTERM, which jax's preemption service takes, or a signal passed on as
        SIGTERM), all stop at the same step, the first that every process reaches."""
        if multihost_utils.reached_preemption_sync_point(step):
            self.signum = self.forwarded or signal.SIGTERM

    def stop_if_requested(self, when: str) -> None:
        """Raises Interrupted if a signal came; when: at which point, and what is saved."""
        if self.signum is not None:
            raise Interrupted(self.signum, f"interrupted ({signal.Signals(self.signum).name}) "
                                           f"{when}")

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _curves_before(workdir: Path, metrics: MetricsLog | None, primary: bool) -> str:
    """curves.png of the steps logged before a run diverged, where it has any (the curves
    are otherwise drawn as a run ends), by the process that writes the metrics; what to
    add to its message."""
    if not primary or metrics is None or not any("loss" in r for r in metrics.records):
        return ""
    try:
        plot_curves(workdir / "curves.png", metrics.records)
    except OSError:
        return ""
    return f"; {workdir / 'curves.png'} shows the steps logged before it"


def _evaluate(model, params, task, eval_batch, config, step: int, mesh):
    start = time.perf_counter()
    predictions = training.predict(model, task, params, eval_batch, config.eval_batch_size, mesh)
    scores = training.accuracies(predictions, eval_batch.tgt_out)
    record = {"step": step, "eval_token_accuracy": scores["token_accuracy"],
              "eval_exact_match": scores["exact_match"], "eval_s": time.perf_counter() - start}
    return record, predictions


def _attention_of_first(model, params, task, eval_batch, predictions):
    """`(maps, src_tokens, tgt_tokens)` for attention.png (`plot_attention`): the first
    held-out example, decoding its own prediction. params must be whole on this host
    (`process_allgather`)."""
    # Only the dense kernel materialises the weights; the parameters are the same.
    model = type(model)(dataclasses.replace(model.config, implementation="dense"))
    # One compiled call: the model's many small ops run eagerly take seconds.
    apply = jax.jit(functools.partial(model.apply, sow_weights=True, deterministic=True,
                                      mutable=["intermediates"]),
                    compiler_options=training.quick_compilation())
    length = int(eval_batch.src_lengths[0])
    predicted = list(predictions[0])
    predicted = predicted[: predicted.index(EOS) + 1] if EOS in predicted else predicted
    tgt_in = np.array([[BOS] + predicted[:-1]], np.int32)
    if isinstance(model, DecoderOnly):
        # one sequence: source, separator and the prediction but its last token
        layout = DecoderOnlyFormat(task)
        tokens = np.concatenate([layout.src_ids[eval_batch.src[:1, :length]], tgt_in], axis=1)
        _, state = apply({"params": params}, tokens)
        src_tokens = tgt_tokens = [layout.vocab.token(int(t)) for t in tokens[0]]
    else:
        _, state = apply({"params": params}, eval_batch.src[:1, :length], tgt_in,
                         eval_batch.src_lengths[:1])
        src_tokens = [task.src_vocab.token(int(t)) for t in eval_batch.src[0, :length]]
        tgt_tokens = [task.tgt_vocab.token(int(t)) for t in tgt_in[0]]
    return attention_maps(state["intermediates"]), src_tokens, tgt_tokens


def _best(best: dict, step: int, exact_match: float) -> dict:
    """The best evaluated step after step's evaluation: among equal exact matches the
    newest, the one the checkpoints keep (`Checkpoints`)."""
    if exact_match >= best["exact_match"]:
        return {"exact_match": exact_match, "step": step}
    return best


def _save(checkpoints: Checkpoints, step: int, state, record: dict,
          exact_match: float | None = None) -> None:
    """A checkpoint of step, refused if the parameters are not finite: every checkpoint
    on disk is one to resume from."""
    if not training.all_finite(state.params):
        raise TrainingDiverged(f"the parameters are not finite after step {step}")
    checkpoints.save(step, state, record, exact_match)


def run(config: Config, workdir: Path, *, mesh=None, interactive: bool | None = None,
        force_new: bool = False, stop: StopRequests | None = None) -> dict:
    """Trains (or resumes) a run in workdir and writes its outputs; returns the summary.

    mesh: a ("data", "model") mesh (`attnjax.parallel.mesh.make_mesh`); default every
    device on "data". With several processes, all run this; process 0 holds the
    workdir's lock, writes the files and shows progress, and all write the checkpoints
    together. force_new: delete the run the workdir holds (its checkpoints, metrics and
    outputs) and start anew, where a different config would be refused. stop: the
    SIGINT/SIGTERM requests to honour (`main`'s); by default this call's own.

    Raises ConfigError (a config or workdir that cannot be used), RunFailed (the run
    stopped: NaN/inf, or a file that could not be written) or Interrupted; each message
    says which checkpoint is kept.
    """
    if stop is None:
        with StopRequests() as own:
            return run(config, workdir, mesh=mesh, interactive=interactive,
                       force_new=force_new, stop=own)
    began = time.perf_counter()
    workdir = Path(workdir)
    mesh = mesh_lib.make_mesh() if mesh is None else mesh
    if config.batch_size % mesh.shape["data"]:
        raise ConfigError(f"batch_size={config.batch_size} must be divisible by the mesh's "
                          f"data axis ({mesh.shape['data']} devices)")
    sequence_parallel.check(config, mesh)
    if config.model.implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"model.implementation=cudnn needs a GPU; this run has "
                          f"{jax.default_backend()}")
    stop.stop_if_requested(_before_training(workdir))
    created = not os.path.lexists(workdir)
    lock = _claim_workdir(workdir, config, force_new, created)
    made = created and lock is not None
    if made:   # a second Ctrl-C before the run began leaves no workdir behind either
        stop.undo = functools.partial(_remove_unbegun, workdir)
    try:
        return _train(config, workdir, mesh, interactive, stop, began, force_new)
    finally:
        stop.undo = None
        if lock is not None:
            os.close(lock)
            if made:
                _remove_unbegun(workdir)


def _remove_unbegun(workdir: Path) -> None:
    """Removes the workdir a run made if the run never began (no config.yaml): its lock,
    then the directory if nothing else is in it."""
    if not (workdir / CONFIG).exists():
        (workdir / LOCK).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            workdir.rmdir()


def _train(config: Config, workdir: Path, mesh, interactive, stop: StopRequests,
           began: float, force_new: bool) -> dict:
    primary = jax.process_index() == 0
    agreed_stops = _stops_agreed()

    def warn(message: str) -> None:
        if primary:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    task = make_task(config.task)
    model = training.make_model(config, task)
    output_vocab = DecoderOnlyFormat(task).vocab if isinstance(model, DecoderOnly) else None
    optimizer = training.make_optimizer(config.optim, config.steps)
    try:
        abstract = training.abstract_state(model, optimizer, task, mesh)
        train_step = training.make_train_step(model, optimizer, config.optim, config.steps,
                                              config.seed, abstract, mesh,
                                              api=config.model.api)
        # the train step compiles while the initialisation does
        state = training.init_state(
            model, optimizer, task, config.seed, mesh,
            alongside=[(train_step, (abstract, training.abstract_batch(task, config, mesh)))])
    except ValueError as e:  # a model that the mesh cannot split, or a train step that
        raise ConfigError(str(e)) from None  # cannot be traced with this config
    stop.stop_if_requested(_before_training(workdir))
    eval_batch = training.eval_set(task, config)
    begun = _begin_run(workdir, config, force_new)

    try:
        checkpoints = Checkpoints(workdir / "checkpoints", config.keep_checkpoints,
                                  primary=primary)
    except OSError as e:
        raise RunFailed(f"cannot open the checkpoints of {workdir}: {e}") from None
    metrics = progress = None
    step = 0

    def kept() -> str:
        latest = checkpoints.latest_intact()
        return (f"step {latest} in {checkpoints.directory}" if latest is not None else
                "none")

    try:
        try:
            restored = checkpoints.restore_latest(state, warn)
        except CheckpointError as e:
            raise ConfigError(f"{e}; use another --workdir, or --force-new to delete that "
                              f"run and start anew") from None
        start, saved = (0, {}) if restored is None else (restored[0], restored[2])
        step = start   # what a failure from here on names
        if restored is not None:
            state = restored[1]
            stop.saved = start
        metrics = MetricsLog(workdir / "metrics.jsonl", start, enabled=primary, warn=warn,
                             log_every=config.log_every)
        window = _Window(saved.get("window", []))
        best = saved.get("best", {"exact_match": -1.0, "step": None})
        progress = Progress(config.steps, start, interactive, enabled=primary)
        if start:
            progress.message(f"resuming {workdir} from step {start} of {config.steps}")
            stop.stop_if_requested(f"before training resumed from step {start}; this run "
                                   f"saved nothing new: rerun the same command to resume")
        else:
            stop.stop_if_requested(begun)

        eval_record, predictions = None, None
        running = None   # the metrics of the step dispatched before this one
        for step in range(start + 1, config.steps + 1):
            state, step_metrics = train_step(
                state, training.train_batch(task, config, step - 1, mesh))
            window.add(step_metrics)
            # One step queued behind the one running, no more: the next batch is drawn
            # while a step runs, and a stop request (a preemption's SIGTERM) is honoured
            # within about two steps, not after every step queued up to the next log
            # line (log_every of them, which a slow step makes long)
            if running is not None:
                jax.block_until_ready(running)
            running = step_metrics
            progress.advance()
            last = step == config.steps
            if step % config.log_every == 0 or last:
                record = window.close(step)
                record["elapsed_s"] = time.perf_counter() - began
                metrics.write(record)
                progress.log(record)
            evaluate = step % config.eval_every == 0 or last
            if evaluate:
                eval_record, predictions = _evaluate(model, state.params, task, eval_batch,
                                                     config, step, mesh)
                metrics.write(eval_record)
                if primary:
                    write_samples(workdir / "samples.txt", task, eval_batch, predictions,
                                  vocab=output_vocab)
                progress.message(
                    f"step {step}: held-out exact match "
                    f"{eval_record['eval_exact_match']:.4f}, token accuracy "
                    f"{eval_record['eval_token_accuracy']:.4f}")
                best = _best(best, step, eval_record["eval_exact_match"])
            if agreed_stops:
                stop.sync_stop(step)
            if evaluate or step % config.checkpoint_every == 0:
                # on a log step: the window is empty
                _save(checkpoints, step, state, {"window": [], "best": best},
                      eval_record["eval_exact_match"] if evaluate else None)
            elif stop.signum is not None:
                _save(checkpoints, step, state, {"window": window.fetch(step), "best": best})
            else:
                continue
            stop.saved = step
            window.start = time.perf_counter()   # the save's time is not training's
            stop.stop_if_requested(f"at step {step}; saved a checkpoint of step {step} in "
                                   f"{checkpoints.directory}: rerun the same command to "
                                   f"resume")
    except TrainingDiverged as e:
        raise TrainingDiverged(f"{e}; training stopped. Last good checkpoint: "
                               f"{kept()}{_curves_before(workdir, metrics, primary)}") from None
    except (OSError, CheckpointError, jax.errors.JaxRuntimeError) as e:
        # a collective that another process left (a save's included), or a file
        lost = ((getattr(e, "collective", False) or isinstance(e, jax.errors.JaxRuntimeError))
                and jax.process_count() > 1)
        if lost:
            raise ProcessLost(f"{_lost_contact(e)}; training stopped at step {step}. Last "
                              f"good checkpoint: {kept()}; start every process again to "
                              f"resume") from None
        if isinstance(e, jax.errors.JaxRuntimeError):
            raise
        raise RunFailed(f"{e}; training stopped at step {step}. Last good checkpoint: "
                        f"{kept()}") from None
    finally:
        checkpoints.close()
        for closing in (progress, metrics):
            if closing is not None:
                closing.close()

    after = (f"after the last step (checkpointed as step {config.steps}); samples.txt and "
             f"the plots may be missing: rerun the same command to write them")
    stop.stop_if_requested(after)
    try:
        if eval_record is None:  # the run had already finished: evaluate for the summary
            eval_record, predictions = _evaluate(model, state.params, task, eval_batch,
                                                 config, config.steps, mesh)
            if primary:   # (the last step's evaluation wrote them otherwise)
                write_samples(workdir / "samples.txt", task, eval_batch, predictions,
                              vocab=output_vocab)
        params = multihost_utils.process_allgather(state.params, tiled=True)  # a collective
        if primary:
            # The attention weights' program compiles (outside Python's lock) while
            # matplotlib draws the curves: the two plots' time was one core's. (The
            # thread sees jax's process-wide settings, not a caller's `with` blocks.)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                attention = pool.submit(_attention_of_first, model, params, task, eval_batch,
                                        predictions)
                plot_curves(workdir / "curves.png", metrics.records)
                stop.stop_if_requested(after)
                plot_attention(workdir / "attention.png", *attention.result())
    except OSError as e:
        raise RunFailed(f"{e}; training is complete (checkpointed as step {config.steps}) "
                        f"but its outputs are not all written") from None
    return {"task": config.task.name, "steps": config.steps,
            "exact_match": eval_record["eval_exact_match"],
            "token_accuracy": eval_record["eval_token_accuracy"],
            "eval_size": len(eval_batch.src), "best": best,
            "seconds": time.perf_counter() - began, "workdir": str(workdir)}


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are one line (argparse prints its usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    # prog: argparse's default, the name this program was run by (attnjax-train or
    # train_toy.py)
    parser = _Parser(
        description="Train a Transformer on a toy task (copy, reverse, sort, dates); rerun "
        "the same command to resume.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, metavar="NAME|PATH",
                        help=f"a shipped config by name ({', '.join(shipped_configs())}) or "
                        f"a YAML file (default {DEFAULT_CONFIG})")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY.SUB=VALUE", help="override a config value (repeatable)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where outputs and checkpoints go (default runs/<task>)")
    parser.add_argument("--seed", type=int, default=None, help="overrides the config's seed")
    parser.add_argument("--force-new", action="store_true",
                        help="delete the run the workdir holds (checkpoints, metrics, "
                        "outputs) and start anew, whatever its config")
    parser.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                        help="device mesh over data, model (heads) and seq (each sequence "
                        "split, attention as a ring), e.g. data=2,model=2 or data=2,seq=2 "
                        "(default: every device on data); results match a one-device run")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="several processes: process 0's address (jax.distributed)")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--join-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="several processes: how long each waits for all to connect "
                        "before it gives up (default 300)")
    return parser


def use_compilation_cache() -> Path | None:
    """Compiled programs persist between runs, so a rerun, a resumed run or another
    run of the same shapes skips most of its compilation: in $JAX_COMPILATION_CACHE_DIR
    when that is set (jax reads it), else in the user's cache directory
    ($XDG_CACHE_HOME or ~/.cache, then attnjax/jax); each program that compiles in 0.1 s
    or more, unless $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise.
    JAX_ENABLE_COMPILATION_CACHE=false
    turns it off. A directory that cannot be written turns it off too (jax would warn
    at every program), saying so where it was chosen. Returns the directory used, or
    None."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    chosen = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    directory = Path(chosen) if chosen else user_cache / "attnjax" / "jax"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        writable = os.access(directory, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    if not writable:   # a read-only or missing home, say: every run compiles
        jax.config.update("jax_enable_compilation_cache", False)
        if chosen:
            print(f"warning: JAX_COMPILATION_CACHE_DIR={chosen} cannot be written; "
                  f"programs are compiled anew", file=sys.stderr, flush=True)
        return None
    if not chosen:
        jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # programs that compile faster than this are not worth a file (jax's default,
        # 1 s, leaves out the initialisation and evaluation of the shipped configs)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    return directory


def keep_freed_memory() -> bool:
    """Memory the process frees stays in it for the next allocation, where the C
    library is glibc (Linux): returns whether it does.

    XLA's CPU backend allocates each step's temporaries afresh. glibc maps blocks past
    its threshold (128 KiB, rising with use) straight from the kernel and unmaps them on
    free, so every step pays to fault zeroed pages in again: the default copy run took
    23.0 s warm, 18.7 s with freed memory kept (and ~0.2 GB more resident), and a causal
    attention forward pass at B=8, T=256, N=8 jumped between 4 and 13 ms. This is what
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824 in the environment does, set
    here for the command's own process; ATTNJAX_KEEP_FREED_MEMORY=0 leaves glibc's
    defaults."""
    if os.environ.get("ATTNJAX_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    # no block mapped on its own (a request larger than the heap can grow still is),
    # and up to 1 GiB of free memory at the heap's top kept rather than returned
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**30))


def collect_less() -> None:
    """Python's cyclic garbage collector runs every 10,000 allocations rather than 700,
    and leaves alone what exists once the libraries are loaded (gc.freeze). Tracing and
    compiling make and drop millions of small objects, and each full collection
    rescanned every object of jax, flax and orbax: the collector took 0.7 s of a
    6-second toy run, 0.25 s after this (memory is still freed when the last reference
    goes; only cycles wait longer)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def _initialize_distributed(args, stop: StopRequests) -> None:
    """jax.distributed for several processes (CPU collectives over gloo); also when
    only JAX's own environment variables name the coordinator."""
    if not args.join_timeout > 0:
        raise ConfigError(f"--join-timeout must be a positive number of seconds; got "
                          f"{args.join_timeout:g}")
    given = [args.coordinator, args.num_processes, args.process_id]
    if all(x is None for x in given) and "JAX_COORDINATOR_ADDRESS" not in os.environ:
        return
    if any(x is None for x in given) and not all(x is None for x in given):
        raise ConfigError("--coordinator, --num-processes and --process-id go together")
    who = "this process"
    if args.num_processes is not None:
        if args.num_processes < 1:
            raise ConfigError(f"--num-processes must be at least 1; got {args.num_processes}")
        if not 0 <= args.process_id < args.num_processes:
            raise ConfigError(f"--process-id must be in [0, {args.num_processes}) for "
                              f"--num-processes {args.num_processes}; got {args.process_id}")
        host, sep, port = args.coordinator.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"--coordinator must be HOST:PORT (process 0's address and a "
                              f"free port); got {args.coordinator!r}")
        if args.process_id == 0 and "JAX_COORDINATOR_BIND_ADDRESS" not in os.environ:
            _check_port_free(int(port))
        who = f"process {args.process_id} of {args.num_processes}"
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _join(functools.partial(jax.distributed.initialize, args.coordinator, args.num_processes,
                            args.process_id,
                            # jax's deadline (it aborts) after this process's own
                            initialization_timeout=int(min(args.join_timeout, 1e9)) + 60),
          args.join_timeout, who, args.coordinator or os.environ["JAX_COORDINATOR_ADDRESS"],
          stop)


def _check_processes_agree(config: Config, workdir: Path, mesh, num_processes) -> None:
    """Every process of a run must be given the same command: a config, workdir, mesh or
    process count of its own would train a run of no one config (a --seed of its own),
    or stop in a collective that blames the network (a model of another size), or hang
    in the first checkpoint's save (a workdir of its own). Compared by one collective
    of a hash per setting, before anything is written: a ConfigError in every process,
    naming the settings that differ."""
    if not (jax.distributed.is_initialized() and jax.process_count() > 1):
        return
    settings = {**{key: repr(value) for key, value in
                   _flatten(dataclasses.asdict(config)).items()},
                "--workdir": str(Path(workdir).absolute()),
                "--mesh": repr(dict(mesh.shape)), "--num-processes": repr(num_processes)}
    names = sorted(settings)
    # [P, settings]: int32, as jax's default integers are
    hashes = np.array([zlib.crc32(settings[name].encode()) - 2**31 for name in names],
                      np.int32)
    every = np.asarray(multihost_utils.process_allgather(hashes))
    differ = [name for i, name in enumerate(names) if len(set(every[:, i])) > 1]
    if differ:
        raise ConfigError(f"the processes of this run were given different "
                          f"{', '.join(differ)} (this is process {jax.process_index()}, with "
                          f"{', '.join(f'{n}={settings[n]}' for n in differ)}): start every "
                          f"process with the same --config, --set, --seed, --workdir and "
                          f"--mesh")


def _check_port_free(port: int) -> None:
    """Process 0 serves jax.distributed on every address at port; a port another
    program listens on made jax's service end in a segmentation fault (a port this user
    may not serve on is refused alike). Probed as jax binds, on IPv6 and IPv4 ("[::]")
    where the machine has IPv6, else on IPv4; where neither can be probed, jax tries."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                # as jax's service binds: a port whose last connections are closing is free
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((address, port))
            return
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                raise ConfigError(f"--coordinator: process 0 cannot serve on port {port} "
                                  f"({e.strerror}): give every process a port that is "
                                  f"free") from None


def _join(initialize, timeout_s: float, who: str, coordinator: str,
          stop: StopRequests) -> None:
    """Runs initialize (jax.distributed's, which waits until every process has
    connected) beside the main thread, which says after a few seconds that it waits,
    gives up after timeout_s with one line (jax's own deadline aborts the process
    with a stack dump), and honours SIGINT or SIGTERM meanwhile (no step ran: nothing
    to save)."""
    done = threading.Event()
    failed = []

    def connect():
        try:
            initialize()
        except BaseException as e:  # raised again in the main thread
            failed.append(e)
        finally:
            done.set()

    stop.joining = True
    began = time.monotonic()
    threading.Thread(target=connect, daemon=True, name="jax.distributed").start()
    said = False
    while not done.wait(0.1):
        waited = time.monotonic() - began
        if stop.signum is not None:
            _leave_now(128 + stop.signum,
                       f"interrupted ({signal.Signals(stop.signum).name}) while {who} waited "
                       f"for the other processes; this run saved nothing")
        if waited >= timeout_s:
            _leave_now(1, f"error: {who} waited {timeout_s:g} s for the other processes at "
                          f"{coordinator}, which did not all connect{_unresolved(coordinator)}: "
                          f"start every process with the same --coordinator and "
                          f"--num-processes and its own --process-id, or give them longer "
                          f"with --join-timeout")
        if not said and waited >= 3:
            print(f"{who}: waiting for the other processes at {coordinator} (at most "
                  f"{timeout_s:g} s, --join-timeout)", file=sys.stderr, flush=True)
            said = True
    stop.joining = False
    if failed:
        if isinstance(failed[0], ValueError):  # what the environment lacks
            raise ConfigError(f"cannot start jax.distributed: "
                              f"{str(failed[0]).splitlines()[0]}") from None
        raise failed[0]


def _unresolved(coordinator: str) -> str:
    """The words `" (HOST does not resolve: why)"` where the coordinator's host name
    has no address, else "". (Asked only once the processes have given up: in a cluster
    the coordinator's name may resolve only once its process has started.)"""
    host = coordinator.rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        return f" ({host} does not resolve: {e.strerror})"
    return ""


def _leave_now(status: int, message: str):
    """Print message (if any) and end the process at once. A run of several processes
    whose peer is gone cannot exit normally: jax.distributed's shutdown at exit waits
    for every process at a barrier, then aborts the process with a stack dump."""
    if message:
        print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def _leave_others_briefly(status: int, wait_s: float = 30.0) -> None:
    """A run of several processes that failed: the others, which failed alike, meet it
    at jax.distributed's shutdown barrier; if they have not within wait_s (one of them
    died: a save that failed for that reason), the process ends at once."""
    if jax.process_count() == 1:
        return
    shutdown = threading.Thread(target=jax.distributed.shutdown, daemon=True)
    shutdown.start()
    shutdown.join(wait_s)
    if shutdown.is_alive():
        _leave_now(status, "")


# The address space (`ulimit -v`) below which jax's CPU runtime cannot start a run: its
# allocations then fail in native code, which ends the process without a message (on a
# 2-core CPU, the default copy run: 1.5 and 1.8 GB ended so, 2.0 GB trained).
MIN_ADDRESS_SPACE = 2 * 2**30


def _check_address_space() -> None:
    """A ConfigError where the process's address space is limited below
    MIN_ADDRESS_SPACE, before anything is written."""
    try:
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (OSError, ValueError):   # a system that cannot tell
        return
    if limit != resource.RLIM_INFINITY and limit < MIN_ADDRESS_SPACE:
        raise ConfigError(f"the address space is limited to {limit / 2**20:.0f} MiB "
                          f"(ulimit -v); jax's runtime needs at least "
                          f"{MIN_ADDRESS_SPACE / 2**30:.0f} GiB of it: raise the limit")


def _ran_out_of_memory(error: jax.errors.JaxRuntimeError) -> bool:
    """Whether XLA's error is memory that ran out: RESOURCE_EXHAUSTED on a GPU or TPU,
    INTERNAL "... Out of memory allocating N bytes" on a CPU."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _out_of_memory(error: Exception, workdir: Path | None) -> int:
    """Exit status 1 for a run whose memory ran out, said in one line. Where the workdir
    holds a run's config (this one's, written as it began), smaller sizes are another
    config, which it refuses: the line says so."""
    said = (str(error).strip().splitlines() or [type(error).__name__])[0]
    elsewhere = ""
    if workdir is not None and (workdir / CONFIG).exists():
        elsewhere = (f" (another config: in another --workdir, or with --force-new to delete "
                     f"the run {workdir} holds)")
    print(f"error: out of memory ({said}); lower batch_size, eval_batch_size, task.eval_size "
          f"or the model's sizes{elsewhere}", file=sys.stderr)
    return 1


def main(argv=None, *, early_signals=()) -> int:
    """The command line; returns the exit status. early_signals: SIGINT/SIGTERM numbers
    received before main ran (train_toy.py catches them while the libraries load)."""
    keep_freed_memory()
    collect_less()
    with StopRequests(early_signals) as stop:
        args = _parser().parse_args(argv)
        overrides = args.overrides + ([f"seed={args.seed}"] if args.seed is not None else [])
        workdir = None
        try:
            if args.seed is not None and any(o.partition("=")[0].strip() == "seed"
                                             for o in args.overrides):
                raise ConfigError(f"--seed {args.seed} and --set seed=... both set the seed; "
                                  f"give one")
            _check_address_space()
            config = load_config(args.config, overrides)
            workdir = args.workdir or Path("runs") / config.task.name
            stop.stop_if_requested(_before_training(workdir))
            _initialize_distributed(args, stop)
            use_compilation_cache()
            try:
                mesh = mesh_lib.make_mesh(None if args.mesh is None else
                                          mesh_lib.parse_mesh(args.mesh))
            except ValueError as e:
                raise ConfigError(str(e)) from None
            except RuntimeError as e:   # JAX_PLATFORMS naming a backend this machine lacks
                if "Unable to initialize backend" not in str(e):
                    raise
                platforms = os.environ.get("JAX_PLATFORMS")
                raise ConfigError(f"cannot start jax's backend"
                                  f"{f' (JAX_PLATFORMS={platforms})' if platforms else ''}: "
                                  f"{str(e).splitlines()[0]}") from None
            _check_processes_agree(config, workdir, mesh, args.num_processes)
            summary = run(config, workdir, mesh=mesh, force_new=args.force_new, stop=stop)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except ProcessLost as e:
            _leave_now(1, f"error: {e}")
        except RunFailed as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            _leave_others_briefly(1)
            return 1
        except jax.errors.JaxRuntimeError as e:
            if jax.process_count() == 1:
                if not _ran_out_of_memory(e):
                    raise
                return _out_of_memory(e, workdir)
            _leave_now(1, f"error: {_lost_contact(e)}")
        except MemoryError as e:   # the data on the host: a batch or held-out set too large
            return _out_of_memory(e, workdir)
        except Interrupted as e:
            print(e, file=sys.stderr)
            return e.exit_status
    if jax.process_index():
        return 0
    print(f"{summary['task']}: held-out exact match {summary['exact_match']:.2%} and token "
          f"accuracy {summary['token_accuracy']:.2%} on {summary['eval_size']} sequences after "
          f"{summary['steps']} steps ({summary['seconds']:.1f} s); best exact match "
          f"{summary['best']['exact_match']:.2%} at step {summary['best']['step']}. Outputs in "
          f"{summary['workdir']}/: config.yaml, metrics.jsonl (and TensorBoard's events: "
          f"tensorboard --logdir {summary['workdir']}), checkpoints/, samples.txt, "
          f"attention.png, curves.png")
    return 0
