"""Does the vmapped form cost speed? Dense attnjax vs jax.nn.dot_product_attention.

    python benchmarks/vmap_overhead.py [--repeats 41]

float32, B=2, T=S=512, N=8, H=64, forward only, one process, median of the repeats
after warm-up, the two interleaved call by call.
"""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnjax  # noqa: E402
from _timing import Parser, median_times, positive_int  # noqa: E402
from _timing import run as run_main  # noqa: E402


def main() -> None:
    parser = Parser(__doc__)
    parser.add_argument("--repeats", type=positive_int, default=41)
    args = parser.parse_args()
    b, t, n, h = 2, 512, 8, 64
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.float32) for key in keys)
    fns = {
        "attnjax dense": jax.jit(lambda q, k, v: attnjax.dot_product_attention(
            q, k, v, implementation="dense")),
        "jax.nn": jax.jit(jax.nn.dot_product_attention),
    }
    times = median_times(fns, (q, k, v), repeats=args.repeats)
    print(f"device: {jax.devices()[0].device_kind}, B={b} T=S={t} N={n} H={h} float32, "
          f"forward, median of {args.repeats}")
    print("| implementation | ms | speed-up: jax.nn ms / ms |")
    print("|---|---:|---:|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {times['jax.nn'] / seconds:.2f}× |")


if __name__ == "__main__":
    run_main(main)
