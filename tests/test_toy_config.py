"""Configs: the shipped YAML files, overrides, and one-line errors for every mistake."""

import dataclasses
from pathlib import Path

import pytest

from attnjax.toy.config import Config, ConfigError, dump_config, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["copy", "reverse", "sort", "dates"])
def test_shipped_configs_load(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.task.name == name
    assert config.task.eval_size == 2000
    if name != "dates":   # the model must fit the sequences plus bos/eos
        assert config.model.max_len >= config.task.max_len + 1


def test_overrides_and_round_trip(tmp_path):
    config = load_config(CONFIGS / "copy.yaml", ["optim.learning_rate=1e-4", "steps=17",
                                                  "model.num_kv_heads=2", "task.name=sort",
                                                  "model.implementation=null"])
    assert (config.optim.learning_rate, config.steps, config.model.num_kv_heads) == (1e-4, 17, 2)
    assert config.task.name == "sort" and config.model.implementation is None
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
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "copy.yaml", overrides)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


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


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().steps = 3
