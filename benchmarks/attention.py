"""attnjax's implementations against jax.nn and flax, in one process.

    python benchmarks/attention.py            # T = S from 128 to 8192, memory at 16384
    python benchmarks/attention.py --quick    # T = S in {256, 1024}, fewer repeats

First the machine's float32 GEMM rate (a 2048³ `jnp.dot`), then for B=1, N=8, H=64,
float32: forward and forward+backward time (`block_until_ready`, median after warm-up
of ≥ 5 calls each timed in a run of its own from T = 2048; below, of ≥ 25 calls, 101
for T ≤ 256, interleaved call by call) of attnjax auto / dense / chunked, `jax.nn.dot_product_attention`
and `flax.linen.dot_product_attention`, causal and not. GFLOP/s counts 4·B·N·T·S·H for
the forward and 2.5× that for forward+backward, causal or not, so a causal row's rate is
the rate of the full computation it stands in for. Memory is XLA's compiled temporary
allocation (`memory_analysis().temp_size_in_bytes`). Prints a markdown table.
"""

import argparse
import os
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnjax  # noqa: E402
from _timing import median_times  # noqa: E402

B, N, H = 1, 8, 64
# Runs whose compiled temporaries exceed this are reported for memory only.
MAX_TIMED_TEMP_BYTES = 8 * 2**30


def _flax(q, k, v, causal):
    mask = attnjax.causal_mask(q.shape[1], k.shape[1])[None, None] if causal else None
    return nn.dot_product_attention(q, k, v, mask=mask)


# attnjax's own first in each group: a run right after a dense peer has streamed
# gigabytes through memory is measurably slower, so the dense peers go last.
IMPLEMENTATIONS = {
    "attnjax auto": lambda q, k, v, c: attnjax.dot_product_attention(q, k, v, is_causal=c),
    "attnjax chunked": lambda q, k, v, c: attnjax.dot_product_attention(
        q, k, v, is_causal=c, implementation="chunked"),
    "attnjax dense": lambda q, k, v, c: attnjax.dot_product_attention(
        q, k, v, is_causal=c, implementation="dense"),
    "jax.nn": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c),
    "flax.linen": _flax,
}


def gemm_rate(repeats: int) -> float:
    """float32 GFLOP/s of a 2048³ matrix product."""
    a, b = (jax.random.normal(key, (2048, 2048), jnp.float32)
            for key in jax.random.split(jax.random.key(0), 2))
    seconds = median_times({"dot": jax.jit(jnp.dot)}, (a, b), repeats=repeats)["dot"]
    return 2 * 2048**3 / seconds / 1e9


def compiled(fn, args):
    """The jitted function and its compiled temporary bytes."""
    jitted = jax.jit(fn)
    temp = jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes
    return jitted, temp


def forward_fn(impl, causal):
    return lambda q, k, v, d_out: impl(q, k, v, causal)


def forward_backward_fn(impl, causal):
    def loss(q, k, v, d_out):
        return jnp.sum(impl(q, k, v, causal) * d_out)
    return jax.grad(loss, argnums=(0, 1, 2))


def run(sizes, memory_only_sizes, repeats, gemm):
    rows = []
    for t in sizes + memory_only_sizes:
        keys = jax.random.split(jax.random.key(t), 4)
        args = tuple(jax.random.normal(key, (B, t, N, H), jnp.float32) for key in keys)
        for pass_name, make, flop_factor in (("fwd", forward_fn, 1.0),
                                             ("fwd+bwd", forward_backward_fn, 2.5)):
            if t in memory_only_sizes and pass_name == "fwd+bwd":
                continue
            for causal in (False, True):
                fns, temps = {}, {}
                for name, impl in IMPLEMENTATIONS.items():
                    fn, temps[name] = compiled(make(impl, causal), args)
                    if temps[name] <= MAX_TIMED_TEMP_BYTES and t not in memory_only_sizes:
                        fns[name] = fn
                start = time.perf_counter()
                # Sub-millisecond runs are noisy: many repeats, interleaved call by call
                # so drift hits every peer alike. From T = 2048 each implementation is
                # timed in a run of its own, so dense peers that stream gigabytes through
                # memory do not evict the caches of the one timed after them.
                reps = repeats if t >= 2048 else max(repeats, 25 if t > 256 else 101)
                times = median_times(fns, args, repeats=reps, warmup=2,
                                     interleave=t < 2048) if fns else {}
                print(f"  T=S={t} {pass_name} causal={causal}: "
                      f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
                flops = 4 * B * N * t * t * H * flop_factor
                for name in IMPLEMENTATIONS:
                    seconds = times.get(name)
                    rows.append(dict(
                        t=t, pass_name=pass_name, causal=causal, name=name, seconds=seconds,
                        gflops=None if seconds is None else flops / seconds / 1e9,
                        ratio=(times["jax.nn"] / seconds
                               if seconds is not None and "jax.nn" in times else None),
                        temp=temps[name],
                    ))
    for row in rows:
        row["gemm_pct"] = None if row["gflops"] is None else 100 * row["gflops"] / gemm
    return rows


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def print_table(rows, gemm):
    print(f"float32 GEMM rate (2048³ jnp.dot): {gemm:.1f} GFLOP/s; "
          f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; B={B} N={N} H={H}")
    print()
    print("| T=S | pass | causal | implementation | ms | GFLOP/s | % GEMM | speed-up vs jax.nn "
          "| temp MiB |")
    print("|---:|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['t']} | {r['pass_name']} | {'yes' if r['causal'] else 'no'} | {r['name']} | "
              f"{_fmt(r['seconds'] and r['seconds'] * 1e3, '.1f')} | {_fmt(r['gflops'], '.1f')} | "
              f"{_fmt(r['gemm_pct'], '.0f')} | {_fmt(r['ratio'], '.2f')} | "
              f"{r['temp'] / 2**20:.1f} |")


def causal_speedup(t: int, repeats: int) -> tuple[float, float, float]:
    """Forward of attnjax auto, causal against not, interleaved call by call: two peers of
    the same size, so a ratio unaffected by what ran before them."""
    keys = jax.random.split(jax.random.key(t), 3)
    args = tuple(jax.random.normal(key, (B, t, N, H), jnp.float32) for key in keys)
    auto = IMPLEMENTATIONS["attnjax auto"]
    fns = {causal: jax.jit(lambda q, k, v, c=causal: auto(q, k, v, c)) for causal in (False, True)}
    times = median_times(fns, args, repeats=repeats, warmup=2, interleave=True)
    return times[False], times[True], times[False] / times[True]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T = S in {256, 1024}, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--sizes", type=int, nargs="+", help="T = S values to time")
    args = parser.parse_args()
    if args.sizes:
        sizes, memory_only, repeats = args.sizes, [], args.repeats or 5
    elif args.quick:
        sizes, memory_only, repeats = [256, 1024], [], args.repeats or 3
    else:
        sizes, memory_only, repeats = [128, 256, 512, 1024, 2048, 4096, 8192], [16384], args.repeats or 5
    gemm = statistics.median(gemm_rate(repeats) for _ in range(3))
    print_table(run(sizes, memory_only, repeats, gemm), gemm)
    t = max(sizes)
    full, causal, ratio = causal_speedup(t, max(repeats, 7))
    print()
    print(f"causal speed-up, attnjax auto forward at T=S={t}, interleaved: non-causal "
          f"{full * 1e3:.1f} ms, causal {causal * 1e3:.1f} ms, ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
