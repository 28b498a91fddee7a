"""Attention called outside jit, as in a notebook: attnjax vs jax.nn.dot_product_attention.

    python benchmarks/eager.py [--repeats 41]

float32, B=2, T=S=128, N=4, H=32, causal, forward, no jax.jit around the call. Each
implementation first runs in a process of its own (the first call compiles whatever it
needs, and a second process would find the operations compiled by the first); then
both run again in this process, interleaved call by call (median of the repeats).
"""

import argparse
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnjax  # noqa: E402
from _timing import Parser, median_times, positive_int  # noqa: E402
from _timing import run as run_main  # noqa: E402

SHAPE = (2, 128, 4, 32)
FNS = {"attnjax": attnjax.dot_product_attention, "jax.nn": jax.nn.dot_product_attention}


def _inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    return tuple(jax.random.normal(key, SHAPE, jnp.float32) for key in keys)


def first_call(name: str) -> float:
    """Seconds of the first eager call of FNS[name] in this process."""
    q, k, v = jax.block_until_ready(_inputs())
    start = time.perf_counter()
    jax.block_until_ready(FNS[name](q, k, v, is_causal=True))
    return time.perf_counter() - start


def main() -> None:
    parser = Parser(__doc__)
    parser.add_argument("--repeats", type=positive_int, default=41)
    parser.add_argument("--first-call", choices=list(FNS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_call:
        print(first_call(args.first_call))
        return
    first = {name: float(subprocess.run(
        [sys.executable, __file__, "--first-call", name], capture_output=True, text=True,
        check=True).stdout.split()[-1]) for name in FNS}
    fns = {name: (lambda fn: lambda q, k, v: fn(q, k, v, is_causal=True))(fn)
           for name, fn in FNS.items()}
    later = median_times(fns, _inputs(), repeats=args.repeats)
    b, t, n, h = SHAPE
    print(f"device: {jax.devices()[0].device_kind}, B={b} T=S={t} N={n} H={h} float32, "
          f"causal, forward, eager; later calls: median of {args.repeats}")
    print("| implementation | first call s | later calls ms |")
    print("|---|---:|---:|")
    for name in FNS:
        print(f"| {name} | {first[name]:.2f} | {later[name] * 1e3:.2f} |")


if __name__ == "__main__":
    run_main(main)
