"""Trains every shipped toy config from scratch, one after another, and prints a table of
held-out accuracy against wall time (the whole command: start-up, compilation, training,
evaluation, checkpoints and plots). Each run starts with an empty compilation cache of its
own, as a first run on a fresh machine does (copy and reverse compile the same
initialisation, which a shared cache would hand from one to the other).

    python benchmarks/toy_tasks.py [--configs copy copy_decoder_only copy_packed ...]
                                   [--workdir DIR]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# configs/<name>.yaml -> (held-out exact match, seconds) it should reach
TARGETS = {"copy": (0.999, 30), "reverse": (0.999, 42), "sort": (0.995, 64),
           "dates": (0.995, 109), "copy_decoder_only": (0.999, 90), "copy_packed": (0.999, 90)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(TARGETS), choices=list(TARGETS),
                        help="names of configs/*.yaml to train")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the runs go (default: a fresh temporary directory)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="attnjax-toy-"))
    rows = []
    for name in args.configs:
        run_dir = workdir / name
        start = time.perf_counter()
        result = subprocess.run([sys.executable, str(ROOT / "train_toy.py"), "--config",
                                 str(ROOT / "configs" / f"{name}.yaml"), "--workdir",
                                 str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                                env={**os.environ,
                                     "JAX_COMPILATION_CACHE_DIR": str(run_dir / "jax_cache")})
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(f"{name} failed ({result.returncode}):\n{result.stderr[-2000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        final = [r for r in records if "eval_exact_match" in r][-1]
        # target tokens (pad never counts) per second of training, the median log window
        speed = statistics.median(r["tokens_per_s"] for r in records if "tokens_per_s" in r)
        accuracy, limit = TARGETS[name]
        rows.append((name, final["step"], final["eval_exact_match"], final["eval_token_accuracy"],
                     speed, seconds, accuracy, limit))
        print(result.stdout.strip().splitlines()[-1], flush=True)
    print(f"\nruns in {workdir}\n")
    print("| config | steps | held-out exact match | token accuracy | target tokens/s | "
          "wall time | target |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, steps, exact, tokens, speed, seconds, accuracy, limit in rows:
        met = "met" if exact >= accuracy and seconds <= limit else "MISSED"
        print(f"| {name} | {steps} | {exact:.2%} | {tokens:.2%} | {speed:.0f} | {seconds:.1f} s | "
              f"≥ {accuracy:.1%} in ≤ {limit} s: {met} |")


if __name__ == "__main__":
    main()
