"""What a run shows and leaves behind: progress, metrics.jsonl, samples.txt and plots."""

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from attnjax.toy.tasks import exact_matches

# Keys of a metrics record that measure wall time; everything else is reproducible.
TIMING_KEYS = ("elapsed_s", "tokens_per_s", "eval_s")
# The two records a run writes: one per log step, one per evaluation (after the log
# record of its step).
LOG_KEYS = frozenset({"step", "loss", "accuracy", "learning_rate", "tokens_per_s",
                      "elapsed_s"})
EVAL_KEYS = frozenset({"step", "eval_token_accuracy", "eval_exact_match", "eval_s"})


# TensorBoard's event files, written beside metrics.jsonl
EVENT_FILES = "events.out.tfevents.*"


def scalar_tag(key: str) -> str:
    """The TensorBoard tag of a metrics key: eval_exact_match -> eval/exact_match, loss ->
    train/loss, elapsed_s -> time/elapsed_s."""
    if key.startswith("eval_") and key != "eval_s":
        return "eval/" + key.removeprefix("eval_")
    return ("time/" if key in TIMING_KEYS else "train/") + key


class MetricsLog:
    """metrics.jsonl: one JSON object per log or eval step, appended and flushed at once;
    the same scalars in TensorBoard event files in the same directory.

    Opening it for a run resumed at `resume_step` drops the records of later steps (written
    after the checkpoint the run resumes from), and from a line no run wrote whole on (the
    torn last line of a killed process, or a damaged one); TensorBoard is told to drop its
    events of those steps too. A damaged line that records of kept steps follow is told
    to `warn` (a torn last line is not), and so are records missing before the resumed
    step, where log_every says which there were (a file cut short, or deleted: they are
    not written again). A file that cannot be written raises an OSError naming it.
    """

    def __init__(self, path: Path, resume_step: int, *, enabled: bool = True,
                 warn: Callable[[str], None] | None = None, log_every: int | None = None):
        self.path = Path(path)
        self.records = []
        self._file = None
        self._events = None
        if not enabled:  # another process writes the file
            return
        if self.path.exists():
            lines = self.path.read_bytes().splitlines()
            records = [_record(line) for line in lines]
            for number, record in enumerate(records, 1):
                if record is not None and _out_of_order(
                        self.records[-1] if self.records else None, record,
                        records[number:number + 2]):
                    record = None   # a step number damaged since
                if record is None:
                    lost = [r for r in records[number:]
                            if r is not None and r["step"] <= resume_step]
                    if lost and warn is not None:
                        warn(f"{self.path} line {number} is damaged: it and the "
                             f"{len(lost)} records after it (steps {lost[0]['step']} to "
                             f"{lost[-1]['step']}) are dropped")
                        warn = None   # said
                    break
                if record["step"] > resume_step:
                    break
                self.records.append(record)
        # the last step logged before the resumed one, which the file should hold
        logged = 0 if not log_every else resume_step - resume_step % log_every
        last = max((r["step"] for r in self.records), default=0)
        if last < logged and warn is not None:
            warn(f"{self.path} holds no records after step {last}: the records of steps "
                 f"{last + 1} to {logged}, before step {resume_step} that the run resumes "
                 f"from, are lost (they are not written again)")
        with _naming(self.path):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            os.replace(tmp, self.path)
            self._file = self.path.open("a")
        # The events are written here, not by SummaryWriter's thread: a full disk fails
        # the write that met it, in this thread, and leaves no atexit hook to fail again.
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import SessionLog

        with _naming(self.path.parent / EVENT_FILES):
            self._events = EventsWriter(str(self.path.parent / "events"))
            # TensorBoard hides what an earlier process wrote from this step on
            self._events.write_event(_event(resume_step + 1, session_log=SessionLog(
                status=SessionLog.START)))
            self._events.flush()

    def write(self, record: dict) -> None:
        self.records.append(record)
        if self._file is None:
            return
        with _naming(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        from tensorboardX.proto.summary_pb2 import Summary

        with _naming(self.path.parent / EVENT_FILES):
            for key, value in record.items():
                if key != "step":
                    self._events.write_event(_event(record["step"], summary=Summary(value=[
                        Summary.Value(tag=scalar_tag(key), simple_value=value)])))
            self._events.flush()

    def close(self) -> None:
        """Closes both files. Each record was flushed when written, and a failure raised
        then: a close that fails (a full disk met again) is not raised over it."""
        for file in (self._file, self._events):
            if file is not None:
                with contextlib.suppress(OSError):
                    file.close()
        self._file = self._events = None


@contextlib.contextmanager
def _naming(path: Path):
    """An OSError that names no file (a write or flush that failed) names path."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


def _event(step: int, **fields):
    """A TensorBoard event of step, written now."""
    from tensorboardX.proto.event_pb2 import Event

    return Event(step=step, wall_time=time.time(), **fields)


def _record(line: bytes) -> dict | None:
    """The record of a metrics.jsonl line; None for a line no run wrote whole: torn by a
    killed process, or damaged since (not UTF-8, not JSON, not a log or an evaluation
    record of an int "step" and finite numbers)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested too deeply
        return None
    if (not isinstance(record, dict) or record.keys() not in (LOG_KEYS, EVAL_KEYS)
            or type(record["step"]) is not int):
        return None
    if not all(type(v) in (int, float) and math.isfinite(v) for v in record.values()):
        return None
    return record


def _out_of_order(before: dict | None, record: dict, after: list) -> bool:
    """Whether a record is out of the order a run writes (by step, a log record before
    its step's evaluation), damaged since: it does not follow the record kept before it,
    or it stands after both records that follow it (one record out of order with the
    next: that next one is damaged unless the one after it is out of order too)."""
    order = lambda r: (r["step"], "loss" not in r)  # noqa: E731
    if before is not None and order(record) <= order(before):
        return True
    return len(after) == 2 and None not in after and all(
        order(record) >= order(r) for r in after)


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
    # the mark of exact match (the decoded strings leave out pad, bos and eos)
    right = exact_matches(np.asarray(predictions), np.asarray(batch.tgt_out))
    for i in range(min(count, len(batch.src))):
        source = task.src_vocab.decode(batch.src[i], join=join)
        prediction = vocab.decode(predictions[i], join=join)
        target = task.tgt_vocab.decode(batch.tgt_out[i], join=join)
        mark = "ok" if right[i] else "WRONG"
        lines += [f"source:     {source}", f"prediction: {prediction}  ({mark})",
                  f"target:     {target}", ""]
    Path(path).write_text("\n".join(lines))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves_figure(records: list[dict]):
    """The figure of curves.png: three panels, so that no line hides another.

    Loss (log scale, left axis) and learning rate (right axis) against step; training
    token accuracy (teacher forced) and held-out token accuracy (greedy); held-out exact
    match (greedy)."""
    plt = _pyplot()
    logs = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_exact_match" in r]
    fig, (ax_loss, ax_tokens, ax_exact) = plt.subplots(1, 3, figsize=(15, 4.2),
                                                       layout="constrained")
    steps = [r["step"] for r in logs]
    eval_steps = [r["step"] for r in evals]
    # one log step (steps=1, or fewer steps than log_every): a line of one point draws
    # nothing, its marker does
    point = "o" if len(steps) == 1 else None
    loss_line, = ax_loss.plot(steps, [r["loss"] for r in logs], color="C0", marker=point,
                              label="train loss (label-smoothed)")
    ax_loss.set(xlabel="step", ylabel="loss", yscale="log", title="loss and learning rate")
    ax_lr = ax_loss.twinx()
    lr_line, = ax_lr.plot(steps, [r["learning_rate"] for r in logs], color="C3",
                          linestyle="--", marker=point, label="learning rate")
    ax_lr.set_ylabel("learning rate", color="C3")
    ax_lr.tick_params(axis="y", labelcolor="C3")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    # on the right axis, which is drawn above the left one's lines
    ax_lr.legend(handles=[loss_line, lr_line], fontsize=9, loc="upper right", framealpha=0.9)
    ax_tokens.plot(steps, [r["accuracy"] for r in logs], color="C0", marker=point,
                   label="train (teacher forced)")
    ax_tokens.plot(eval_steps, [r["eval_token_accuracy"] for r in evals], color="C1",
                   marker="o", linestyle=":", label="held-out (greedy)")
    ax_tokens.set(xlabel="step", ylabel="token accuracy", title="token accuracy")
    ax_exact.plot(eval_steps, [r["eval_exact_match"] for r in evals], color="C2", marker="s",
                  label="held-out (greedy)")
    ax_exact.set(xlabel="step", ylabel="exact match (whole sequence)", title="exact match")
    for ax in (ax_tokens, ax_exact):
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=9, loc="lower right")
    for ax in (ax_loss, ax_tokens, ax_exact):
        ax.grid(alpha=0.3)
    return fig


def plot_curves(path: Path, records: list[dict]) -> None:
    """curves.png: `curves_figure(records)`."""
    _save(curves_figure(records), path)


def attention_figure(maps: dict, src_tokens: list[str], tgt_tokens: list[str]):
    """The figure of attention.png: one row per attention layer (encoder self, decoder
    self, then cross attention), one column per head, one colour scale for all.

    maps is `attention_maps(...)` for a batch of one; src_tokens label the source
    positions and tgt_tokens the decoder inputs (bos, then the prediction). Keys run
    along the x axis, queries down the y axis; a row's heads share its queries, which
    its first panel names.
    """
    plt = _pyplot()
    order = {"encoder/self": 0, "decoder/self": 1, "decoder/cross": 2}
    names = sorted(maps, key=lambda n: (order[n.split("/")[0] + "/" + n.split("/")[-1]], n))
    heads = maps[names[0]].shape[1]
    # a decoder-only model's one sequence: source, separator and output
    one_sequence = src_tokens is tgt_tokens
    kind = lambda tokens: ("sequence" if one_sequence else  # noqa: E731
                           "source" if tokens is src_tokens else "output")
    longest = lambda tokens: max(map(len, tokens), default=0)  # noqa: E731
    rows = [(name, src_tokens if name.startswith("encoder") else tgt_tokens,  # queries
             tgt_tokens if name.startswith("decoder") and name.endswith("self")
             else src_tokens)  # keys
            for name in names]
    # Placed here, in inches, from the token counts and label lengths: matplotlib's
    # constrained layout measured every tick label of every panel, 1.7 of the 3.3 s
    # this figure took (6 layers of 4 heads).
    cell, char = 0.26, 0.08   # inches per token (room for a 9-point label), per character
    # A panel holds its keys across and its queries down, a cell per token; its box
    # also fits its title (10-point) and key label across and its query label down.
    across = max([cell * len(keys) for _, _, keys in rows]
                 + [0.09 * len(f"{name}, head {heads - 1}") for name in names]
                 + [char * len(f"{kind(keys)} tokens (keys)") for _, _, keys in rows])
    downs = [max(cell * len(queries), char * len(f"{kind(queries)} tokens (queries)"))
             for _, queries, _ in rows]
    # the first column's query labels; keys' labels longer than two characters run
    # vertically
    left = 0.45 + char * max(longest(queries) for _, queries, _ in rows)
    below = 0.5 + max(char * longest(keys) if longest(keys) > 2 else 0.2
                      for _, _, keys in rows)
    above, gap, bar_room = 0.35, 0.3, 1.2
    fig = plt.figure(figsize=(left + heads * (across + gap) + bar_room,
                              sum(above + down + below for down in downs)))
    width_in, height_in = fig.get_size_inches()
    top = height_in   # of the row being placed
    image = None
    for (name, queries, keys), down in zip(rows, downs):
        # [N, T, S] cropped to the example's tokens
        weights = np.asarray(maps[name][0], np.float32)[:, : len(queries), : len(keys)]
        width, height = cell * len(keys), cell * len(queries)
        bottom = top - above - (down + height) / 2
        top -= above + down + below
        for head in range(heads):
            ax = fig.add_axes(((left + head * (across + gap) + (across - width) / 2) / width_in,
                               bottom / height_in, width / width_in, height / height_in))
            image = ax.imshow(weights[head], cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(len(keys)), keys, rotation=90 if longest(keys) > 2 else 0,
                          fontsize=9)
            ax.set_xlabel(f"{kind(keys)} tokens (keys)", fontsize=9)
            # above the query label where that is taller than the panel
            ax.set_title(f"{name}, head {head}", fontsize=10,
                         pad=6 + 72 * (down - height) / 2)
            if head == 0:
                ax.set_yticks(range(len(queries)), queries, fontsize=9)
                ax.set_ylabel(f"{kind(queries)} tokens (queries)", fontsize=9)
            else:
                ax.set_yticks([])
    bar_height = 0.6 * height_in
    bar_axes = fig.add_axes(((width_in - bar_room + 0.3) / width_in,
                             (height_in - bar_height) / 2 / height_in,
                             0.2 / width_in, bar_height / height_in))
    bar = fig.colorbar(image, cax=bar_axes)
    bar.set_label("attention weight", fontsize=10)
    return fig


def plot_attention(path: Path, maps: dict, src_tokens: list[str], tgt_tokens: list[str]) -> None:
    """attention.png: `attention_figure(maps, src_tokens, tgt_tokens)`."""
    _save(attention_figure(maps, src_tokens, tgt_tokens), path)


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
