"""What a run shows and leaves behind: progress, metrics.jsonl, samples.txt and plots."""

import json
import os
import sys
from pathlib import Path

import numpy as np

# Keys of a metrics record that measure wall time; everything else is reproducible.
TIMING_KEYS = ("elapsed_s", "tokens_per_s", "eval_s")


class MetricsLog:
    """metrics.jsonl: one JSON object per log or eval step, appended and flushed at once.

    Opening it for a run resumed at `resume_step` drops the records of later steps (written
    after the checkpoint the run resumes from) and a torn last line of a killed process.
    """

    def __init__(self, path: Path, resume_step: int, *, enabled: bool = True):
        self.path = Path(path)
        self.records = []
        self._file = None
        if not enabled:  # another process writes the file
            return
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                if record["step"] > resume_step:
                    break
                self.records.append(record)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class Progress:
    """A tqdm bar with loss, accuracy and tokens/s on a terminal; plain lines otherwise."""

    def __init__(self, total: int, initial: int, interactive: bool | None = None, *,
                 enabled: bool = True):
        self.total, self.enabled = total, enabled
        self.bar = None
        if interactive is None:
            interactive = sys.stdout.isatty()
        if interactive and enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, record: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['accuracy']:.4f}",
                                 tok_s=f"{record['tokens_per_s']:.0f}")
        else:
            self.message(f"step {record['step']}/{self.total}  loss {record['loss']:.4f}  "
                         f"accuracy {record['accuracy']:.4f}  lr {record['learning_rate']:.2e}  "
                         f"{record['tokens_per_s']:.0f} tokens/s")

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def write_samples(path: Path, task, batch, predictions: np.ndarray, count: int = 20, *,
                  vocab=None) -> None:
    """samples.txt: source / prediction / target for the first held-out examples.

    vocab: the predictions' vocabulary, when it extends the task's target vocabulary (a
    decoder-only model's joint one); by default the target vocabulary."""
    join = "" if task.name == "dates" else " "
    vocab = task.tgt_vocab if vocab is None else vocab
    lines = []
    for i in range(min(count, len(batch.src))):
        source = task.src_vocab.decode(batch.src[i], join=join)
        prediction = vocab.decode(predictions[i], join=join)
        target = task.tgt_vocab.decode(batch.tgt_out[i], join=join)
        mark = "ok" if prediction == target else "WRONG"
        lines += [f"source:     {source}", f"prediction: {prediction}  ({mark})",
                  f"target:     {target}", ""]
    Path(path).write_text("\n".join(lines))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(path: Path, records: list[dict]) -> None:
    """curves.png: training loss, and training/held-out accuracy, against step."""
    plt = _pyplot()
    logs = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_exact_match" in r]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in logs], [r["loss"] for r in logs], label="train loss")
    ax_loss.set(xlabel="step", ylabel="loss (label-smoothed)", yscale="log", title="loss")
    ax_acc.plot([r["step"] for r in logs], [r["accuracy"] for r in logs],
                label="train token accuracy (teacher forced)")
    ax_acc.plot([r["step"] for r in evals], [r["eval_token_accuracy"] for r in evals], "o-",
                label="held-out token accuracy (greedy)")
    ax_acc.plot([r["step"] for r in evals], [r["eval_exact_match"] for r in evals], "s-",
                label="held-out exact match (greedy)")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02), title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_attention(path: Path, maps: dict, src_tokens: list[str], tgt_tokens: list[str]) -> None:
    """attention.png: one row per attention layer (encoder self, decoder self, then
    cross attention), one column per head.

    maps is `attention_maps(...)` for a batch of one; src_tokens label the source
    positions and tgt_tokens the decoder inputs (bos, then the prediction).
    """
    plt = _pyplot()
    order = {"encoder/self": 0, "decoder/self": 1, "decoder/cross": 2}
    names = sorted(maps, key=lambda n: (order[n.split("/")[0] + "/" + n.split("/")[-1]], n))
    heads = maps[names[0]].shape[1]
    size = max(len(src_tokens), len(tgt_tokens)) * 0.18 + 1.2
    fig, axes = plt.subplots(len(names), heads, figsize=(heads * size, len(names) * size),
                             squeeze=False)
    for row, name in zip(axes, names):
        queries = src_tokens if name.startswith("encoder") else tgt_tokens
        keys = tgt_tokens if name.endswith("self") and name.startswith("decoder") else src_tokens
        # [N, T, S] cropped to the example's tokens
        weights = np.asarray(maps[name][0], np.float32)[:, : len(queries), : len(keys)]
        for head, ax in enumerate(row):
            ax.imshow(weights[head], cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=7)
            ax.set_yticks(range(len(queries)), queries, fontsize=7)
            ax.set_title(f"{name} head {head}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
