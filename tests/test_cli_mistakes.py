"""Mistakes on the command line and in start-up: each is one line and exit 2, and a run
that never began leaves its workdir as it was (no config.yaml that would refuse the
corrected command, no run deleted by --force-new)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from attnjax.toy import cli
from attnjax.toy import train as training
from attnjax.toy.config import dump_config, load_config

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
])
def test_bad_multi_process_options_exit_2_with_one_line(tmp_path, capsys, argv, message):
    assert cli.main(argv + ["--workdir", str(tmp_path / "w")]) == 2
    _one_line(capsys, "error: " + message)
    assert not (tmp_path / "w").exists()


def test_a_coordinator_named_only_in_the_environment_is_one_line(tmp_path):
    """JAX_COORDINATOR_ADDRESS alone: jax.distributed cannot tell the process count."""
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS="127.0.0.1:1")
    done = subprocess.run([sys.executable, str(ROOT / "train_toy.py"), "--workdir",
                           str(tmp_path / "w")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert "error: cannot start jax.distributed: " in done.stderr


@pytest.mark.parametrize("flag", ["--workdir", "--config"])
def test_a_name_too_long_for_the_filesystem_is_one_line(tmp_path, capsys, flag):
    assert cli.main([flag, str(tmp_path / ("x" * 300))]) == 2
    _one_line(capsys, "error: ", "File name too long")


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


def test_an_emptied_saved_config_is_unreadable_not_another_config(tmp_path):
    """(read as all defaults, it was refused as another config, naming values the file
    never held)"""
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.yaml").write_text("")
    config = load_config(ROOT / "configs" / "copy.yaml", TINY)
    with pytest.raises(cli.ConfigError, match=r"config.yaml is unreadable \(empty\)"):
        cli._claim_workdir(workdir, config, force_new=False)
