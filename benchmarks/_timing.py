"""Helpers shared by the benchmarks: medians after warm-up, and their command lines
(a mistake is one line and exit 2, Ctrl-C one line and exit 130)."""

import argparse
import random
import statistics
import sys
import time

import jax


class Parser(argparse.ArgumentParser):
    """A benchmark's parser: described by its docstring's first paragraph, and a mistake
    is one line, exit 2 (argparse prints its usage first)."""

    def __init__(self, doc: str, **kwargs):
        super().__init__(description=" ".join(doc.split("\n\n")[0].split()), **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int; got {value}")
    return value


def multiple_of(step: int):
    """An argparse type: a positive int that is a multiple of `step`."""
    def parse(text: str) -> int:
        value = positive_int(text)
        if value % step:
            raise argparse.ArgumentTypeError(f"must be a multiple of {step}; got {value}")
        return value
    return parse


def run(main) -> None:
    """main(), with Ctrl-C (or SIGINT) ending it in one line and exit 130."""
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


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
    if repeats < 1 or warmup < 0:
        raise ValueError(f"median_times needs repeats >= 1 and warmup >= 0; got {repeats}, "
                         f"{warmup}")
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
