"""The training configuration: frozen dataclasses read from YAML, with dotted overrides.

A config file has the sections of `Config` (task, model, data, optim) and its top-level
fields; `load_config(path, overrides)` reads it with yaml's safe loader (a key given
twice is refused), applies `key.sub=value` overrides, and checks every key, type and
range before anything is built from it. Any mistake is a `ConfigError` whose one-line
message names the key, the value and what is allowed.
"""

import dataclasses
import math
import numbers
import reprlib
import types
import typing
from pathlib import Path

import yaml

from attnjax.nn.models import BlockConfig
from attnjax.toy.dates import DatesTask
from attnjax.toy.tasks import MAX_SYMBOLS

TASKS = ("copy", "reverse", "sort", "dates")
SCHEDULES = ("cosine", "inverse_sqrt")
KINDS = ("encoder_decoder", "decoder_only")
APIS = ("linen", "nnx")


# The step counter, the seeds of the data streams and `jax.random.key` are 32-bit.
INT32_MAX = 2**31 - 1


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message is one line."""


def _check_range(key: str, value, low, high, *, low_open: bool = False,
                 high_open: bool = False) -> None:
    """value in the interval [low, high] (open ends as asked; None: unbounded); a NaN or
    an infinite float is never allowed."""
    outside = isinstance(value, float) and not math.isfinite(value)
    if low is not None:
        outside |= value <= low if low_open else value < low
    if high is not None:
        outside |= value >= high if high_open else value > high
    if outside:
        def bound(x, unbounded):
            return unbounded if x is None else f"{x:g}" if isinstance(x, float) else str(x)

        interval = (f"{'(' if low_open or low is None else '['}{bound(low, '-inf')}, "
                    f"{bound(high, 'inf')}{')' if high_open or high is None else ']'}")
        raise ConfigError(f"{key} must lie in {interval}; got {value!r}")


def _check_type(value, kind, key: str):
    """`value` as the field type `kind` (int, float, bool, str or an optional of one)."""
    allowed = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    if value is None and type(None) in allowed:
        return None
    for t in allowed:
        if t is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:   # an int of 400 digits
                raise ConfigError(f"{key} must be a float within float64's range; got an "
                                  f"integer of {len(str(abs(value)))} digits") from None
        if t is float and isinstance(value, str):
            try:  # YAML 1.1 reads 1e-3 (no dot) as a string
                return float(value)
            except ValueError:
                pass
        if t is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)   # numpy's ints too
        if t in (bool, str) and isinstance(value, t):
            return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ConfigError(f"{key} must be {names}; got {value!r}")


def _check_fields(config, prefix: str) -> None:
    """Every field's type, for a config built in Python as for one read from a file
    (`_build`): an int where a float is asked becomes that float."""
    for field in dataclasses.fields(config):
        value, key = getattr(config, field.name), prefix + field.name
        if dataclasses.is_dataclass(field.type):
            if not isinstance(value, field.type):
                raise ConfigError(f"{key} must be a {field.type.__name__}; got "
                                  f"{reprlib.repr(value)}")
        else:
            object.__setattr__(config, field.name, _check_type(value, field.type, key))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Which task, and for copy/reverse/sort the symbols and the source lengths."""

    name: str = "copy"
    num_symbols: int = 10
    min_len: int = 1
    max_len: int = 16
    eval_size: int = 2000

    def __post_init__(self):
        _check_fields(self, "task.")
        if self.name not in TASKS:
            raise ConfigError(f"task.name must be one of {TASKS}; got {self.name!r}")
        _check_range("task.num_symbols", self.num_symbols, 2, MAX_SYMBOLS)
        if not 1 <= self.min_len <= self.max_len:
            raise ConfigError(f"task needs 1 <= min_len <= max_len; got min_len="
                              f"{self.min_len}, max_len={self.max_len}")
        _check_range("task.eval_size", self.eval_size, 1, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(BlockConfig):
    """The model's kind and shape; vocabularies come from the task.

    kind "encoder_decoder": a `Transformer` with num_encoder_layers and
    num_decoder_layers. kind "decoder_only": a `DecoderOnly` whose num_decoder_layers
    layers read source, separator and target as one causal sequence (num_encoder_layers
    unused: any int >= 0). api "linen" trains the `attnjax.nn` model, "nnx" its `attnjax.nnx`
    counterpart on the same parameters (drawn by the linen model's init, so a seed gives
    the same run in either API).
    """

    kind: str = "encoder_decoder"
    api: str = "linen"
    dtype: str = "float32"   # a name in a config file
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    max_len: int = 64

    def _unused_fields(self) -> tuple[str, ...]:
        return ("num_encoder_layers",) if self.kind == "decoder_only" else ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """How examples fill the rows of a training batch (evaluation is never packed).

    pack: several examples per row, each seeing only itself (segment ids) with its
    positions restarting at 0; decoder-only models only. packed_len: the row length
    when packing; null is the longest example, so that a packed row costs what an
    unpacked one does and holds more examples.
    """

    pack: bool = False
    packed_len: int | None = None

    def __post_init__(self):
        _check_fields(self, "data.")
        if self.packed_len is not None:
            _check_range("data.packed_len", self.packed_len, 1, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup, then cosine decay or the paper's inverse square root."""

    learning_rate: float = 1e-3
    warmup_steps: int = 100
    schedule: str = "cosine"
    end_learning_rate: float = 1e-5
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.98
    clip_norm: float = 1.0
    label_smoothing: float = 0.1

    def __post_init__(self):
        _check_fields(self, "optim.")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule must be one of {SCHEDULES}; got "
                              f"{self.schedule!r}")
        _check_range("optim.learning_rate", self.learning_rate, 0.0, None, low_open=True)
        _check_range("optim.warmup_steps", self.warmup_steps, 0, INT32_MAX)
        _check_range("optim.end_learning_rate", self.end_learning_rate, 0.0, None)
        _check_range("optim.weight_decay", self.weight_decay, 0.0, None)
        # Adam's moment decays: 1 would never forget, and beyond it the moments diverge.
        _check_range("optim.b1", self.b1, 0.0, 1.0, high_open=True)
        _check_range("optim.b2", self.b2, 0.0, 1.0, high_open=True)
        _check_range("optim.clip_norm", self.clip_norm, 0.0, None, low_open=True)
        _check_range("optim.label_smoothing", self.label_smoothing, 0.0, 1.0, high_open=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Everything a run needs; `config.yaml` in the workdir is this, resolved."""

    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    steps: int = 1000
    batch_size: int = 128
    log_every: int = 50
    eval_every: int = 500
    checkpoint_every: int = 250
    keep_checkpoints: int = 3
    eval_batch_size: int = 1000
    seed: int = 0

    def __post_init__(self):
        _check_fields(self, "")
        for name in ("steps", "batch_size", "log_every", "eval_every", "checkpoint_every",
                     "keep_checkpoints", "eval_batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive; got {getattr(self, name)}")
            _check_range(name, getattr(self, name), 1, INT32_MAX)
        _check_range("seed", self.seed, 0, INT32_MAX)
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) % self.log_every:
                raise ConfigError(f"{name} must be a multiple of log_every={self.log_every} "
                                  f"(metrics are logged over whole windows); got "
                                  f"{getattr(self, name)}")
        if self.model.kind not in KINDS:
            raise ConfigError(f"model.kind must be one of {KINDS}; got {self.model.kind!r}")
        if self.model.api not in APIS:
            raise ConfigError(f"model.api must be one of {APIS}; got {self.model.api!r}")
        src_len, tgt_len = task_lengths(self.task)
        if self.model.kind == "decoder_only":
            longest, what = src_len + tgt_len + 1, "of source, separator and target"
        else:
            longest, what = max(src_len, tgt_len + 1), "with bos/eos"
        if self.model.max_len < longest:
            given = (f"the dates task's sources of {src_len} and targets of {tgt_len} symbols"
                     if self.task.name == "dates" else f"task.max_len={self.task.max_len}")
            raise ConfigError(f"model.max_len={self.model.max_len} must cover the task's longest "
                              f"sequence ({longest} tokens {what}); got {given}")
        if self.data.pack and self.model.kind != "decoder_only":
            raise ConfigError(f"data.pack=true needs model.kind=decoder_only (the encoder–decoder "
                              f"trains on unpacked rows); got model.kind={self.model.kind}")
        packed_len = self.data.packed_len
        if packed_len is not None and not self.data.pack:
            raise ConfigError(f"data.packed_len={packed_len} applies only with data.pack=true "
                              f"(null when not packing)")
        if packed_len is not None and packed_len < src_len + tgt_len + 1:
            raise ConfigError(f"data.packed_len={packed_len} must hold the task's longest example "
                              f"({src_len + tgt_len + 1} tokens: source, separator and target)")


def task_lengths(task: TaskConfig) -> tuple[int, int]:
    """The longest source and target of a task, in symbols (without bos/eos)."""
    if task.name == "dates":
        return DatesTask.src_len, DatesTask.tgt_len
    return task.max_len, task.max_len


def _build(cls, data, prefix: str = ""):
    """`cls(**data)`, recursing into nested dataclasses, with every key and type checked."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'} must be a mapping; got "
                          f"{reprlib.repr(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]}; valid keys"
                          f"{' of ' + prefix.rstrip('.') if prefix else ''} are "
                          f"{', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        kind = fields[name].type
        if dataclasses.is_dataclass(kind):
            kwargs[name] = _build(kind, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _check_type(value, kind, prefix + name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from None


class _Loader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping: yaml keeps the
    last silently, so `steps: 500` above a forgotten `steps: 50` would train 50 steps.
    (A key merged in with `<<` may be given again: that overrides it, as YAML means.)"""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:   # unhashable: yaml's own error says so below
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"found the key {key!r} twice in one mapping "
                        f"(line {key_node.start_mark.line + 1})", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(text: str):
    return yaml.load(text, Loader=_Loader)


def apply_override(data: dict, override: str) -> None:
    """Sets `key.sub=value` in the nested dict `data`; the value is read as YAML."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key.sub=value; got {override!r}")
    try:
        value = _read_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {override!r}: the value is not YAML ({e.problem})") from None
    except (ValueError, OverflowError) as e:   # YAML's own, that its constructors refuse
        raise ConfigError(f"--set {override!r}: the value cannot be read ({e})") from None
    *parents, leaf = key.strip().split(".")
    if not all(part.strip() for part in (*parents, leaf)):
        raise ConfigError(f"--set {override!r}: the key {key.strip()!r} has an empty part "
                          f"(expected key.sub=value)")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {override!r}: {part} is not a section")
    node[leaf] = value


# The configs shipped with the package, by name: `--config dates` is configs/dates.yaml.
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"
DEFAULT_CONFIG = "copy"


def shipped_configs() -> list[str]:
    """The names of the configs shipped with attnjax (`copy`, `dates`, ...)."""
    return sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.yaml"))


def resolve_config(name_or_path: str | Path) -> Path:
    """The config file `--config` names: an existing path, else a shipped config's name
    (with or without `.yaml`). Neither is a `ConfigError` listing the shipped names."""
    path = Path(name_or_path)
    try:
        # a directory is no config: `--workdir dates --config dates` resumes from inside
        # the directory that holds the workdir named dates
        found, directory = path.exists(), path.is_dir()
    except OSError as e:  # a name too long for the filesystem, say
        raise ConfigError(f"cannot read config {name_or_path}: {e.strerror}") from None
    if found and not directory:
        return path
    stem = path.name.removesuffix(".yaml")
    if path.parent == Path() and stem in shipped_configs():
        return SHIPPED_CONFIGS / f"{stem}.yaml"
    if directory:
        raise ConfigError(f"cannot read config {name_or_path}: a directory, not a YAML file")
    shipped = ", ".join(shipped_configs())
    hint = (f"; the shipped {stem!r} is --config {stem}" if stem in shipped_configs() else "")
    raise ConfigError(f"cannot read config {name_or_path}: no such file, nor a shipped config "
                      f"of that name (shipped: {shipped}){hint}")


# The largest config file read (the shipped ones are about 2 KiB; YAML reads a few MB
# a second): larger is a mistake, a device or an endless pipe, refused before it is read.
MAX_CONFIG_BYTES = 2**20


def load_config(path: str | Path | None = None, overrides=()) -> Config:
    """Reads a YAML config (defaults when path is None) and applies the overrides.

    path: a YAML file, or the name of a shipped config (`resolve_config`)."""
    data = {}
    if path is not None:
        path = resolve_config(path)
        try:
            with open(path, "rb") as file:   # at most one byte past the limit (/dev/zero)
                raw = file.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config {path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB: "
                              f"a config is a small YAML mapping of sections and keys")
        try:
            data = _read_yaml(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config {path} is not UTF-8 text: byte {e.object[e.start]:#04x} "
                              f"at offset {e.start}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config {path} is not valid YAML: "
                              f"{str(e).splitlines()[0]}") from None
        except RecursionError:
            raise ConfigError(f"config {path} is nested too deeply to read") from None
        except (ValueError, OverflowError) as e:   # a date of 2021-13-01, `!!int 1.5`
            raise ConfigError(f"config {path} holds a value that cannot be read: {e}") from None
        data = {} if data is None else data
        if not isinstance(data, dict):  # overrides need sections to go into
            raise ConfigError(f"the config must be a mapping of sections and keys; got "
                              f"{type(data).__name__} {reprlib.repr(data)} in {path}")
    for override in overrides:
        apply_override(data, override)
    return _build(Config, data)


def dump_config(config: Config) -> str:
    """The resolved config as YAML; `load_config` reads it back to an equal Config."""
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
