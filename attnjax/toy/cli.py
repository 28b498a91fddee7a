"""`train_toy.py` / `attnjax-train`: train a toy task, resumably.

    python train_toy.py                                  # configs/copy.yaml -> runs/copy
    python train_toy.py --config configs/dates.yaml --set optim.learning_rate=1e-3
    python train_toy.py --set model.kind=decoder_only --set data.pack=true
    python train_toy.py --mesh data=2,model=2            # 4 devices: data and heads split
    python train_toy.py --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 0

Rerunning the same command in the same workdir resumes from the latest checkpoint and
ends with the metrics an uninterrupted run has. Exit status: 0 done, 1 the loss became
NaN/inf, 2 a bad config or command line, 130 interrupted (after saving a checkpoint).
"""

import argparse
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils

from attnjax.nn import DecoderOnly, attention_maps
from attnjax.parallel import mesh as mesh_lib
from attnjax.toy import make_task
from attnjax.toy import train as training
from attnjax.toy.checkpoints import Checkpoints
from attnjax.toy.config import Config, ConfigError, dump_config, load_config
from attnjax.toy.report import MetricsLog, Progress, plot_attention, plot_curves, write_samples
from attnjax.toy.sequences import DecoderOnlyFormat
from attnjax.toy.tasks import BOS, EOS

DEFAULT_CONFIG = Path("configs/copy.yaml")


class TrainingDiverged(RuntimeError):
    """The loss stopped being finite; the last good checkpoint is kept."""


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _check_workdir_config(workdir: Path, config: Config) -> None:
    """A workdir with checkpoints belongs to one config; resuming with another is an error.
    A key the saved config lacks (written before the key existed) has its default."""
    saved_path = workdir / "config.yaml"
    if not saved_path.exists() or not (workdir / "checkpoints").exists():
        return
    saved = _flatten(yaml.safe_load(saved_path.read_text()) or {})
    current = _flatten(dataclasses.asdict(config))
    default = _flatten(dataclasses.asdict(Config()))
    differ = sorted(k for k in saved.keys() | current.keys()
                    if saved.get(k, default.get(k)) != current.get(k))
    if differ:
        raise ConfigError(f"{workdir} holds a run with another config (it differs in "
                          f"{', '.join(differ)}); use another --workdir or delete that one")


class _Window:
    """Per-step metrics since the last log line: device values until fetched, then floats."""

    def __init__(self, fetched: list[dict]):
        self.fetched, self.pending = list(fetched), []
        self.start = time.perf_counter()

    def add(self, metrics) -> None:
        self.pending.append(metrics)

    def fetch(self) -> list[dict]:
        for metrics in jax.device_get(self.pending):
            self.fetched.append({k: float(v) for k, v in metrics.items()})
        self.pending = []
        return self.fetched

    def close(self, step: int) -> dict:
        """The log record of the window ending at step; NaN/inf raises."""
        steps = self.fetch()
        bad = [i for i, m in enumerate(steps) if not math.isfinite(m["loss"])]
        if bad:
            raise TrainingDiverged(f"the loss is {steps[bad[0]]['loss']} at step "
                                   f"{step - len(steps) + bad[0] + 1}")
        elapsed = time.perf_counter() - self.start
        record = {"step": step,
                  "loss": float(np.mean([m["loss"] for m in steps])),
                  "accuracy": float(np.mean([m["accuracy"] for m in steps])),
                  "learning_rate": steps[-1]["learning_rate"],
                  "tokens_per_s": sum(m["tokens"] for m in steps) / max(elapsed, 1e-9)}
        self.fetched = []
        self.start = time.perf_counter()
        return record


class _StopRequests:
    """Turns SIGINT/SIGTERM into a request the loop honours after the current step (it
    saves a checkpoint first); a second signal interrupts at once."""

    def __enter__(self):
        self.requested = False
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._request)
        return self

    def _request(self, sig, frame):
        self.requested = True
        signal.signal(sig, self._previous[sig])

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _write_atomically(path: Path, text: str) -> None:
    """Readers (other processes) see the old file or the new one, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _evaluate(model, params, task, eval_batch, config, step: int, mesh):
    start = time.perf_counter()
    predictions = training.predict(model, task, params, eval_batch, config.eval_batch_size, mesh)
    scores = training.accuracies(predictions, eval_batch.tgt_out)
    record = {"step": step, "eval_token_accuracy": scores["token_accuracy"],
              "eval_exact_match": scores["exact_match"], "eval_s": time.perf_counter() - start}
    return record, predictions


def _plot_attention(path: Path, model, params, task, eval_batch, predictions) -> None:
    """attention.png for the first held-out example, decoding its own prediction.
    params must be whole on this host (`process_allgather`)."""
    length = int(eval_batch.src_lengths[0])
    predicted = list(predictions[0])
    predicted = predicted[: predicted.index(EOS) + 1] if EOS in predicted else predicted
    tgt_in = np.array([[BOS] + predicted[:-1]], np.int32)
    if isinstance(model, DecoderOnly):
        # one sequence: source, separator and the prediction but its last token
        layout = DecoderOnlyFormat(task)
        tokens = np.concatenate([layout.src_ids[eval_batch.src[:1, :length]], tgt_in], axis=1)
        _, state = model.apply({"params": params}, tokens, sow_weights=True,
                               mutable=["intermediates"])
        src_tokens = tgt_tokens = [layout.vocab.token(int(t)) for t in tokens[0]]
    else:
        _, state = model.apply({"params": params}, eval_batch.src[:1, :length], tgt_in,
                               eval_batch.src_lengths[:1], sow_weights=True,
                               mutable=["intermediates"])
        src_tokens = [task.src_vocab.token(int(t)) for t in eval_batch.src[0, :length]]
        tgt_tokens = [task.tgt_vocab.token(int(t)) for t in tgt_in[0]]
    plot_attention(path, attention_maps(state["intermediates"]), src_tokens, tgt_tokens)


def run(config: Config, workdir: Path, *, mesh=None, interactive: bool | None = None) -> dict:
    """Trains (or resumes) a run in workdir and writes its outputs; returns the summary.

    mesh: a ("data", "model") mesh (`attnjax.parallel.mesh.make_mesh`); default every
    device on "data". With several processes, all run this; process 0 writes the files
    and shows progress, and all write the checkpoints together.
    """
    began = time.perf_counter()
    workdir = Path(workdir)
    mesh = mesh_lib.make_mesh() if mesh is None else mesh
    if config.batch_size % mesh.shape["data"]:
        raise ConfigError(f"batch_size={config.batch_size} must be divisible by the mesh's "
                          f"data axis ({mesh.shape['data']} devices)")
    primary = jax.process_index() == 0
    _check_workdir_config(workdir, config)
    workdir.mkdir(parents=True, exist_ok=True)
    if primary:
        _write_atomically(workdir / "config.yaml", dump_config(config))

    task = make_task(config.task)
    model = training.make_model(config, task)
    output_vocab = DecoderOnlyFormat(task).vocab if isinstance(model, DecoderOnly) else None
    optimizer = training.make_optimizer(config.optim, config.steps)
    try:
        state = training.init_state(model, optimizer, task, config.seed, mesh)
    except ValueError as e:  # a model that the mesh cannot split
        raise ConfigError(str(e)) from None
    train_step = training.make_train_step(model, optimizer, config.optim, config.steps,
                                          config.seed, state, mesh)
    eval_batch = training.eval_set(task, config)

    checkpoints = Checkpoints(workdir / "checkpoints", config.keep_checkpoints)
    restored = checkpoints.restore_latest(state)
    start, saved = (0, {}) if restored is None else (restored[0], restored[2])
    if restored is not None:
        state = restored[1]
    metrics = MetricsLog(workdir / "metrics.jsonl", start, enabled=primary)
    window = _Window(saved.get("window", []))
    best = saved.get("best", {"exact_match": -1.0, "step": None})
    progress = Progress(config.steps, start, interactive, enabled=primary)
    if start:
        progress.message(f"resuming {workdir} from step {start}")

    eval_record, predictions = None, None
    try:
        with _StopRequests() as stop:
            for step in range(start + 1, config.steps + 1):
                state, step_metrics = train_step(
                    state, training.train_batch(task, config, step - 1, mesh))
                window.add(step_metrics)
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
                    if eval_record["eval_exact_match"] > best["exact_match"]:
                        best = {"exact_match": eval_record["eval_exact_match"], "step": step}
                if evaluate or step % config.checkpoint_every == 0:
                    checkpoints.save(step, state, {"window": [], "best": best},
                                     eval_record["eval_exact_match"] if evaluate else None)
                    window.start = time.perf_counter()
                elif stop.requested:
                    checkpoints.save(step, state, {"window": window.fetch(), "best": best})
                if stop.requested:
                    raise KeyboardInterrupt
    except TrainingDiverged as e:
        latest = checkpoints.latest_step()
        kept = f"step {latest} in {workdir / 'checkpoints'}" if latest else "none yet"
        raise TrainingDiverged(f"{e}; training stopped. Last good checkpoint: {kept}") from None
    finally:
        checkpoints.close()
        progress.close()
        metrics.close()

    if eval_record is None:  # the run had already finished: evaluate for the summary
        eval_record, predictions = _evaluate(model, state.params, task, eval_batch, config,
                                             config.steps, mesh)
    params = multihost_utils.process_allgather(state.params, tiled=True)  # a collective
    if primary:
        write_samples(workdir / "samples.txt", task, eval_batch, predictions,
                      vocab=output_vocab)
        plot_curves(workdir / "curves.png", metrics.records)
        _plot_attention(workdir / "attention.png", model, params, task, eval_batch, predictions)
    return {"task": config.task.name, "steps": config.steps,
            "exact_match": eval_record["eval_exact_match"],
            "token_accuracy": eval_record["eval_token_accuracy"],
            "eval_size": len(eval_batch.src), "best": best,
            "seconds": time.perf_counter() - began, "workdir": str(workdir)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_toy.py", description="Train a Transformer on a toy task (copy, reverse, "
        "sort, dates); rerun the same command to resume.")
    parser.add_argument("--config", type=Path, default=None,
                        help=f"YAML config (default {DEFAULT_CONFIG})")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY.SUB=VALUE", help="override a config value (repeatable)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where outputs and checkpoints go (default runs/<task>)")
    parser.add_argument("--seed", type=int, default=None, help="overrides the config's seed")
    parser.add_argument("--mesh", default=None, metavar="AXIS=SIZE,...",
                        help="device mesh over data and model, e.g. data=2,model=2 (default: "
                        "every device on data); results match a one-device run")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="several processes: process 0's address (jax.distributed)")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    return parser


def _initialize_distributed(args) -> None:
    """jax.distributed for several processes (CPU collectives over gloo); also when
    only JAX's own environment variables name the coordinator."""
    given = [args.coordinator, args.num_processes, args.process_id]
    if all(x is None for x in given) and "JAX_COORDINATOR_ADDRESS" not in os.environ:
        return
    if any(x is None for x in given) and not all(x is None for x in given):
        raise ConfigError("--coordinator, --num-processes and --process-id go together")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def _default_config() -> Path:
    """configs/copy.yaml here, or beside the package in a source checkout."""
    if DEFAULT_CONFIG.exists():
        return DEFAULT_CONFIG
    return Path(__file__).resolve().parents[2] / DEFAULT_CONFIG


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    overrides = args.overrides + ([f"seed={args.seed}"] if args.seed is not None else [])
    try:
        config = load_config(args.config or _default_config(), overrides)
        workdir = args.workdir or Path("runs") / config.task.name
        _initialize_distributed(args)
        try:
            mesh = mesh_lib.make_mesh(None if args.mesh is None else
                                      mesh_lib.parse_mesh(args.mesh))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        summary = run(config, workdir, mesh=mesh)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; the last step is checkpointed: rerun the same command to resume",
              file=sys.stderr)
        return 130
    if jax.process_index():
        return 0
    print(f"{summary['task']}: held-out exact match {summary['exact_match']:.2%} and token "
          f"accuracy {summary['token_accuracy']:.2%} on {summary['eval_size']} sequences after "
          f"{summary['steps']} steps ({summary['seconds']:.1f} s); best exact match "
          f"{summary['best']['exact_match']:.2%} at step {summary['best']['step']}. Outputs in "
          f"{summary['workdir']}/: config.yaml, metrics.jsonl, checkpoints/, samples.txt, "
          f"attention.png, curves.png")
    return 0
