"""The `attnjax-train` command as a user gets it: attnjax built as a wheel, installed (not
editable) into a directory of its own, and run from a temporary directory outside the
clone. The runs are started side by side by one module fixture."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import children

ROOT = Path(__file__).resolve().parents[1]
# the shipped copy_decoder_only config made tiny (a decoder-only model compiles fastest)
TINY = ["task.num_symbols=5", "task.max_len=4", "task.eval_size=40", "model.d_model=16",
        "model.num_heads=2", "model.d_ff=32", "model.num_decoder_layers=1", "model.max_len=16",
        "optim.warmup_steps=2", "steps=4", "batch_size=16", "log_every=2", "eval_every=4",
        "checkpoint_every=2", "eval_batch_size=40"]


def _install(root: Path) -> Path:
    """attnjax's wheel, installed with `pip install --target`; the directory."""
    source = root / "source"
    shutil.copytree(ROOT / "attnjax", source / "attnjax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "wheel"),
                          str(source)], check=True, capture_output=True, timeout=120)
    wheel, = (root / "wheel").glob("attnjax-*.whl")
    subprocess.run(pip + ["install", "--no-deps", "--target", str(root / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    return root / "site"


class _Command:
    """One `attnjax-train` process started in `cwd`; wait() keeps its output."""

    def __init__(self, site: Path, cwd: Path, *args: str):
        # the installed copy only (nothing from the clone on the path), on one CPU device as
        # a user's machine has
        env = children.environment(None, PYTHONPATH=str(site))
        cwd.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd
        self.process = subprocess.Popen([str(site / "bin" / "attnjax-train"), *args], cwd=cwd,
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)

    def wait(self) -> "_Command":
        self.stdout, self.stderr = self.process.communicate(timeout=300)
        self.returncode = self.process.returncode
        return self


def _tiny(*extra: str) -> list[str]:
    return [a for o in TINY + list(extra) for a in ("--set", o)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("installed")
    site = _install(root)
    elsewhere = root / "elsewhere"   # no configs/ here, and not the clone
    train = _Command(site, elsewhere, "--config", "copy_decoder_only", "--workdir", "run", *_tiny())
    quick = {"help": _Command(site, elsewhere, "--help"),
             "mesh": _Command(site, elsewhere, "--mesh", "data=4", "--workdir", "mesh")}
    done = {name: command.wait() for name, command in quick.items()}
    done["train"] = train.wait()
    assert done["train"].returncode == 0, done["train"].stderr[-3000:]
    done["more"] = _Command(site, elsewhere, "--config", "copy_decoder_only", "--workdir", "run",
                            *_tiny("steps=8")).wait()
    done["origin"] = subprocess.run(
        [sys.executable, "-c", "import attnjax; print(attnjax.__file__)"], cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
    done["site"], done["workdir"] = site, elsewhere / "run"
    return done


def _one_line_error(command: _Command, message: str) -> None:
    assert command.returncode == 2, command.stderr[-2000:]
    assert command.stderr.count("\n") == 1 and "Traceback" not in command.stderr
    assert message in command.stderr


def _metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_the_command_is_the_installed_one(runs):
    assert runs["origin"].stdout.startswith(str(runs["site"] / "attnjax")), runs["origin"]
    assert not (runs["workdir"].parent / "configs").exists()


def test_help_names_the_command_that_was_run(runs):
    help_ = runs["help"]
    assert help_.returncode == 0, help_.stderr
    assert help_.stdout.startswith("usage: attnjax-train ")
    assert "train_toy.py" not in help_.stdout
    assert "copy, copy_decoder_only" in help_.stdout   # the shipped configs, by name


def test_a_shipped_config_trains_by_name_from_any_directory(runs):
    workdir = runs["workdir"]
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    assert (config["task"]["name"], config["model"]["kind"]) == ("copy", "decoder_only")
    for name in ("samples.txt", "attention.png", "curves.png"):
        assert (workdir / name).stat().st_size > 0, name
    assert "held-out exact match" in runs["train"].stdout


def test_a_mesh_of_more_devices_than_there_are_says_how_to_emulate_them(runs):
    _one_line_error(runs["mesh"], "error: the mesh {'data': 4} needs 4 devices; there are 1 "
                                  "(on a CPU, emulate them: set XLA_FLAGS="
                                  "--xla_force_host_platform_device_count=4 before")


def test_more_steps_continue_a_finished_run(runs):
    more, workdir = runs["more"], runs["workdir"]
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resuming run from step 4 of 8" in more.stdout
    assert yaml.safe_load((workdir / "config.yaml").read_text())["steps"] == 8
    logs = [r for r in _metrics(workdir) if "loss" in r]
    assert [r["step"] for r in logs] == [2, 4, 6, 8]
    evals = [r["step"] for r in _metrics(workdir) if "eval_exact_match" in r]
    assert evals == [4, 8]
    assert (workdir / "checkpoints" / "8").is_dir()
    # the schedule of the new steps from the step resumed (README: Training longer)
    from attnjax.toy.config import load_config
    from attnjax.toy.train import learning_rate_schedule

    config = load_config(workdir / "config.yaml")
    for record in logs[2:]:   # the rate of step s is the schedule's at s - 1
        expected = float(learning_rate_schedule(config.optim, 8)(record["step"] - 1))
        assert record["learning_rate"] == pytest.approx(expected, rel=1e-5)
    first = float(learning_rate_schedule(config.optim, 4)(logs[1]["step"] - 1))
    assert logs[1]["learning_rate"] == pytest.approx(first, rel=1e-5)


def _events(workdir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of the TensorBoard event files in workdir (the last value of a
    step wins, as TensorBoard shows it)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for path in sorted(workdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):   # TFRecords: length, its crc, the event, its crc
            length, = struct.unpack("<Q", data[at: at + 8])
            event = event_pb2.Event.FromString(data[at + 12: at + 12 + length])
            at += 16 + length
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_tensorboard_events_hold_the_metrics_beside_metrics_jsonl(runs):
    workdir = runs["workdir"]
    scalars = _events(workdir)
    records = _metrics(workdir)
    for key, tag in (("loss", "train/loss"), ("learning_rate", "train/learning_rate"),
                     ("accuracy", "train/accuracy"), ("eval_exact_match", "eval/exact_match"),
                     ("eval_token_accuracy", "eval/token_accuracy")):
        expected = {r["step"]: r[key] for r in records if key in r}
        assert sorted(scalars[tag]) == sorted(expected), tag
        for step, value in expected.items():
            assert scalars[tag][step] == pytest.approx(value, rel=1e-6), (tag, step)
