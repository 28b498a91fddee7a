"""Orbax checkpoints of a run: the latest few, and the best by exact-match accuracy, each
with a checksum manifest.

Each checkpoint holds the `TrainState` and a small JSON record (the metrics of a
partly logged window, the best score so far). Saving is synchronous: when `save`
returns, the step is on disk, so the step a message names is the step a killed process
resumes from. Orbax writes a step to a temporary directory and renames it when complete
(a process killed while saving leaves the step invisible, and orbax removes the leftover
at the next start); then `MANIFEST`, the size and SHA-256 of every file of the step, is
written beside them. A step is intact when its files match its manifest: one without a
manifest was cut short, one whose files differ was damaged. `restore_latest` moves such
steps aside to `checkpoints.damaged/`, saying so, and restores the newest intact one.
"""

import contextlib
import errno
import gc
import hashlib
import inspect
import json
import logging
import math
import os
import sys
import types
import warnings
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers

BEST_METRIC = "exact_match"
MANIFEST = "manifest.json"
DAMAGED = "checkpoints.damaged"


def _not_preemption_echo(record: logging.LogRecord) -> bool:
    """Drops orbax's warning that a run of several processes reached the step at which a
    signal stops them: the run says so itself, in its one line."""
    return "Reached preemption sync point" not in record.getMessage()


logging.getLogger("absl").addFilter(_not_preemption_echo)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or an intact one does not restore. collective:
    the save failed in a collective between processes (another process stopped or
    cannot be reached), not in the files."""

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


def _in_a_collective(error: BaseException) -> bool:
    """error (or one it was raised from) is a failed collective between processes:
    jax's runtime error, or the one orbax passes on from its sync of the processes."""
    while error is not None:
        if isinstance(error, jax.errors.JaxRuntimeError) or any(
                word in str(error) for word in ("Gloo", "NCCL", "Connection closed by peer",
                                                "Connection reset by peer")):
            return True
        error = error.__cause__ or error.__context__
    return False


def _one_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _is_echo(unraisable) -> bool:
    """An unraisable exception that echoes a failed save or restore: a tensorstore write
    finding orbax's event loop closed, or one of orbax's coroutines freed with the
    failure it never handed back (a read of an array of another shape, say)."""
    error, source = unraisable.exc_value, unraisable.object
    return ((isinstance(error, RuntimeError) and str(error) == "Event loop is closed")
            or (inspect.iscoroutine(source)
                and f"{os.sep}orbax{os.sep}" in source.cr_code.co_filename))


@contextlib.contextmanager
def _failure_said_once():
    """While a save or restore runs, the echoes of its failure are dropped; the
    CheckpointError it raises says it once. The echoes: each orbax thread logs the
    exception it hands back (absl ERROR, with a traceback); once one write fails and
    orbax closes its event loop, each tensorstore write still in flight reports the loop
    closed (an unraisable RuntimeError: hundreds of tracebacks on a full disk), and each
    of its failed tasks and coroutines, when freed, that its exception was never
    retrieved (asyncio ERROR, or unraisable). Those are freed when orbax lets go of them:
    during the operation, when the manager closes, or at exit. So once the body sets
    `failed` on what this yields, the filters stay for the rest of the process, which
    the CheckpointError ends."""
    absl, tasks = logging.getLogger("absl"), logging.getLogger("asyncio")
    unraisable_hook = sys.unraisablehook
    outcome = types.SimpleNamespace(failed=False)

    def logged_exception(record: logging.LogRecord) -> bool:
        return record.exc_info is None

    def dropping_echoes(unraisable) -> None:
        if not _is_echo(unraisable):
            unraisable_hook(unraisable)

    absl.addFilter(logged_exception)
    tasks.addFilter(logged_exception)
    sys.unraisablehook = dropping_echoes
    try:
        with warnings.catch_warnings():
            # a coroutine freed before the operation ends (by its gc.collect, say)
            warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited",
                                    RuntimeWarning)
            yield outcome
    finally:
        if outcome.failed:   # and a coroutine never started, when freed: a warning
            warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited",
                                    RuntimeWarning)
        else:
            sys.unraisablehook = unraisable_hook
            tasks.removeFilter(logged_exception)
            absl.removeFilter(logged_exception)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(step_dir: Path) -> dict[str, Path]:
    """Every file of a step but its manifest, by path relative to the step."""
    return {p.relative_to(step_dir).as_posix(): p for p in sorted(step_dir.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def write_manifest(step_dir: Path) -> None:
    """The step's `MANIFEST`; atomic, so a step never has half of one."""
    files = {name: {"size": path.stat().st_size, "sha256": _sha256(path)}
             for name, path in _files(step_dir).items()}
    tmp = step_dir / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def damage(step_dir: Path) -> str | None:
    """What is wrong with a step's files, or None when they match its manifest."""
    try:
        expected = json.loads((step_dir / MANIFEST).read_text())["files"]
        if not (isinstance(expected, dict) and all(
                isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and isinstance(entry.get("sha256"), str) for entry in expected.values())):
            raise ValueError("its files are not each a size and a sha256")
    except FileNotFoundError:
        return "it has no manifest: its save did not finish"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is unreadable ({_one_line(e)})"
    found = _files(step_dir)
    for name in sorted(expected.keys() | found.keys()):
        if name not in found:
            return f"{name} is missing"
        if name not in expected:
            return f"{name} is not in its manifest"
        size = found[name].stat().st_size
        if size != expected[name]["size"]:
            return f"{name} has {size} bytes instead of {expected[name]['size']}"
        if _sha256(found[name]) != expected[name]["sha256"]:
            return f"{name} has other contents than were saved (checksum mismatch)"
    return None


def _exact_match(metrics: dict) -> float:
    """A step's rank among the checkpoints: its exact match, -inf if not evaluated."""
    return metrics.get(BEST_METRIC, -math.inf)


class Checkpoints:
    """`save(step, state, record, exact_match=None)`, `restore_latest(template, warn)`
    and `latest_intact()`.

    primary: this process writes the manifests and moves damaged steps aside (with
    several processes, one does; the others wait for it where it matters).
    """

    def __init__(self, directory: Path, keep: int, *, primary: bool = True):
        self.directory = Path(directory).absolute()
        self.primary = primary
        if self.directory.exists() and not self.directory.is_dir():
            # refused here: orbax would log its own traceback from a thread, and fail
            # only at the first save, after the run had begun
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR),
                                     str(self.directory))
        # The latest `keep` steps and the best evaluated one. A step saved without an
        # evaluation ranks lowest (its metrics are {}); among equals the newest, which
        # the latest keep anyway.
        best = checkpoint_managers.BestN(get_metric_fn=_exact_match, n=1,
                                         keep_checkpoints_without_metrics=False)
        policy = checkpoint_managers.AnyPreservationPolicy(
            [checkpoint_managers.LatestN(n=keep), best])
        self.manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "record"),
            options=ocp.CheckpointManagerOptions(
                preservation_policy=policy, enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
                # orbax writes a step's metrics (and reads them back when a later
                # process resumes) only with a best_fn: without, a resumed run knew no
                # step's exact match and deleted the best step as an old one
                best_fn=_exact_match, best_mode="max"))

    def _step_dir(self, step: int) -> Path:
        # orbax's default step names: the step number itself
        return self.directory / str(step)

    def save(self, step: int, state, record: dict, exact_match: float | None = None) -> None:
        """Writes step completely, manifest included, before returning."""
        with _failure_said_once() as outcome:
            try:
                self.manager.save(
                    step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                  record=ocp.args.JsonSave(record)),
                    metrics={} if exact_match is None else {BEST_METRIC: exact_match},
                    force=True)
                if self.primary:
                    write_manifest(self._step_dir(step))
                return
            except Exception as e:  # whatever orbax or the file system raises: one line
                failure = (f"cannot save the checkpoint of step {step} in {self.directory}: "
                           f"{_one_line(e)}")
                collective = _in_a_collective(e)
                outcome.failed = True
            gc.collect()   # the failed save's tasks, while their echoes are dropped
        raise CheckpointError(failure, collective)

    def latest_intact(self) -> int | None:
        """The newest step whose files match its manifest."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            if damage(self._step_dir(step)) is None:
                return step
        return None

    def _set_aside(self, warn) -> int:
        """Moves damaged steps, newest first, until an intact one (or none) is left;
        returns how many it moved."""
        moved = 0
        for step in sorted(self.manager.all_steps(), reverse=True):
            problem = damage(self._step_dir(step))
            if problem is None:
                break
            target = self.directory.parent / DAMAGED / str(step)
            copies = 1
            while target.exists():
                copies += 1
                target = target.with_name(f"{step}.{copies}")
            target.parent.mkdir(exist_ok=True)
            os.replace(self._step_dir(step), target)
            warn(f"checkpoint step {step} is damaged ({problem}); moved it to {target} and "
                 f"skipped it")
            moved += 1
        return moved

    def restore_latest(self, template, warn=print):
        """`(step, state, record)` of the newest intact checkpoint, or None when there is
        none; damaged or partial steps on the way are moved aside and reported to warn.

        template is a state of the right structure (shapes and dtypes are read from it).
        """
        moved = self._set_aside(warn) if self.primary else 0
        if jax.process_count() > 1:  # the others restore once the damaged steps are gone
            multihost_utils.sync_global_devices("attnjax checkpoints verified")
        self.manager.reload()
        step = self.manager.latest_step()
        if step is None:
            if moved:
                warn(f"no intact checkpoint is left in {self.directory}: the run starts "
                     f"again from step 0")
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        with _failure_said_once() as outcome:
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()))
            except Exception as e:  # the files are as saved: they belong to another model
                failure = (f"checkpoint step {step} in {self.directory} is intact but does not "
                           f"restore into this run's model ({_one_line(e)})")
                outcome.failed = True
            else:
                return step, restored["state"], restored["record"]
            gc.collect()   # the failed restore's tasks, while their echoes are dropped
        raise CheckpointError(failure)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
