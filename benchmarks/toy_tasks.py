"""Trains every shipped toy config from scratch, one after another, and prints a table of
held-out accuracy against wall time (the whole command: start-up, compilation, training,
evaluation, checkpoints and plots). Each run starts with an empty compilation cache of its
own, as a first run on a fresh machine does (copy and reverse compile the same
initialisation, which a shared cache would hand from one to the other).

    python benchmarks/toy_tasks.py [--configs copy copy_decoder_only copy_packed ...]
                                   [--workdir DIR]
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import Parser  # noqa: E402
from _timing import run as run_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# configs/<name>.yaml -> (held-out exact match, seconds) it should reach
TARGETS = {"copy": (0.999, 30), "reverse": (0.999, 42), "sort": (0.995, 64),
           "dates": (0.995, 109), "copy_decoder_only": (0.999, 90), "copy_packed": (0.999, 90)}


def train(name: str, run_dir: Path) -> tuple[float, str]:
    """One run of train_toy.py from scratch: (wall seconds, its last line). A Ctrl-C
    reaches the run too (as in a terminal), which stops at its next step, saving what
    it has; a SIGINT sent to this script alone is passed on, and the run is waited for."""
    start = time.perf_counter()
    with subprocess.Popen([sys.executable, str(ROOT / "train_toy.py"), "--config",
                           str(ROOT / "configs" / f"{name}.yaml"), "--workdir", str(run_dir)],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ,
                               "JAX_COMPILATION_CACHE_DIR": str(run_dir / "jax_cache")}
                          ) as child:
        try:
            stdout, stderr = child.communicate()
        except KeyboardInterrupt:
            child.send_signal(signal.SIGINT)
            child.communicate()
            print(f"interrupted: the {name} run in {run_dir} stopped (not a figure: its "
                  f"time would include a resume)", file=sys.stderr)
            sys.exit(130)
    seconds = time.perf_counter() - start
    if child.returncode != 0:
        sys.exit(f"{name} failed ({child.returncode}):\n{stderr[-2000:]}")
    return seconds, stdout.strip().splitlines()[-1]


def main():
    parser = Parser(__doc__)
    parser.add_argument("--configs", nargs="+", default=list(TARGETS), choices=list(TARGETS),
                        help="names of configs/*.yaml to train")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the runs go, each in a directory of its name that must "
                             "not exist yet (default: a fresh temporary directory)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="attnjax-toy-"))
    # every figure is of a run from scratch with a cold compilation cache: a directory
    # holding a run would be resumed (or only evaluated) from its checkpoints
    for name in args.configs:
        if (workdir / name).exists():
            parser.error(f"argument --workdir: {workdir / name} exists; the figures are of "
                         f"runs from scratch: give a new directory")
    rows = []
    for name in args.configs:
        run_dir = workdir / name
        seconds, last_line = train(name, run_dir)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        final = [r for r in records if "eval_exact_match" in r][-1]
        # target tokens (pad never counts) per second of training, the median log window
        speed = statistics.median(r["tokens_per_s"] for r in records if "tokens_per_s" in r)
        accuracy, limit = TARGETS[name]
        rows.append((name, final["step"], final["eval_exact_match"], final["eval_token_accuracy"],
                     speed, seconds, accuracy, limit))
        print(last_line, flush=True)
    print(f"\nruns in {workdir}\n")
    print("| config | steps | held-out exact match | token accuracy | target tokens/s | "
          "wall time | target |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, steps, exact, tokens, speed, seconds, accuracy, limit in rows:
        met = "met" if exact >= accuracy and seconds <= limit else "MISSED"
        print(f"| {name} | {steps} | {exact:.2%} | {tokens:.2%} | {speed:.0f} | {seconds:.1f} s | "
              f"≥ {accuracy:.1%} in ≤ {limit} s: {met} |")


if __name__ == "__main__":
    run_main(main)
