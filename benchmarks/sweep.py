"""attnjax against jax.nn.dot_product_attention over the shapes users run: training
steps and decoding steps, float32 and bfloat16, grouped-query heads, masks.

    python benchmarks/sweep.py [--repeats 21] [--quick]

Each row is `attnjax.dot_product_attention` (implementation=None) against
`jax.nn.dot_product_attention` (its XLA path) on the same arrays under jax.jit, forward,
or forward and backward (the gradients w.r.t. q, k and v of a sum of squares),
interleaved call by call: the median of --repeats rounds after three warm-up calls.
The masks are the ones jax.nn takes: is_causal on training shapes (T = S), and
key_value_seq_lengths (half to all of S) on decoding steps (T = 1). A row where attnjax
is slower is marked, and the last line counts them. --quick leaves out the two
largest shapes and takes 7 rounds.
"""

import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnjax  # noqa: E402
from _timing import Parser, median_times, positive_int  # noqa: E402
from _timing import run as run_main  # noqa: E402

# (B, T, S, N, K, H): training steps and prefills, T = S
TRAINING = [(4, 32, 32, 4, 4, 32), (64, 16, 16, 4, 4, 16), (8, 100, 100, 8, 8, 64),
            (2, 256, 256, 16, 4, 64), (1, 1024, 1024, 8, 2, 128), (1, 2048, 2048, 4, 4, 64)]
# decoding steps, T = 1, against a cache of S keys
DECODING = [(1, 1, 512, 8, 8, 64), (16, 1, 256, 8, 2, 64), (8, 1, 1024, 8, 2, 64),
            (64, 1, 128, 8, 2, 16), (1000, 1, 29, 4, 4, 16)]
LARGEST = 2   # of TRAINING, left out by --quick


def rows(quick: bool):
    """(shape, dtype, mask, backward) of every row."""
    training = TRAINING[:-LARGEST] if quick else TRAINING
    dtypes = (jnp.float32, jnp.bfloat16)
    for shape, dtype, mask, backward in itertools.product(
            training, dtypes, (None, "causal"), (False, True)):
        yield shape, dtype, mask, backward
    for shape, dtype, mask in itertools.product(DECODING, dtypes, (None, "lengths")):
        yield shape, dtype, mask, False


def timed(shape, dtype, mask, backward, repeats: int) -> dict:
    """Median seconds of each implementation on one row."""
    b, t, s, n, k, h = shape
    generator = np.random.default_rng(0)
    q, key, value = (jnp.asarray(generator.standard_normal(x), dtype)
                     for x in ((b, t, n, h), (b, s, k, h), (b, s, k, h)))
    options = {}
    if mask == "causal":
        options["is_causal"] = True
    elif mask == "lengths":
        options["key_value_seq_lengths"] = jnp.asarray(
            generator.integers(s // 2, s + 1, b), jnp.int32)

    def jitted(attend):
        if not backward:
            return jax.jit(lambda q, k, v: attend(q, k, v, **options))
        loss = lambda q, k, v: jnp.sum(attend(q, k, v, **options).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    fns = {"attnjax": jitted(attnjax.dot_product_attention),
           "jax.nn": jitted(jax.nn.dot_product_attention)}
    return median_times(fns, (q, key, value), repeats=repeats)


def main() -> None:
    parser = Parser(__doc__)
    parser.add_argument("--repeats", type=positive_int, default=None)
    parser.add_argument("--quick", action="store_true",
                        help="without the two largest shapes, 7 rounds")
    args = parser.parse_args()
    repeats = args.repeats or (7 if args.quick else 21)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; median of "
          f"{repeats} interleaved rounds")
    print("| B, T, S, N, K, H | dtype | mask | pass | attnjax ms | jax.nn ms | "
          "jax.nn / attnjax |")
    print("|---|---|---|---|---:|---:|---:|")
    slower = total = 0
    for shape, dtype, mask, backward in rows(args.quick):
        seconds = timed(shape, dtype, mask, backward, repeats)
        ratio = seconds["jax.nn"] / seconds["attnjax"]
        total += 1
        slower += ratio < 1
        print(f"| {', '.join(map(str, shape))} | {jnp.dtype(dtype).name} | {mask or 'none'} | "
              f"{'forward and backward' if backward else 'forward'} | "
              f"{seconds['attnjax'] * 1e3:.3f} | {seconds['jax.nn'] * 1e3:.3f} | "
              f"{ratio:.2f}{' (slower)' if ratio < 1 else ''} |", flush=True)
    print(f"\nattnjax slower than jax.nn in {slower} of {total} rows")


if __name__ == "__main__":
    run_main(main)
