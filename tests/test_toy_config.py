"""Configs: the shipped YAML files, overrides, and one-line errors for every mistake."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from attnjax.toy.config import (Config, ConfigError, DataConfig, OptimConfig, TaskConfig,
                                 dump_config, load_config)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["copy", "reverse", "sort", "dates"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.task.name == name
    assert config.task.eval_size == 2000
    if name != "dates":   # the model must fit the sequences plus bos/eos
        assert config.model.max_len >= config.task.max_len + 1


@pytest.mark.parametrize("name, pack", [("copy_decoder_only", False), ("copy_packed", True)])
def test_shipped_decoder_only_configs_load(name, pack):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert (config.task.name, config.model.kind, config.data.pack) == ("copy", "decoder_only",
                                                                       pack)
    assert config.task.eval_size == 2000
    assert config.model.max_len >= 2 * config.task.max_len + 1


def test_a_decoder_only_model_may_say_it_has_no_encoder_layers():
    config = load_config(CONFIGS / "copy_decoder_only.yaml", ["model.num_encoder_layers=0"])
    assert (config.model.kind, config.model.num_encoder_layers) == ("decoder_only", 0)


def test_overrides_and_round_trip(tmp_path):
    config = load_config(CONFIGS / "copy.yaml", ["optim.learning_rate=1e-4", "steps=17",
                                                  "model.num_kv_heads=2", "task.name=sort",
                                                  "model.implementation=null",
                                                  "model.kind=decoder_only", "data.pack=true",
                                                  "data.packed_len=40"])
    assert (config.optim.learning_rate, config.steps, config.model.num_kv_heads) == (1e-4, 17, 2)
    assert config.task.name == "sort" and config.model.implementation is None
    assert (config.model.kind, config.data.pack, config.data.packed_len) == ("decoder_only",
                                                                             True, 40)
    assert isinstance(config.optim.learning_rate, float)
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config
    assert load_config(None) == Config()


@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=1"], "unknown key optim.lr; valid keys of optim are b1, b2, clip_norm, "
                     "end_learning_rate, label_smoothing, learning_rate, schedule, "),
    (["stpes=3"], "unknown key stpes; valid keys are batch_size, checkpoint_every, "),
    (["model.dmodel=3"], "unknown key model.dmodel; valid keys of model are "),
    (["steps=many"], "steps must be int; got 'many'"),
    (["steps=2.5"], "steps must be int; got 2.5"),
    (["model.pre_ln=3"], "model.pre_ln must be bool; got 3"),
    (["optim.learning_rate=fast"], "optim.learning_rate must be float; got 'fast'"),
    (["model.num_kv_heads=two"], "model.num_kv_heads must be int or null; got 'two'"),
    (["task=copy"], "task must be a mapping; got 'copy'"),
    (["steps"], "--set expects key.sub=value; got 'steps'"),
    (["steps=[1"], "--set 'steps=[1': the value is not YAML"),
    (["task.name=rot13"], "task.name must be one of ('copy', 'reverse', 'sort', 'dates'); "
                          "got 'rot13'"),
    (["optim.schedule=linear"], "optim.schedule must be one of ('cosine', 'inverse_sqrt')"),
    (["eval_every=75"], "eval_every must be a multiple of log_every=50"),
    (["batch_size=0"], "batch_size must be positive; got 0"),
    (["model.num_heads=5"], "model: d_model must be divisible by num_heads; got d_model=64, "
                            "num_heads=5"),
    (["model.dropout_rate=1.5"], "model: dropout_rate must lie in [0, 1); got 1.5"),
    (["task.min_len=9", "task.max_len=3"], "task needs 1 <= min_len <= max_len"),
    (["optim.label_smoothing=1.0"], "optim.label_smoothing must lie in [0, 1); got 1.0"),
    (["task.max_len=80"], "model.max_len=64 must cover the task's longest sequence (81 tokens "
                          "with bos/eos); got task.max_len=80"),
    (["model.kind=gpt"], "model.kind must be one of ('encoder_decoder', 'decoder_only'); "
                         "got 'gpt'"),
    (["model.kind=decoder_only", "model.max_len=32"],
     "model.max_len=32 must cover the task's longest sequence (33 tokens of source, separator "
     "and target); got task.max_len=16"),
    (["data.pack=true"], "data.pack=true needs model.kind=decoder_only (the encoder–decoder "
                         "trains on unpacked rows); got model.kind=encoder_decoder"),
    (["model.kind=decoder_only", "data.pack=true", "data.packed_len=32"],
     "data.packed_len=32 must hold the task's longest example (33 tokens: source, separator "
     "and target)"),
    (["data.pack=2"], "data.pack must be bool; got 2"),
    # a row length without packing (was checked against the examples, or ignored)
    (["data.packed_len=40"], "data.packed_len=40 applies only with data.pack=true (null when "
                             "not packing)"),
    (["model.num_encoder_layers=0"], "model: ModelConfig.num_encoder_layers must be a "
                                     "positive int; got 0"),
    (["model.kind=decoder_only", "model.num_encoder_layers=-1"],
     "model: ModelConfig.num_encoder_layers must be an int >= 0 (unused); got -1"),
    (["data.packs=true"], "unknown key data.packs; valid keys of data are pack, packed_len"),
    (["data=true"], "data must be a mapping; got True"),
    # values YAML's constructors refuse, and a float past float64's range
    (["steps=2001-02-30"], "--set 'steps=2001-02-30': the value cannot be read (day is out "
                           "of range for month)"),
    (["steps=!!int 1.5"], "--set 'steps=!!int 1.5': the value cannot be read"),
    (["..steps=3"], "--set '..steps=3': the key '..steps' has an empty part"),
    (["optim.learning_rate=1" + "0" * 400], "optim.learning_rate must be a float within "
                                            "float64's range; got an integer of 401 digits"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "copy.yaml", overrides)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_dates_model_too_short_names_the_dates_lengths():
    """(it named task.max_len, which the dates task does not read)"""
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "dates.yaml", ["model.max_len=12"])
    assert str(error.value) == (
        "model.max_len=12 must cover the task's longest sequence (29 tokens with bos/eos); "
        "got the dates task's sources of 29 and targets of 10 symbols")


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: [copy\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="the config must be a mapping"):
        load_config(listed)
    dated = tmp_path / "dated.yaml"
    dated.write_text("steps: 2021-13-01\n")
    with pytest.raises(ConfigError, match=r"config .*dated.yaml holds a value that cannot be "
                                          r"read: month must be in 1..12"):
        load_config(dated)


def test_a_config_past_a_mib_is_refused_before_it_is_read(tmp_path):
    """A config of 1 MiB (comments padding a mapping) loads; one byte more, or an endless
    device, is refused at once (a 200 MB file had kept the run reading for minutes
    before its first step, and /dev/zero filled the memory)."""
    rng = np.random.default_rng(7)
    steps = int(rng.integers(10, 1000))
    body = f"steps: {steps}\n".encode()
    padding = b"# " + b"x" * (2**20 - len(body) - 3) + b"\n"
    exact = tmp_path / "exact.yaml"
    exact.write_bytes(padding + body)
    assert exact.stat().st_size == 2**20 and load_config(exact).steps == steps
    larger = tmp_path / "larger.yaml"
    larger.write_bytes(b"#" + padding + body)
    for path in (larger, Path("/dev/zero")):
        with pytest.raises(ConfigError, match=rf"^config {path} is larger than 1 MiB: a "
                                              rf"config is a small YAML mapping"):
            load_config(path)


def test_a_key_given_twice_is_refused_and_a_merged_key_may_be_overridden(tmp_path):
    """yaml keeps the last of two equal keys silently (`steps: 500` under a forgotten
    `steps: 50`); an anchor's key merged in with `<<` and given again is YAML's override."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("task:\n  max_len: 8\n  min_len: 2\n  max_len: 12\n")
    with pytest.raises(ConfigError, match=r"config .*twice.yaml is not valid YAML: found "
                                          r"the key 'max_len' twice in one mapping \(line 4\)"):
        load_config(twice)
    with pytest.raises(ConfigError, match=r"--set 'optim=\{b1: 0.5, b1: 0.6\}': the value is "
                                          r"not YAML \(found the key 'b1' twice"):
        load_config(None, ["optim={b1: 0.5, b1: 0.6}"])
    merged = tmp_path / "merged.yaml"
    merged.write_text("task: {<<: {min_len: 2, max_len: 5}, max_len: 7}\n")
    config = load_config(merged)
    assert (config.task.min_len, config.task.max_len) == (2, 7)


def test_a_directory_is_no_config(tmp_path, monkeypatch):
    """A directory named as a shipped config (the workdir of `--workdir dates --config
    dates`, rerun to resume) leaves the shipped config its name; another directory is a
    one-line error."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dates").mkdir()
    assert load_config("dates") == load_config(CONFIGS / "dates.yaml")
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match=r"^cannot read config runs: a directory, not a "
                                          r"YAML file$"):
        load_config("runs")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().steps = 3


@pytest.mark.parametrize("build, message", [
    (lambda: TaskConfig(num_symbols=2.5), r"^task.num_symbols must be int; got 2.5$"),
    (lambda: Config(steps="5"), r"^steps must be int; got '5'$"),
    (lambda: DataConfig(pack=1), r"^data.pack must be bool; got 1$"),
    (lambda: OptimConfig(schedule=None), r"^optim.schedule must be str; got None$"),
    (lambda: Config(task={"name": "copy"}), r"^task must be a TaskConfig; got \{'name': 'copy'\}$"),
])
def test_a_config_built_in_python_has_its_types_checked_as_a_file_s(build, message,
                                                                   own_checks_only):
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_config_built_in_python_takes_numbers_as_a_file_gives_them(own_checks_only):
    config = Config(task=TaskConfig(num_symbols=np.int64(5)),
                    optim=OptimConfig(learning_rate=1, b1=np.float32(0.5)))
    assert type(config.task.num_symbols) is int and config.task.num_symbols == 5
    assert type(config.optim.learning_rate) is float and config.optim.learning_rate == 1.0
    assert type(config.optim.b1) is float and config.optim.b1 == 0.5
    # the same config as the file's
    assert config == load_config(None, ["task.num_symbols=5", "optim.learning_rate=1",
                                        "optim.b1=0.5"])
