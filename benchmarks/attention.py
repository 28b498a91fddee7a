"""attnjax's implementations against jax.nn and flax, in one process.

    python benchmarks/attention.py            # T = S from 128 to 8192, memory at 16384
    python benchmarks/attention.py --quick    # T = S in {256, 1024}, fewer repeats
    python benchmarks/attention.py --engine   # the GEMM rate and the engine's figures only

First the machine's float32 GEMM rate (a 2048³ `jnp.dot`), then for B=1, N=8, H=64,
float32: forward and forward+backward time (`block_until_ready`, median after warm-up
of ≥ 5 calls each timed in a run of its own from T = 2048; below, of ≥ 25 calls, 101
for T ≤ 256, interleaved call by call) of attnjax auto / dense / chunked, `jax.nn.dot_product_attention`
and `flax.linen.dot_product_attention`, causal and not. GFLOP/s counts 4·B·N·T·S·H for
the forward and the backward as 2.5× the forward (FlashAttention's count), so
forward+backward is 3.5× the forward, causal or not: a causal row's rate is the rate of
the full computation it stands in for. Memory is XLA's compiled temporary allocation
(`memory_analysis().temp_size_in_bytes`). Prints a markdown table.

Then the engine's figures, each pair timed interleaved in one process: document masking
(causal within 8 equal packed segments) against unmasked non-causal attention at
T=8192; `soft_cap` against plain attention at T=4096, forward and forward+backward; and
one decoding step (T=1, causal) against a 32,768-token cache, chunked against dense,
time and temporary memory.
"""

import os
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnjax  # noqa: E402
from attnjax import masks, scores  # noqa: E402
from _timing import Parser, median_times, multiple_of, positive_int  # noqa: E402
from _timing import run as run_main  # noqa: E402

B, N, H = 1, 8, 64
# Runs whose compiled temporaries exceed this are reported for memory only.
MAX_TIMED_TEMP_BYTES = 8 * 2**30


def _flax(q, k, v, causal):
    mask = attnjax.causal_mask(q.shape[1], k.shape[1])[None, None] if causal else None
    return nn.dot_product_attention(q, k, v, mask=mask)


# Timed interleaved, each round in an order of its own (see _timing.median_times): a
# call right after a dense peer has streamed its temporaries through memory is slower,
# and in a fixed order the first named always paid for the last.
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
                                             ("fwd+bwd", forward_backward_fn, 3.5)):
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


def _inputs(t: int, s: int | None = None):
    keys = jax.random.split(jax.random.key(t), 4)
    s = t if s is None else s
    return (jax.random.normal(keys[0], (B, t, N, H), jnp.float32),
            jax.random.normal(keys[1], (B, s, N, H), jnp.float32),
            jax.random.normal(keys[2], (B, s, N, H), jnp.float32),
            jax.random.normal(keys[3], (B, t, N, H), jnp.float32))


def document_masking(t: int, repeats: int) -> tuple[float, float]:
    """Forward of causal attention within 8 equal segments, and of unmasked non-causal
    attention of the same shape: seconds each (chunked, timed in runs of their own)."""
    args = _inputs(t)
    # [1, T]: eight packed documents
    ids = jnp.repeat(jnp.arange(8, dtype=jnp.int32), t // 8)[None]
    fns = {
        "documents": jax.jit(lambda q, k, v, d: attnjax.dot_product_attention(
            q, k, v, mask=masks.causal() & masks.segments(ids), implementation="chunked")),
        "unmasked": jax.jit(lambda q, k, v, d: attnjax.dot_product_attention(
            q, k, v, implementation="chunked")),
    }
    times = median_times(fns, args, repeats=repeats, warmup=1, interleave=False)
    return times["documents"], times["unmasked"]


def _gemm_alongside(q, k, v, d):
    """A float32 GEMM [2048, L] × [L, 2048] of the attention inputs themselves (L = 1024
    at T=S=4096), timed interleaved with attention: a rate measured under the same load
    as the peer it divides."""
    return jnp.dot(q.reshape(2048, -1), k.reshape(-1, 2048))


def soft_cap_cost(t: int, repeats: int) -> dict:
    """Seconds of the chunked forward and forward+backward, plain and soft-capped, and
    of a GEMM (`_gemm_alongside`) timed interleaved with them, with its FLOPs."""
    args = _inputs(t)
    plain = lambda q, k, v, c: attnjax.dot_product_attention(  # noqa: E731
        q, k, v, implementation="chunked")
    capped = lambda q, k, v, c: attnjax.dot_product_attention(  # noqa: E731
        q, k, v, implementation="chunked", score_mod=scores.soft_cap(30.0))
    gemm_flops = 2 * 2048 * (B * t * N * H // 2048) * 2048
    result = {}
    for pass_name, make in (("fwd", forward_fn), ("fwd+bwd", forward_backward_fn)):
        fns = {"plain": jax.jit(make(plain, False)), "soft_cap": jax.jit(make(capped, False)),
               "gemm": jax.jit(_gemm_alongside)}
        times = median_times(fns, args, repeats=repeats, warmup=1, interleave=True)
        result[pass_name] = (times["plain"], times["soft_cap"], gemm_flops / times["gemm"] / 1e9)
    return result


def cached_decoding(cache: int, repeats: int) -> dict:
    """One causal decoding step (T = 1) against `cache` keys: (seconds, temp bytes) of
    the dense and the chunked kernel."""
    q, k, v, _ = _inputs(1, cache)
    fns, temps = {}, {}
    for name in ("dense", "chunked"):
        fns[name], temps[name] = compiled(
            lambda q, k, v, name=name: attnjax.dot_product_attention(
                q, k, v, is_causal=True, implementation=name), (q, k, v))
    times = median_times(fns, (q, k, v), repeats=repeats, warmup=3, interleave=True)
    return {name: (times[name], temps[name]) for name in fns}


def print_engine(gemm: float, repeats: int, long_t: int, mid_t: int, cache: int) -> None:
    print()
    print("Masks and score modifications (chunked kernel, B=1 N=8 H=64 float32):")
    print()
    documents, unmasked = document_masking(long_t, repeats)
    print(f"- document masking, causal within 8 equal segments, T=S={long_t}, forward: "
          f"{documents * 1e3:.1f} ms against {unmasked * 1e3:.1f} ms unmasked non-causal: "
          f"{unmasked / documents:.2f}× its speed")
    for pass_name, (plain, capped, gemm_now) in soft_cap_cost(mid_t, repeats).items():
        rate = 4 * B * N * mid_t * mid_t * H * (1.0 if pass_name == "fwd" else 3.5) / plain / 1e9
        print(f"- soft_cap(30), T=S={mid_t}, {pass_name}: {capped * 1e3:.1f} ms against "
              f"{plain * 1e3:.1f} ms plain: {100 * (capped / plain - 1):+.1f}%; plain at "
              f"{rate:.1f} GFLOP/s = {100 * rate / gemm:.0f}% of the GEMM rate above, "
              f"{100 * rate / gemm_now:.0f}% of a GEMM timed interleaved with it "
              f"({gemm_now:.1f} GFLOP/s)")
    decode = cached_decoding(cache, max(repeats, 21))
    (dense_s, dense_b), (chunked_s, chunked_b) = decode["dense"], decode["chunked"]
    print(f"- one decoding step against a {cache}-token cache: chunked {chunked_s * 1e3:.2f} ms "
          f"and {chunked_b / 2**20:.2f} MiB temporary, dense {dense_s * 1e3:.2f} ms and "
          f"{dense_b / 2**20:.2f} MiB: chunked {dense_s / chunked_s:.2f}× the speed, "
          f"{chunked_b / dense_b:.3f} of the memory")


def main() -> None:
    parser = Parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="T = S in {256, 1024}, 3 repeats")
    parser.add_argument("--repeats", type=positive_int, default=None)
    parser.add_argument("--sizes", type=multiple_of(8), nargs="+",
                        help="T = S values to time (multiples of 8); the engine's figures "
                             "then at the largest")
    parser.add_argument("--engine", action="store_true",
                        help="only the GEMM rate and the masks / score_mod / decoding figures")
    args = parser.parse_args()
    if args.sizes:
        sizes, memory_only, repeats = args.sizes, [], args.repeats or 5
    elif args.quick:
        sizes, memory_only, repeats = [256, 1024], [], args.repeats or 3
    else:
        sizes, memory_only, repeats = [128, 256, 512, 1024, 2048, 4096, 8192], [16384], args.repeats or 5
    gemm = statistics.median(gemm_rate(repeats) for _ in range(3))
    if args.engine:
        print(f"float32 GEMM rate (2048³ jnp.dot): {gemm:.1f} GFLOP/s; "
              f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    else:
        print_table(run(sizes, memory_only, repeats, gemm), gemm)
        t = max(sizes)
        full, causal, ratio = causal_speedup(t, max(repeats, 7))
        print()
        print(f"causal speed-up, attnjax auto forward at T=S={t}, interleaved: non-causal "
              f"{full * 1e3:.1f} ms, causal {causal * 1e3:.1f} ms, ratio {ratio:.2f}")
    if args.sizes:
        t = max(args.sizes)
        print_engine(gemm, repeats, long_t=t, mid_t=t, cache=4 * t)
    elif args.quick:
        print_engine(gemm, repeats, long_t=2048, mid_t=1024, cache=4096)
    else:
        print_engine(gemm, repeats, long_t=8192, mid_t=4096, cache=32768)


if __name__ == "__main__":
    run_main(main)
