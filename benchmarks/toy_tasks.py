"""Trains every shipped toy config from scratch, one after another, and prints a table of
held-out accuracy against wall time (the whole command: start-up, compilation, training,
evaluation, checkpoints and plots).

    python benchmarks/toy_tasks.py [--tasks copy reverse sort dates] [--workdir DIR]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"copy": (0.999, 60), "reverse": (0.999, 120), "sort": (0.995, 180),
           "dates": (0.995, 300)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the runs go (default: a fresh temporary directory)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="attnjax-toy-"))
    rows = []
    for task in args.tasks:
        run_dir = workdir / task
        start = time.perf_counter()
        result = subprocess.run([sys.executable, str(ROOT / "train_toy.py"), "--config",
                                 str(ROOT / "configs" / f"{task}.yaml"), "--workdir",
                                 str(run_dir)], cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(f"{task} failed ({result.returncode}):\n{result.stderr[-2000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        final = [r for r in records if "eval_exact_match" in r][-1]
        accuracy, limit = TARGETS[task]
        rows.append((task, final["step"], final["eval_exact_match"], final["eval_token_accuracy"],
                     seconds, accuracy, limit))
        print(result.stdout.strip().splitlines()[-1], flush=True)
    print(f"\nruns in {workdir}\n")
    print("| task | steps | held-out exact match | token accuracy | wall time | target |")
    print("|---|---:|---:|---:|---:|---|")
    for task, steps, exact, tokens, seconds, accuracy, limit in rows:
        met = "met" if exact >= accuracy and seconds <= limit else "MISSED"
        print(f"| {task} | {steps} | {exact:.2%} | {tokens:.2%} | {seconds:.1f} s | "
              f"≥ {accuracy:.1%} in ≤ {limit} s: {met} |")


if __name__ == "__main__":
    main()
