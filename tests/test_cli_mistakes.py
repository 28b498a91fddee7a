"""Mistakes on the command line and in start-up: each is one line and exit 2 (processes
of a run of several that never all connect: exit 1 once they have waited, 130 on
Ctrl-C), and a run that never began leaves its workdir as it was (no config.yaml that
would refuse the corrected command, no run deleted by --force-new)."""

import functools
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnjax.toy import cli
from attnjax.toy import train as training
from attnjax.toy.config import dump_config, load_config
from tests import children
from tests.numerics import as_users_run

ROOT = Path(__file__).resolve().parents[1]
TINY = ["task.num_symbols=5", "task.min_len=1", "task.max_len=6", "task.eval_size=20",
        "model.d_model=32", "model.num_heads=2", "model.d_ff=64", "model.num_encoder_layers=1",
        "model.num_decoder_layers=1", "model.max_len=16", "steps=5", "batch_size=8",
        "log_every=1", "eval_every=5", "checkpoint_every=5", "eval_batch_size=20"]


def _one_line(capsys, *parts: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in err, (part, err)
    return err


@pytest.mark.parametrize("argv, message", [
    (["--seed", "abc"], "argument --seed: invalid int value: 'abc'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--num-processes", "x"], "argument --num-processes: invalid int value: 'x'"),
])
def test_an_argument_argparse_refuses_is_one_line(capsys, argv, message):
    """(argparse itself prints its usage block first: five lines here)"""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = _one_line(capsys, message, "see --help")
    assert err.startswith(Path(sys.argv[0]).name) or "error: " in err


@pytest.mark.parametrize("argv, message", [
    (["--coordinator", "127.0.0.1:12345", "--num-processes", "2", "--process-id", "5"],
     "--process-id must be in [0, 2) for --num-processes 2; got 5"),
    (["--coordinator", "127.0.0.1:12345", "--num-processes", "0", "--process-id", "0"],
     "--num-processes must be at least 1; got 0"),
    (["--coordinator", "garbage", "--num-processes", "1", "--process-id", "0"],
     "--coordinator must be HOST:PORT"),
    (["--coordinator", "127.0.0.1:99999", "--num-processes", "1", "--process-id", "0"],
     "--coordinator must be HOST:PORT"),
    (["--coordinator", "127.0.0.1:12345", "--num-processes", "2", "--process-id", "0",
      "--join-timeout", "0"], "--join-timeout must be a positive number of seconds; got 0"),
    (["--coordinator", "127.0.0.1:12345", "--num-processes", "2", "--process-id", "1",
      "--join-timeout", "nan"], "--join-timeout must be a positive number of seconds; got nan"),
])
def test_bad_multi_process_options_exit_2_with_one_line(tmp_path, capsys, argv, message):
    assert cli.main(argv + ["--workdir", str(tmp_path / "w")]) == 2
    _one_line(capsys, "error: " + message)
    assert not (tmp_path / "w").exists()


def test_a_backend_the_machine_lacks_or_too_little_address_space_is_one_line(tmp_path):
    """JAX_PLATFORMS naming a backend this machine lacks (jax's RuntimeError had ended the
    run in a traceback), and an address space (`ulimit -v`) too small for jax's runtime
    (its allocations had failed in native code: a segmentation fault or an abort, saying
    nothing): exit 2, one line, nothing written. Side by side."""
    runs = {
        "JAX_PLATFORMS": (dict(JAX_PLATFORMS="no_such_backend"), [],
                          "error: cannot start jax's backend (JAX_PLATFORMS=no_such_backend): "
                          "Unable to initialize backend 'no_such_backend'"),
        # (the shell's limit, as a user sets it: no Python between fork and exec)
        "ulimit": ({}, ["bash", "-c", 'ulimit -v 1048576 && exec "$0" "$@"'],
                   "error: the address space is limited to 1024 MiB (ulimit -v); "
                   "jax's runtime needs at least 2 GiB of it: raise the limit"),
    }
    started = {name: subprocess.Popen(
        [*shell, sys.executable, str(ROOT / "train_toy.py"), "--workdir", str(tmp_path / name)],
        env=children.environment(None, **extra), stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL, text=True) for name, (extra, shell, _) in runs.items()}
    for name, process in started.items():
        _, err = process.communicate(timeout=120)
        assert process.returncode == 2, (name, err[-2000:])
        assert err.count("\n") == 1 and err.startswith(runs[name][2]), (name, err)
        assert not (tmp_path / name).exists()


def test_a_coordinator_named_only_in_the_environment_is_one_line(tmp_path):
    """JAX_COORDINATOR_ADDRESS alone: jax.distributed cannot tell the process count."""
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS="127.0.0.1:1")
    done = subprocess.run([sys.executable, str(ROOT / "train_toy.py"), "--workdir",
                           str(tmp_path / "w")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "error: cannot start jax.distributed: " in done.stderr


def test_a_coordinator_port_in_use_is_one_line(tmp_path, capsys):
    """Process 0 serves jax.distributed on the port: another program listening there
    made jax's service fail with a segmentation fault."""
    with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as other:
        other.bind(("::" if socket.has_ipv6 else "", 0))
        other.listen()
        port = other.getsockname()[1]
        argv = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                "--process-id", "0", "--workdir", str(tmp_path / "w")]
        assert cli.main(argv) == 2
    _one_line(capsys, f"error: --coordinator: process 0 cannot serve on port {port} "
              f"(Address already in use): give every process a port that is free")
    assert not (tmp_path / "w").exists()


def _waiting_alone(workdir: Path, process_id: int, *flags: str,
                   host: str = "127.0.0.1") -> subprocess.Popen:
    """The training command as one process of two whose other never starts."""
    port = children.free_port()
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train_toy.py"), "--workdir", str(workdir),
         "--coordinator", f"{host}:{port}", "--num-processes", "2", "--process-id",
         str(process_id), *flags], env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("started, joining", [(False, False), (True, True)])
def test_a_signal_before_the_processes_have_connected_leaves_jax_s_backend_alone(
        monkeypatch, started, joining):
    """Before jax.distributed has started (or while its processes connect), a signal is
    recorded for the start-up's next check; asking jax.process_count then, to know
    whether the processes must agree on the stop, would start jax's backend alone."""
    def backend_started():
        raise AssertionError("jax.process_count was called")

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: started)
    monkeypatch.setattr(jax, "process_count", backend_started)
    stop = cli.StopRequests()
    stop.joining = joining
    stop._request(signal.SIGINT, None)
    assert stop.signum == signal.SIGINT and stop.forwarded is None


@pytest.mark.parametrize("flag", ["--workdir", "--config"])
def test_a_name_too_long_for_the_filesystem_is_one_line(tmp_path, capsys, flag):
    assert cli.main([flag, str(tmp_path / ("x" * 300))]) == 2
    _one_line(capsys, "error: ", "File name too long")


@pytest.mark.parametrize("error", [
    # numpy's, for a held-out set of 2**31 examples
    MemoryError("Unable to allocate 128. GiB for an array with shape (2147483647, 16) and "
                "data type int32"),
    # XLA's, for a batch the device cannot hold
    jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                               "137438953472 bytes.\nmore of XLA's details"),
    # XLA's on a CPU, for a model the machine cannot hold (model.d_ff=100000000)
    jax.errors.JaxRuntimeError("INTERNAL: Error dispatching computation: Out of memory "
                               "allocating 12800000000 bytes."),
])
def test_memory_that_runs_out_is_one_line(tmp_path, capsys, monkeypatch, error):
    """A size in range that the machine cannot hold (batch_size=2147483647, say) exits 1
    with one line naming what to lower (a traceback of 28 lines)."""
    def allocating(*args, **kwargs):
        raise error

    monkeypatch.setattr(cli, "make_task", allocating)
    tiny = [a for o in TINY for a in ("--set", o)]
    assert cli.main(["--workdir", str(tmp_path / "w"), *tiny]) == 1
    said = str(error).splitlines()[0]
    _one_line(capsys, f"error: out of memory ({said}); lower batch_size, eval_batch_size, "
                      f"task.eval_size or the model's sizes")


def test_memory_that_runs_out_once_the_run_began_says_where_other_sizes_run(tmp_path, capsys,
                                                                           monkeypatch, float32):
    """Smaller sizes are another config, which the workdir, holding this run's
    config.yaml, refuses: the line says how to run them (it sent the user into that
    refusal)."""
    error = jax.errors.JaxRuntimeError("INTERNAL: Error dispatching computation: Out of "
                                       "memory allocating 12800000000 bytes.")

    def allocating(*args, **kwargs):
        raise error

    monkeypatch.setattr(cli, "Checkpoints", allocating)   # once config.yaml is written
    workdir = tmp_path / "w"
    tiny = [a for o in TINY for a in ("--set", o)]
    assert cli.main(["--workdir", str(workdir), *tiny]) == 1
    assert (workdir / "config.yaml").exists()
    _one_line(capsys, f"error: out of memory ({error}); lower batch_size, eval_batch_size, "
                      f"task.eval_size or the model's sizes (another config: in another "
                      f"--workdir, or with --force-new to delete the run {workdir} holds)")


def test_a_config_nested_too_deeply_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text("[" * 3000 + "]" * 3000)
    assert cli.main(["--config", str(path), "--workdir", str(tmp_path / "w")]) == 2
    _one_line(capsys, f"error: config {path} is nested too deeply to read")


def test_seed_given_twice_is_refused(tmp_path, capsys):
    """--seed 1 --set seed=2: one of them would silently lose."""
    argv = ["--seed", "1", "--set", "seed=2", "--set", "steps=0", "--workdir",
            str(tmp_path / "w")]
    assert cli.main(argv) == 2
    _one_line(capsys, "error: --seed 1 and --set seed=... both set the seed")


def test_a_saved_config_with_a_key_that_is_not_a_name_is_refused_in_one_line(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    (workdir / "config.yaml").write_text(dump_config(config) + "1: x\n")
    with pytest.raises(cli.ConfigError, match=r"another config \(it differs in 1\)"):
        cli._claim_workdir(workdir, config, force_new=False)


@pytest.mark.parametrize("entry, make, wrong", [
    ("checkpoints", lambda p: p.write_text("x"), "a file, not a directory"),
    ("metrics.jsonl", lambda p: p.mkdir(), "a directory, not a file"),
    ("checkpoints", lambda p: p.symlink_to(p.parent / "gone"), "a link to nothing"),
])
def test_a_workdir_entry_of_the_wrong_kind_is_one_line_before_compiling(
        tmp_path, capsys, monkeypatch, entry, make, wrong):
    """(a file named checkpoints, or a directory named metrics.jsonl, failed the run with
    exit 1 once the model had compiled)"""
    workdir = tmp_path / "run"
    workdir.mkdir()
    make(workdir / entry)
    monkeypatch.setattr(training, "make_train_step", lambda *a, **k: pytest.fail("compiled"))
    assert cli.main(["--workdir", str(workdir), *(a for o in TINY for a in ("--set", o))]) == 2
    _one_line(capsys, f"error: cannot use --workdir {workdir}: {workdir / entry} is {wrong}",
              "--force-new")
    assert not (workdir / "config.yaml").exists()
    # --force-new deletes it, the link to nothing too (glob had not seen it)
    cli._begin_run(workdir, load_config(ROOT / "configs" / "copy.yaml", TINY), force_new=True)
    assert sorted(p.name for p in workdir.iterdir() if p.name != cli.LOCK) == ["config.yaml"]


def test_a_workdir_that_links_to_nothing_is_one_line_naming_the_target(tmp_path, capsys):
    """(the workdir's mkdir had said "[Errno 17] File exists")"""
    workdir = tmp_path / "run"
    workdir.symlink_to(tmp_path / "gone" / "there")
    assert cli.main(["--workdir", str(workdir), *(a for o in TINY for a in ("--set", o))]) == 2
    _one_line(capsys, f"error: --workdir {workdir} is a link to nothing "
                      f"({tmp_path / 'gone' / 'there'}): make its target")
    assert workdir.is_symlink() and not (tmp_path / "gone").exists()


def test_a_workdir_under_a_bracket_is_one_line_before_anything_is_written(tmp_path,
                                                                          monkeypatch, capsys):
    """orbax finds a checkpoint's parts by a glob of its path: under a '[' it found none,
    so every checkpoint was saved but failed to restore (a resumed run exited 2 saying
    the checkpoint "does not restore into this run's model")."""
    (tmp_path / "runs[1]").mkdir()
    monkeypatch.chdir(tmp_path / "runs[1]")
    assert cli.main(["--workdir", "run", *(a for o in TINY for a in ("--set", o))]) == 2
    _one_line(capsys, "error: --workdir run: its path has a '[', which the checkpoints "
                      "cannot be read back from")
    assert list((tmp_path / "runs[1]").iterdir()) == []


def _old_run(workdir: Path, config) -> dict:
    (workdir / "checkpoints" / "5").mkdir(parents=True)
    (workdir / "metrics.jsonl").write_text('{"step": 5}\n')
    (workdir / "config.yaml").write_text(dump_config(config))
    return {p.relative_to(workdir): p.read_bytes() if p.is_file() else None
            for p in workdir.rglob("*")}


@pytest.mark.parametrize("fault", ["mistake", "interrupted"])
def test_a_run_stopped_before_it_began_leaves_the_workdir_as_it_was(tmp_path, monkeypatch,
                                                                    fault):
    """A mistake found while the model is built (a model the mesh cannot split), or a
    Ctrl-C honoured before the first step: a fresh workdir is not made, and a workdir
    holding a run keeps it whole, --force-new or not (before, config.yaml was written
    first, which refused the corrected command, and --force-new had deleted the run)."""
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    new = load_config(ROOT / "configs" / "copy.yaml", TINY + ["seed=7"])

    def stopped(*args, **kwargs):
        if fault == "mistake":
            raise ValueError("a model the mesh cannot split")
        raise cli.Interrupted(signal.SIGINT, cli.BEFORE_TRAINING)

    monkeypatch.setattr(training, "init_state" if fault == "mistake" else "make_train_step",
                        stopped)
    expected = cli.ConfigError if fault == "mistake" else cli.Interrupted
    fresh = tmp_path / "fresh"
    with pytest.raises(expected):
        cli.run(new, fresh)
    assert not fresh.exists()
    held = tmp_path / "held"
    before = _old_run(held, config)
    for force_new in (False, True):
        with pytest.raises(expected):
            cli.run(config if not force_new else new, held, force_new=force_new)
        after = {p.relative_to(held): p.read_bytes() if p.is_file() else None
                 for p in held.rglob("*") if p.name != cli.LOCK}
        assert after == before


def test_a_second_ctrl_c_before_the_run_began_leaves_no_new_workdir(tmp_path, monkeypatch):
    """Two Ctrl-Cs while the model compiles stop the process at once (os._exit): the
    workdir the run had made is removed first (it was left holding only its lock)."""
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    stops, workdirs = [], [tmp_path / "fresh", tmp_path / "held"]

    class Exited(Exception):
        pass

    def exit_at_once(status):
        raise Exited(status)

    def interrupted_twice(*args, **kwargs):
        assert (workdirs[0] / cli.LOCK).exists()   # the workdir is made and locked by now
        for _ in range(2):
            stops[-1]._request(signal.SIGINT, None)

    monkeypatch.setattr(os, "_exit", exit_at_once)
    monkeypatch.setattr(training, "make_train_step", interrupted_twice)
    fresh, held = workdirs
    with cli.StopRequests() as stop:
        stops.append(stop)
        with pytest.raises(Exited) as raised:
            cli.run(config, fresh, stop=stop)
    assert raised.value.args == (128 + signal.SIGINT,)
    assert not fresh.exists()
    workdirs.pop(0)
    before = _old_run(held, config)   # a workdir that was there is left as it was
    with cli.StopRequests() as stop:
        stops.append(stop)
        with pytest.raises(Exited):
            cli.run(config, held, stop=stop)
    assert {p.relative_to(held): p.read_bytes() if p.is_file() else None
            for p in held.rglob("*") if p.name != cli.LOCK} == before


def test_the_loop_runs_at_most_one_step_ahead_of_the_steps_finished(tmp_path, monkeypatch):
    """When the loop draws step p's batch, steps up to p − 2 have finished, so a stop
    request (a preemption's SIGTERM) is honoured within about two steps. (The loop had
    queued every step up to the next log line: with slow steps, a grace period could
    pass before the run stopped.) Here each step is made slow (a product chain after it)."""
    # (no log line before the stop, which would wait for the steps; the train step is
    # the other tests' program)
    config = load_config(ROOT / "configs" / "copy.yaml", TINY + ["log_every=5"])
    draws = np.random.default_rng()
    square = jnp.asarray(draws.standard_normal((256, 256)) / 16, jnp.float32)
    slow = jax.jit(lambda a: functools.reduce(lambda b, _: jnp.tanh(b @ b), range(24), a))
    make_step, draw_batch = training.make_train_step, training.train_batch
    finished, metrics_of_steps = [], []

    def slowed_step(*args, **kwargs):
        step = make_step(*args, **kwargs)

        def run(state, batch):
            state, metrics = step(state, batch)
            metrics = dict(metrics, loss=metrics["loss"] + 0 * slow(square)[0, 0])
            metrics_of_steps.append(metrics["loss"])
            return state, metrics
        run.lower = step.lower   # compiled ahead, while the parameters are initialised
        return run

    def batch(task, config, step, mesh):   # the batch of loop step `step + 1`
        finished.append((step + 1, sum(m.is_ready() for m in metrics_of_steps)))
        if step + 1 == 4:
            stop.signum = signal.SIGINT   # as a Ctrl-C while the batch is drawn sets it
        return draw_batch(task, config, step, mesh)

    monkeypatch.setattr(training, "make_train_step", slowed_step)
    monkeypatch.setattr(training, "train_batch", batch)
    with as_users_run(), cli.StopRequests() as stop:
        with pytest.raises(cli.Interrupted, match="at step 4; saved a checkpoint of step 4"):
            cli.run(config, tmp_path / "run", interactive=False, stop=stop)
    assert [p for p, _ in finished] == [1, 2, 3, 4]
    assert all(done >= p - 2 for p, done in finished), finished


def test_ctrl_c_before_the_first_step_says_the_checkpoints_held_are_as_they_were(tmp_path):
    """(it said only "this run saved nothing", which left the run resumed in doubt)"""
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    held = tmp_path / "held"
    before = _old_run(held, config)
    for workdir, said in ((tmp_path / "fresh", cli.BEFORE_TRAINING),
                          (held, f"{cli.BEFORE_TRAINING}; the checkpoints already in "
                                 f"{held / 'checkpoints'} are as they were")):
        with cli.StopRequests(early=(signal.SIGINT,)) as stop:
            with pytest.raises(cli.Interrupted) as raised:
                cli.run(config, workdir, stop=stop)
        assert str(raised.value) == f"interrupted (SIGINT) {said}"
        assert raised.value.exit_status == 130
    assert {p.relative_to(held): p.read_bytes() if p.is_file() else None
            for p in held.rglob("*") if p.name != cli.LOCK} == before


def test_ctrl_c_after_the_run_began_says_config_yaml_was_written_and_the_old_run_deleted(
        tmp_path, monkeypatch):
    """A Ctrl-C honoured once the run has written its config.yaml (and --force-new has
    deleted the run the workdir held), before the first step, says so (it said "this run
    saved nothing", with the old run gone); the same command again starts the run."""
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    new = load_config(ROOT / "configs" / "copy.yaml", TINY + ["seed=7"])
    begin = cli._begin_run
    stops = []

    def begun_then_interrupted(*args, **kwargs):
        said = begin(*args, **kwargs)
        stops[-1].signum = signal.SIGINT   # as Ctrl-C there sets it
        return said

    monkeypatch.setattr(cli, "_begin_run", begun_then_interrupted)
    held = tmp_path / "held"
    _old_run(held, config)
    for workdir, force_new, deleted in (
            (tmp_path / "fresh", False, ""),
            (held, True, f" (--force-new deleted the run {held} held)")):
        with cli.StopRequests() as stop, as_users_run():
            stops.append(stop)
            with pytest.raises(cli.Interrupted) as raised:
                cli.run(new, workdir, force_new=force_new, stop=stop)
        assert str(raised.value) == (
            f"interrupted (SIGINT) {cli.BEFORE_TRAINING} but its config.yaml{deleted}: rerun "
            f"the same command to start it")
        # the old run's checkpoint and records are gone; nothing of this one but its config
        assert not any((workdir / "checkpoints").iterdir())
        assert (workdir / "metrics.jsonl").read_text() == ""
        assert load_config(workdir / "config.yaml") == new
        os.close(cli._claim_workdir(workdir, new, force_new=False))   # the same command runs


def test_an_emptied_saved_config_is_unreadable_not_another_config(tmp_path):
    """(read as all defaults, it was refused as another config, naming values the file
    never held)"""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.yaml").write_text("")
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    with pytest.raises(cli.ConfigError, match=r"config.yaml is unreadable \(empty\)"):
        cli._claim_workdir(workdir, config, force_new=False)


# --- processes of a run whose others never connect: last in the module, as they read the
# processes that `waiting` started when it began -----------------------------------------

# The hosts of processes whose others never connect, and why their error line says so
# (the second, a name that never resolves: RFC 2606).
NEVER_CONNECTED = [
    ("127.0.0.1", "which did not all connect: start every process"),
    ("nosuchhost.invalid", "which did not all connect (nosuchhost.invalid does not "
                           "resolve: "),
]


@pytest.fixture(scope="module", autouse=True)
def waiting(tmp_path_factory):
    """The processes left waiting alone, and their workdirs: one per host of
    NEVER_CONNECTED, giving up after 4 s, and "ctrl_c", which waits for as long as the
    default allows. Started side by side as the module begins (autouse), their seconds
    of waiting pass while the other tests run."""
    tmp = tmp_path_factory.mktemp("waiting")
    started = {host: (_waiting_alone(tmp / host, 1, "--join-timeout", "4", host=host),
                      tmp / host) for host, _ in NEVER_CONNECTED}
    started["ctrl_c"] = _waiting_alone(tmp / "ctrl_c", 0), tmp / "ctrl_c"
    yield started
    for process, _ in started.values():
        process.kill()
        process.communicate()


@pytest.mark.parametrize("host, why", NEVER_CONNECTED)
def test_a_process_whose_others_never_connect_says_so_and_gives_up_in_one_line(waiting,
                                                                               host, why):
    """A wrong port or host, a process not started: jax.distributed waited 300 s in
    silence and then aborted the process with a C++ stack dump. Now the process says it
    waits, and at --join-timeout it ends with one line and exit 1, naming a host that
    does not resolve."""
    process, workdir = waiting[host]
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "Check failure" not in err, err[-3000:]
    waited, error = err.splitlines()
    assert waited.startswith(f"process 1 of 2: waiting for the other processes at {host}:")
    assert error.startswith("error: process 1 of 2 waited 4 s for the other processes")
    assert why in error and error.endswith("or give them longer with --join-timeout")
    assert not workdir.exists()


def test_ctrl_c_while_waiting_for_the_other_processes_ends_the_process_at_once(waiting):
    """jax.distributed waits in C++ for every process to connect; the signal was held
    until it gave up (300 s). It is now honoured within a moment: exit 130, one line."""
    process, workdir = waiting["ctrl_c"]
    assert select.select([process.stderr], [], [], 60)[0], "nothing said in 60 s"
    said = process.stderr.readline()
    assert said.startswith("process 0 of 2: waiting for the other processes"), said
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    out, err = process.communicate(timeout=60)
    took = time.monotonic() - sent
    assert process.returncode == 130, err[-3000:]
    assert err == ("interrupted (SIGINT) while process 0 of 2 waited for the other "
                   "processes; this run saved nothing\n"), err[-3000:]
    assert took < 30, took   # (jax's own deadline is 300 + 60 s)
    assert not workdir.exists()
