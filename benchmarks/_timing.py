"""Timing helpers shared by the benchmarks: medians after warm-up, peers interleaved."""

import statistics
import time

import jax


def median_times(fns: dict, args: tuple, *, repeats: int = 21, warmup: int = 3) -> dict:
    """Median seconds per call of each jitted fn, calls interleaved so drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in samples.items()}
