"""Training end to end on a tiny config: the loss falls, outputs are written, runs are
reproducible, NaN stops the run, and the command line exits 2 on a bad config. (Killed
and interrupted command-line runs, and their reruns: test_faults.py.)"""

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from attnjax.toy import cli, make_task
from attnjax.toy import train as training
from attnjax.toy.checkpoints import Checkpoints
from attnjax.toy.config import dump_config, load_config
from attnjax.toy.report import TIMING_KEYS, Progress
from tests import children
from tests.checks import lowerings

ROOT = Path(__file__).resolve().parents[1]
TINY = ["task.num_symbols=5", "task.min_len=1", "task.max_len=6", "task.eval_size=200",
        "model.d_model=32", "model.num_heads=2", "model.d_ff=64", "model.num_encoder_layers=1",
        "model.num_decoder_layers=1", "model.max_len=16", "optim.warmup_steps=10",
        "steps=60", "batch_size=32", "log_every=10", "eval_every=30", "checkpoint_every=10",
        "eval_batch_size=100"]


def tiny(*overrides):
    return load_config(ROOT / "configs" / "copy.yaml", TINY + list(overrides))


def _records(workdir: Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def test_tiny_run_learns_and_writes_every_output(tmp_path, float32):
    config = tiny()
    summary = cli.run(config, tmp_path / "run", mesh=children.one_device_mesh(),
                      interactive=False)
    workdir = tmp_path / "run"
    records = _records(workdir)
    logs = [r for r in records if "loss" in r]
    evals = [r for r in records if any("exact" in k for k in r)]
    assert [r["step"] for r in logs] == list(range(10, 61, 10))
    assert [r["step"] for r in evals] == [30, 60]
    assert logs[-1]["loss"] < 0.6 * logs[0]["loss"]
    assert logs[-1]["accuracy"] > logs[0]["accuracy"]
    assert summary["exact_match"] == evals[-1]["eval_exact_match"]
    assert 0.0 <= summary["exact_match"] <= summary["token_accuracy"] <= 1.0
    assert load_config(workdir / "config.yaml") == config
    samples = (workdir / "samples.txt").read_text()
    assert samples.count("source:") == 20 and "prediction:" in samples and "target:" in samples
    for png in ("attention.png", "curves.png"):
        assert (workdir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-3:] == [40, 50, 60]
    best = summary["best"]["step"]
    assert best in steps   # the best checkpoint is kept besides the latest three


def test_the_best_checkpoint_outlives_a_resume(tmp_path):
    """The best evaluated step is kept beside the latest, also by the process that
    resumes a run (orbax had written no step's metrics: a new manager knew none and
    deleted the best as an old step)."""
    state = {"w": np.random.default_rng(3).standard_normal((3, 2)).astype(np.float32)}
    first = Checkpoints(tmp_path / "checkpoints", keep=1)
    for step, exact_match in ((10, 0.5), (20, 0.25), (30, None)):
        first.save(step, state, {"step": step}, exact_match)
    first.close()
    resumed = Checkpoints(tmp_path / "checkpoints", keep=1)   # as a new process
    assert resumed.restore_latest(state)[0] == 30
    for step, exact_match in ((40, 0.375), (50, None)):
        resumed.save(step, state, {"step": step}, exact_match)
    resumed.close()
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()
                  if p.name.isdigit()) == [10, 50]


def test_the_summary_names_the_best_step_the_checkpoints_keep(tmp_path):
    """Among steps of equal exact match the checkpoints keep the newest, and the run's
    summary names that one (it named the earliest, which was deleted)."""
    rng = np.random.default_rng(5)
    scores = [float(s) for s in rng.choice([0.25, 0.5, 0.75], size=6)]
    scores[rng.integers(1, 6)] = max(scores[:-1]) if rng.random() < 0.5 else scores[0]
    scores.append(max(scores))   # the last ties the best seen
    state = {"w": rng.standard_normal((3, 2)).astype(np.float32)}
    checkpoints = Checkpoints(tmp_path / "checkpoints", keep=1)
    best = {"exact_match": -1.0, "step": None}
    for i, exact_match in enumerate(scores):
        step = 10 * (i + 1)
        checkpoints.save(step, state, {"step": step}, exact_match)
        best = cli._best(best, step, exact_match)
        kept = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
        assert best["step"] in kept and best["exact_match"] == max(scores[:i + 1])
    checkpoints.close()
    assert best["step"] == 10 * len(scores)


def test_seed_changes_initialisation_and_data(float32):
    """Two seeds give other parameters and data, from one compiled initialisation: the
    seed is the program's argument, so another seed's run finds it compiled (in jax's
    compilation cache, from one run to the next)."""
    a, b = tiny("model.d_model=40"), tiny("model.d_model=40", "seed=1")   # a program of its own
    task = make_task(a.task)
    model = training.make_model(a, task)
    optimizer = training.make_optimizer(a.optim, a.steps)
    mesh = children.one_device_mesh()
    params = [training.init_state(model, optimizer, task, a.seed, mesh).params]
    assert lowerings(lambda: params.append(
        training.init_state(model, optimizer, task, b.seed, mesh).params)) == 0
    assert not np.array_equal(*(p["logits"]["kernel"] for p in params))
    batches = [training.train_batch(task, c, 0, mesh) for c in (a, b)]
    assert not np.array_equal(*(np.asarray(batch.src) for batch in batches))


def test_the_train_step_compiled_alongside_the_initialisation_runs_without_compiling(float32):
    """init_state(..., alongside=...) compiles the train step, given the abstract state,
    while the initialisation compiles: its first call lowers and compiles nothing, and
    the state is the one init_state makes alone, bit for bit."""
    config = tiny("seed=3", "model.d_model=24")   # programs no other test compiles
    task = make_task(config.task)
    model = training.make_model(config, task)
    optimizer = training.make_optimizer(config.optim, config.steps)
    mesh = children.one_device_mesh()
    abstract = training.abstract_state(model, optimizer, task, mesh)
    batch = training.train_batch(task, config, 0, mesh)
    steps = [training.make_train_step(model, optimizer, config.optim, config.steps,
                                      config.seed, abstract, mesh) for _ in range(2)]
    alone = training.init_state(model, optimizer, task, config.seed, mesh)
    together = training.init_state(model, optimizer, task, config.seed, mesh,
                                   alongside=[(steps[0], (abstract, training.abstract_batch(
                                       task, config, mesh)))])
    assert jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), alone) == jax.tree.map(
        lambda a: (a.shape, a.dtype, a.sharding), abstract)
    for a, b in zip(jax.tree.leaves(alone), jax.tree.leaves(together)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert lowerings(lambda: steps[0](together, batch)) == 0
    # the same step made afresh and not compiled beforehand compiles in its first call
    assert lowerings(lambda: steps[1](alone, batch)) == 1


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, float32):
    config = tiny("optim.learning_rate=1e30", "optim.clip_norm=1e30", "optim.warmup_steps=1")
    with pytest.raises(cli.TrainingDiverged, match=r"the loss is (nan|inf) at step \d+; training "
                                                   r"stopped. Last good checkpoint: "):
        cli.run(config, tmp_path / "run", mesh=children.one_device_mesh(),
                interactive=False)
    records = _records(tmp_path / "run")
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)


def test_a_run_that_diverges_after_logging_draws_its_curves(tmp_path, monkeypatch, float32):
    """The loss turns NaN at a random step after some were logged: the run stops naming
    it, and curves.png shows the steps logged before it (drawn as a run ends otherwise,
    so a diverged run had none)."""
    at = int(np.random.default_rng().integers(7, 15))
    add = cli._Window.add
    steps = []

    def add_nan_from(self, metrics):
        steps.append(None)
        add(self, {**metrics, "loss": metrics["loss"] * jnp.nan} if len(steps) >= at
            else metrics)

    monkeypatch.setattr(cli._Window, "add", add_nan_from)
    workdir = tmp_path / "run"
    with pytest.raises(cli.TrainingDiverged, match=rf"the loss is nan at step {at}; training "
                       rf"stopped. Last good checkpoint: step {at - 1 - (at - 1) % 5} .*; "
                       rf"{workdir / 'curves.png'} shows the steps logged before it$"):
        cli.run(tiny("log_every=1", "checkpoint_every=5"), workdir,
                mesh=children.one_device_mesh(), interactive=False)
    assert [r["step"] for r in _records(workdir)] == list(range(1, at))
    assert (workdir / "curves.png").read_bytes().startswith(b"\x89PNG")


# Mistakes found before training starts. A bad config is read in process (main's return
# value and stderr, which train_toy.py exits with); a bad argument (argparse exits) and a
# bad mesh (read after main has set up the compilation cache) by the real command.
BAD_CONFIGS = [
    (["--set", "optim.lr=1"], "error: unknown key optim.lr; valid keys of optim are "),
    (["--config", "configs/none.yaml"], "error: cannot read config configs/none.yaml"),
    (["--set", "steps=-3"], "error: steps must be positive; got -3"),
    (["--set", "data.pack=true"], "error: data.pack=true needs model.kind=decoder_only"),
    (["--coordinator", "127.0.0.1:1"], "error: --coordinator, --num-processes and "
                                       "--process-id go together"),
]
BAD_COMMANDS = [
    (["--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["--mesh", "gpus=2"], "error: --mesh expects axis=size pairs over ('data', 'model', 'seq')"),
    (["--mesh", "data=3"], "error: the mesh {'data': 3} needs 3 devices; there are"),
]


_MALLOC_PROBE = """
import ctypes
from attnjax.toy import cli

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def allocate_and_free():
    # (was the 64 MiB block mapped on its own, did the heap keep it once freed)
    start = libc.mallinfo2()
    block = libc.malloc(64 << 20)
    held = libc.mallinfo2()
    libc.free(block)
    end = libc.mallinfo2()
    return held.hblkhd - start.hblkhd >= 64 << 20, end.fordblks - start.fordblks >= 48 << 20

before = allocate_and_free()
kept = cli.keep_freed_memory()
print(before, kept, allocate_and_free())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
@pytest.mark.parametrize("setting, expected", [(None, "(True, False) True (False, True)"),
                                               ("0", "(True, False) False (True, False)")])
def test_the_command_keeps_the_memory_it_frees(setting, expected):
    """After keep_freed_memory, a 64 MiB block comes from the heap, not mapped on its
    own, and stays in the process once freed; ATTNJAX_KEEP_FREED_MEMORY=0 leaves glibc
    mapping it and giving it back."""
    # glibc's defaults to start from, whatever this process was started with
    env = {k: v for k, v in os.environ.items() if k != "ATTNJAX_KEEP_FREED_MEMORY"
           and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    if setting is not None:
        env["ATTNJAX_KEEP_FREED_MEMORY"] = setting
    result = subprocess.run([sys.executable, "-c", _MALLOC_PROBE], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == expected


def test_without_glibc_the_allocator_is_left_alone(monkeypatch):
    def no_glibc(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.delenv("ATTNJAX_KEEP_FREED_MEMORY", raising=False)
    monkeypatch.setattr(cli.ctypes, "CDLL", no_glibc)
    assert cli.keep_freed_memory() is False


def test_the_command_sets_up_the_allocator(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append("kept"))
    assert cli.main(["--workdir", str(tmp_path / "w"), "--set", "steps=-3"]) == 2
    assert calls == ["kept"]


@pytest.mark.parametrize("args, message", BAD_CONFIGS)
def test_bad_config_exits_2_with_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    assert cli.main(["--workdir", str(tmp_path / "w"), *args]) == 2
    stderr = capsys.readouterr().err
    assert message in stderr and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args, message", BAD_COMMANDS)
def test_cli_bad_command_exits_2_with_one_line(tmp_path, args, message):
    result = subprocess.run([sys.executable, str(ROOT / "train_toy.py"), "--workdir",
                             str(tmp_path / "w"), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    if "argument" not in message:
        assert len(result.stderr.strip().splitlines()) == 1


def test_workdir_of_another_config_is_refused(tmp_path, float32):
    config = tiny("steps=10", "eval_every=10")
    cli.run(config, tmp_path / "run", mesh=children.one_device_mesh(),
            interactive=False)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["steps"] == 10
    with pytest.raises(cli.ConfigError, match="holds a run with another config \\(it differs "
                                              "in optim.learning_rate\\)"):
        cli.run(tiny("steps=10", "eval_every=10", "optim.learning_rate=0.1"), tmp_path / "run",
                mesh=children.one_device_mesh())
    assert dump_config(config) == (tmp_path / "run" / "config.yaml").read_text()


def test_plain_progress_lines(capsys):
    progress = Progress(total=100, initial=0, interactive=False)
    progress.log({"step": 50, "loss": 1.25, "accuracy": 0.5, "learning_rate": 1e-3,
                  "tokens_per_s": 1234.4})
    progress.message("done")
    assert capsys.readouterr().out == ("step 50/100  loss 1.2500  accuracy 0.5000  lr 1.00e-03  "
                                       "1234 tokens/s\ndone\n")


def test_the_finiteness_check_finds_a_nan_or_an_inf_anywhere_in_the_parameters(rng):
    """The check that keeps non-finite parameters out of every checkpoint (compiled with
    XLA's quickest options, which must not change its answer)."""
    keys = jax.random.split(rng, 3)
    tree = {"w": jax.random.normal(keys[0], (7, 5), jax.numpy.float32),
            "b": {"x": jax.random.normal(keys[1], (11,), jax.numpy.float32)}}
    assert bool(training.all_finite(tree))
    at = int(jax.random.randint(keys[2], (), 0, 11))
    for bad in (np.nan, np.inf, -np.inf):
        broken = {"w": tree["w"], "b": {"x": tree["b"]["x"].at[at].set(bad)}}
        assert not bool(training.all_finite(broken)), (bad, at)


@pytest.fixture
def fresh_quick_compilation():
    """training.quick_compilation() decided again in the test, and again after it."""
    training.quick_compilation.cache_clear()
    yield
    training.quick_compilation.cache_clear()


def test_quick_compilation_is_for_a_cpu_alone(monkeypatch, fresh_quick_compilation):
    """XLA's quickest options go to a CPU's compiler only: its GPU backend does not
    support LLVM level 0."""
    on_cpu = training.quick_compilation()   # the suite's CPU
    assert on_cpu["xla_backend_optimization_level"] == 0
    assert on_cpu.items() <= training.QUICK_COMPILATION.items()
    training.quick_compilation.cache_clear()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert training.quick_compilation() == {}


def test_quick_compilation_leaves_out_an_option_xla_does_not_know(monkeypatch,
                                                                   fresh_quick_compilation):
    """XLA refuses a program given a compiler option it does not know (jax 0.11's XLA
    dropped one of QUICK_COMPILATION's, and the training command stopped at its first
    checkpoint): the unknown option is left out, the known ones kept, and the programs
    compiled with them run."""
    known = training.quick_compilation()
    training.quick_compilation.cache_clear()
    made_up = "xla_cpu_attnjax_made_up_option"
    monkeypatch.setattr(training, "QUICK_COMPILATION", {**known, made_up: True})
    with pytest.raises(jax.errors.JaxRuntimeError, match=made_up):
        jax.jit(lambda x: x * 2, compiler_options=training.QUICK_COMPILATION).lower(
            np.float32(1)).compile()
    assert training.quick_compilation() == known
    x = np.random.default_rng().normal(size=(5,)).astype(np.float32)
    check = jax.jit(lambda x: jax.numpy.all(jax.numpy.isfinite(x)),
                    compiler_options=training.quick_compilation())
    assert bool(check(x)) and not bool(check(np.where(np.arange(5) == 2, np.nan, x)))


def test_the_command_line_keeps_compiled_programs_in_the_user_cache(tmp_path, monkeypatch,
                                                                     capsys):
    """Without JAX_COMPILATION_CACHE_DIR, compiled programs go to the user's cache
    directory; with it, to that directory; JAX_ENABLE_COMPILATION_CACHE=false: nowhere."""
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user"))
    try:
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        # programs of 0.1 s or more, in either directory, unless the environment says
        monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        assert cli.use_compilation_cache() == tmp_path / "user" / "attnjax" / "jax"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "user" / "attnjax" / "jax")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.1
        assert (tmp_path / "user" / "attnjax" / "jax").is_dir()
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "chosen"))
        assert cli.use_compilation_cache() == tmp_path / "chosen"
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.1
        monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        cli.use_compilation_cache()
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        jax.config.update("jax_enable_compilation_cache", False)
        assert cli.use_compilation_cache() is None
        # a directory that cannot be written (a read-only mount) turns the cache off,
        # saying so once where it was chosen, not jax's warning at every program
        real_access = os.access
        monkeypatch.setattr(cli.os, "access", lambda path, mode: not str(path).startswith(
            str(tmp_path / "read-only")) and real_access(path, mode))
        for chosen in (True, False):
            jax.config.update("jax_enable_compilation_cache", True)
            if chosen:
                monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "read-only"))
            else:
                monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
                monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "read-only"))
            assert cli.use_compilation_cache() is None
            assert not jax.config.jax_enable_compilation_cache
            said = capsys.readouterr().err
            assert said == (f"warning: JAX_COMPILATION_CACHE_DIR={tmp_path / 'read-only'} "
                            f"cannot be written; programs are compiled anew\n" if chosen else "")
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
