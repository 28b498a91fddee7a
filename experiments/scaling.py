"""Does attention without the 1/√d_k factor saturate the softmax and starve the gradients
at large d_k, so that additive attention beats unscaled dot-product attention there?

    python experiments/scaling.py            # a few minutes on two CPU cores

(a) At initialisation, with unit-variance queries and keys `[T, d_k]` (T = S = 64)
and values `[S, 64]`, for d_k in 8 … 2048 and each score — "dot" q kᵀ, "scaled_dot"
q kᵀ/√d_k, "additive" vᵀ tanh(W_q q + W_k k) with attnjax's initialisers — the
standard deviation of the logits, the softmax entropy (its maximum is log S) and the
norms of the gradients that reach q and k from a unit-variance cotangent on the output,
averaged over draws.

(b) The toy trainer's encoder–decoder with each score, d_model fixed and the heads
split into a small or a large head dimension (so only d_k changes), trained for the
same steps on the toy tasks; held-out exact match at the end.

Writes docs/scaling.png and docs/scaling.md.
"""

import argparse
import functools
import math
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run from a clone, installed or not

sys.path.insert(0, str(ROOT / "benchmarks"))   # their command-line helpers
import attnjax  # noqa: E402
from _timing import Parser, positive_int  # noqa: E402
from _timing import run as run_main  # noqa: E402
from attnjax import scores  # noqa: E402
from attnjax.nn.attention import alignment_params  # noqa: E402

SCORES = ("dot", "scaled_dot", "additive")
HEAD_DIMS = (8, 32, 128, 512, 2048)
LENGTH, VALUE_DIM, DRAWS = 64, 64, 8


def score_fn(score: str, head_dim: int, key):
    """The alignment of one head, with the parameters attnjax initialises it with."""
    if score == "dot":
        return scores.dot_score
    if score == "scaled_dot":
        return scores.scaled_dot_score
    specs = alignment_params("additive", 1, head_dim)
    keys = dict(zip(specs, jax.random.split(key, len(specs))))
    # [1, H, H], [1, H, H], [1, H] -> one head's w_q [H, A], w_k [H, A], v [A]
    p = {name: init(keys[name], shape, jnp.float32)[0] for name, (init, shape) in specs.items()}
    return functools.partial(scores.additive_score, w_q=p["score_w_q"], w_k=p["score_w_k"],
                             v=p["score_v"])


@functools.partial(jax.jit, static_argnames=("score", "head_dim"))
def statistics(key, *, score: str, head_dim: int):
    """Logit std, softmax entropy, ‖∂L/∂q‖ (Frobenius) and its median row norm, the same
    for k, of one draw."""
    kq, kk, kv, kg, kp = jax.random.split(key, 5)
    q = jax.random.normal(kq, (LENGTH, head_dim), jnp.float32)
    k = jax.random.normal(kk, (LENGTH, head_dim), jnp.float32)
    v = jax.random.normal(kv, (LENGTH, VALUE_DIM), jnp.float32)
    cotangent = jax.random.normal(kg, (LENGTH, VALUE_DIM), jnp.float32)
    align = score_fn(score, head_dim, kp)
    # [T, S]
    logits = align(q, k)
    weights = jax.nn.softmax(logits, axis=-1)
    entropy = -jnp.sum(weights * jnp.log(jnp.maximum(weights, 1e-30)), axis=-1).mean()

    def loss(q, k):
        return jnp.sum(attnjax.attention(q, k, v, score_fn=align) * cotangent)

    grad_q, grad_k = jax.grad(loss, argnums=(0, 1))(q, k)
    # the whole gradient, and the typical row's: a few rows with near-ties can carry the
    # whole norm while most rows get almost nothing
    return jnp.stack([jnp.std(logits), entropy, jnp.linalg.norm(grad_q),
                      jnp.median(jnp.linalg.norm(grad_q, axis=-1)), jnp.linalg.norm(grad_k),
                      jnp.median(jnp.linalg.norm(grad_k, axis=-1))])


def part_a() -> dict:
    """{(score, d_k): [logit std, entropy, ‖dq‖, median ‖dq_i‖, ‖dk‖, median ‖dk_j‖]},
    averaged over DRAWS draws."""
    results = {}
    for score in SCORES:
        for head_dim in HEAD_DIMS:
            draws = [statistics(jax.random.fold_in(jax.random.key(0), i), score=score,
                                head_dim=head_dim) for i in range(DRAWS)]
            results[score, head_dim] = np.mean(np.stack(draws), axis=0)
    return results


def part_b_config(task_name: str, score: str, head_dim: int, steps: int, d_model: int,
                  eval_size: int):
    """The toy trainer's config of one run of (b) (a ConfigError if it cannot be)."""
    from attnjax.toy.config import load_config

    return load_config(None, [
        f"task.name={task_name}", "task.num_symbols=10", "task.min_len=1",
        "task.max_len=8", f"task.eval_size={eval_size}",
        f"model.d_model={d_model}", f"model.num_heads={max(d_model // head_dim, 1)}",
        f"model.d_ff={2 * d_model}", "model.num_encoder_layers=1",
        "model.num_decoder_layers=1", "model.max_len=16",
        "model.dropout_rate=0.0", f"model.attention_score={score}",
        "optim.learning_rate=3e-3", "optim.warmup_steps=50", "batch_size=64",
        f"steps={steps}", "seed=0"])


def part_b(tasks, steps: int, d_model: int, head_dims, eval_size: int) -> dict:
    """{(task, score, head_dim): (exact match, token accuracy, final loss)}."""
    from attnjax.parallel import mesh as mesh_lib
    from attnjax.toy import make_task
    from attnjax.toy import train as training

    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    results = {}
    for task_name in tasks:
        for score in SCORES:
            for head_dim in head_dims:
                config = part_b_config(task_name, score, head_dim, steps, d_model, eval_size)
                task = make_task(config.task)
                model = training.make_model(config, task)
                optimizer = training.make_optimizer(config.optim, config.steps)
                state = training.init_state(model, optimizer, task, config.seed, mesh)
                step = training.make_train_step(model, optimizer, config.optim, config.steps,
                                                config.seed, state, mesh)
                start = time.perf_counter()
                losses = []
                for i in range(steps):
                    state, metrics = step(state, training.train_batch(task, config, i, mesh))
                    losses.append(float(metrics["loss"]))
                held_out = training.eval_set(task, config)
                predictions = training.predict(model, task, state.params, held_out, eval_size,
                                               mesh)
                accuracy = training.accuracies(predictions, np.asarray(held_out.tgt_out))
                results[task_name, score, head_dim] = (
                    accuracy["exact_match"], accuracy["token_accuracy"],
                    float(np.mean(losses[-20:])))
                print(f"{task_name:8s} {score:10s} d_k={head_dim:4d}: exact match "
                      f"{accuracy['exact_match']:.3f}, loss {np.mean(losses[-20:]):.3f} "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
    return results


def write_plot(a: dict, b: dict, tasks, head_dims, path: Path) -> None:
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.5))
    titles = ("logit standard deviation", "softmax entropy (nats)",
              "gradient reaching q: ‖∂L/∂q‖ (solid), median row (dashed)",
              "gradient reaching k: ‖∂L/∂k‖ (solid), median row (dashed)")
    columns = ((0,), (1,), (2, 3), (4, 5))
    for i, (title, cols) in enumerate(zip(titles, columns)):
        ax = axes[i]
        for color, score in zip(("C0", "C1", "C2"), SCORES):
            for col, style in zip(cols, ("-", "--")):
                ax.plot(HEAD_DIMS, [a[score, d][col] for d in HEAD_DIMS], marker="o",
                        linestyle=style, color=color, label=score if style == "-" else None)
        ax.set_title(title, fontsize=9)
        if i == 1:
            ax.axhline(math.log(LENGTH), color="grey", linestyle=":", label="log S (uniform)")
        ax.set_xscale("log", base=2)
        if i != 1:
            ax.set_yscale("log")
        ax.set_xlabel("d_k")
        ax.legend(fontsize=8)
    ax = axes[4]
    width = 0.8 / (len(SCORES) * len(head_dims))
    bars = [(color, score, head_dim, hatch) for color, score in zip(("C0", "C1", "C2"), SCORES)
            for head_dim, hatch in zip(head_dims, ("", "//", "xx"))]
    for j, (color, score, head_dim, hatch) in enumerate(bars):
        ax.bar(np.arange(len(tasks)) + j * width, [b[t, score, head_dim][0] for t in tasks],
               width, color=color, hatch=hatch, edgecolor="white",
               label=f"{score}, d_k={head_dim}")
    ax.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2, tasks)
    ax.set_ylim(0, 1.05)
    ax.set_title("(b) trained: held-out exact match", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"(a) at initialisation, T = S = {LENGTH}, unit-variance q, k, v; "
                 "(b) after training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_table(a: dict, b: dict, tasks, head_dims, args, path: Path) -> str:
    lines = [f"(a) At initialisation: T = S = {LENGTH}, V = {VALUE_DIM}, unit-variance "
             f"inputs, mean of {DRAWS} draws; the uniform softmax's entropy is "
             f"log {LENGTH} = {math.log(LENGTH):.2f}.", "",
             "| score | d_k | logit std | softmax entropy | ‖∂L/∂q‖ | median ‖∂L/∂q_i‖ "
             "| ‖∂L/∂k‖ | median ‖∂L/∂k_j‖ |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for score in SCORES:
        for d in HEAD_DIMS:
            std, entropy, dq, dq_row, dk, dk_row = a[score, d]
            lines.append(f"| {score} | {d} | {std:.3g} | {entropy:.3f} | {dq:.3g} | "
                         f"{dq_row:.3g} | {dk:.3g} | {dk_row:.3g} |")
    lines += ["", f"(b) Trained: encoder–decoder, 1 + 1 layers, d_model = {args.d_model} "
              f"split into d_model/d_k heads, {args.steps} steps of 64 examples, "
              f"sequences of 1–8 symbols from 10; held-out exact match "
              f"({args.eval_size} examples) and the mean loss of the last "
              f"{min(20, args.steps)} steps.", "",
              "| task | score | " + " | ".join(f"d_k = {d}" for d in head_dims) + " |",
              "|---|---|" + "---:|" * len(head_dims)]
    for task in tasks:
        for score in SCORES:
            cells = [f"{b[task, score, d][0]:.1%} (loss {b[task, score, d][2]:.2f})"
                     for d in head_dims]
            lines.append(f"| {task} | {score} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return text


def main() -> None:
    parser = Parser(__doc__)
    parser.add_argument("--tasks", default="reverse,sort", help="toy tasks, comma-separated")
    parser.add_argument("--steps", type=positive_int, default=400)
    parser.add_argument("--d-model", type=positive_int, default=256)
    parser.add_argument("--head-dims", default="16,256",
                        help="d_k values, comma-separated, each dividing --d-model")
    parser.add_argument("--eval-size", type=positive_int, default=500)
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    try:
        head_dims = [positive_int(d) for d in args.head_dims.split(",")]
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument --head-dims: {e}")
    for head_dim in head_dims:
        if args.d_model % head_dim:
            parser.error(f"argument --head-dims: each must divide --d-model={args.d_model}; "
                         f"got {head_dim}")
    # every run of (b) checked before (a) takes its minutes
    from attnjax.toy.config import ConfigError
    for task_name in tasks:
        for score in SCORES:
            try:
                part_b_config(task_name, score, head_dims[0], args.steps, args.d_model,
                              args.eval_size)
            except ConfigError as e:
                parser.error(f"argument --tasks: {e}")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        parser.error(f"argument --out: cannot write there ({e.strerror or e})")
    start = time.perf_counter()
    a = part_a()
    print(f"(a) done in {time.perf_counter() - start:.0f} s", flush=True)
    b = part_b(tasks, args.steps, args.d_model, head_dims, args.eval_size)
    write_plot(a, b, tasks, head_dims, args.out / "scaling.png")
    print(write_table(a, b, tasks, head_dims, args, args.out / "scaling.md"))
    print(f"total {time.perf_counter() - start:.0f} s; wrote {args.out / 'scaling.png'} and "
          f"{args.out / 'scaling.md'}")


if __name__ == "__main__":
    run_main(main)
