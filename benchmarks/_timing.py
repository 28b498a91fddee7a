"""Timing helpers shared by the benchmarks: medians after warm-up."""

import random
import statistics
import time

import jax


def median_times(fns: dict, args: tuple, *, repeats: int = 21, warmup: int = 3,
                 interleave: bool = True) -> dict:
    """Median seconds per call of each jitted fn.

    interleave=True alternates the fns call by call, so slow drift of the machine hits
    all alike; use it for peers of similar size. Each round takes them in an order of
    its own (shuffled, seeded), so that each follows every other alike: a call right
    after one that freed large temporaries is slower (its caches cold, its memory
    handed back to the system and faulted in again), and in a fixed order the same fn
    always paid it (attnjax's `None` at T=1024, always timed after flax's 64 MiB,
    measured 11.7 ms against 8.4 ms for the same program named "chunked").
    interleave=False times each fn in a run of its own, so a peer that streams gigabytes
    through memory does not evict the caches of the one timed after it.
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
        names, order = list(fns), random.Random(0)
        for _ in range(repeats):
            order.shuffle(names)
            for name in names:
                call(name)
    else:
        for name, fn in fns.items():
            for _ in range(warmup):
                jax.block_until_ready(fn(*args))
            for _ in range(repeats):
                call(name)
    return {name: statistics.median(ts) for name, ts in samples.items()}
