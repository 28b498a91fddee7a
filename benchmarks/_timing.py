"""Timing helpers shared by the benchmarks: medians after warm-up."""

import statistics
import time

import jax


def median_times(fns: dict, args: tuple, *, repeats: int = 21, warmup: int = 3,
                 interleave: bool = True) -> dict:
    """Median seconds per call of each jitted fn.

    interleave=True alternates the fns call by call, so slow drift of the machine hits
    all alike; use it for peers of similar size. interleave=False times each fn in a
    run of its own, so a peer that streams gigabytes through memory does not evict the
    caches of the one timed after it.
    """
    samples = {name: [] for name in fns}

    def call(name):
        start = time.perf_counter()
        jax.block_until_ready(fns[name](*args))
        samples[name].append(time.perf_counter() - start)

    if interleave:
        for fn in fns.values():
            for _ in range(warmup):
                jax.block_until_ready(fn(*args))
        for _ in range(repeats):
            for name in fns:
                call(name)
    else:
        for name, fn in fns.items():
            for _ in range(warmup):
                jax.block_until_ready(fn(*args))
            for _ in range(repeats):
                call(name)
    return {name: statistics.median(ts) for name, ts in samples.items()}
