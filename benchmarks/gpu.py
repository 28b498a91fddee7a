"""attnjax on a GPU: every implementation's error and speed beside jax.nn's, in one process.

    python benchmarks/gpu.py            # errors, then causal forward+backward timings
    python benchmarks/gpu.py --quick    # a small shape only (runs on a CPU too)

First, each implementation's largest error against a float64 reference (a plain jnp
softmax(q·kᵀ/√H)·v, in float64 on the very inputs the implementation gets, rounded to
its dtype: the error is the implementation's, not the inputs' rounding; outputs and
gradients come back in that dtype, whose own rounding is most of a 16-bit error), output
and gradients of a causal call at (B, T, N, H) = (2, 256, 4, 64), with every key and
with key lengths (T, 0): the second example sees no key, and the
`empty` column is the largest magnitude in its output (attnjax gives zeros; jax.nn
averages the values, or cuDNN leaves its own). float32 is measured at XLA's default
precision (TF32 products on recent NVIDIA GPUs) and under
`jax.default_matmul_precision("highest")`. Then causal attention's forward and backward
under jax.jit, every implementation timed interleaved call by call (median of 15 after
2 warm-up calls), in ms. The cudnn columns need a CUDA GPU and float16 or bfloat16; dense
attention is left out where its float32 logits would exceed 16 GiB.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnjax  # noqa: E402
from _timing import Parser, median_times  # noqa: E402
from _timing import run as run_main  # noqa: E402

# (B, T, N, H, dtype) of the timings
SIZES = [(32, 64, 4, 32, "float32"), (8, 512, 8, 32, "float32"),
         (4, 2048, 16, 128, "bfloat16"), (1, 8192, 16, 128, "bfloat16"),
         (1, 16384, 8, 128, "bfloat16"), (1, 32768, 8, 128, "bfloat16")]
DENSE_MAX_BYTES = 16 * 2**30


def ours(implementation, key_lengths=None):
    return lambda q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, key_lengths=key_lengths, implementation=implementation)


def theirs(implementation, key_lengths=None):
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=key_lengths,
        implementation=implementation)


def implementations(dtype, key_lengths=None) -> dict:
    """name -> attention fn; cuDNN only on a CUDA GPU in 16 bits."""
    fns = {f"attnjax {name}": ours(name, key_lengths) for name in (None, "dense", "chunked")}
    fns["jax.nn xla"] = theirs("xla", key_lengths)
    if jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2:
        fns["attnjax cudnn"] = ours("cudnn", key_lengths)
        fns["jax.nn cudnn"] = theirs("cudnn", key_lengths)
    return fns


def value_and_grads(fn, cotangent):
    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def reference(key_lengths=None):
    """Causal attention in plain jnp (float64 where the inputs are): rows that see no
    key give zeros, as attnjax's do."""
    def attend(q, k, v):
        t = q.shape[1]
        logits = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
        seen = jnp.tril(jnp.ones((t, t), bool))[None, None]
        if key_lengths is not None:
            seen = seen & (jnp.arange(t) < jnp.asarray(key_lengths)[:, None, None, None])
        weights = jax.nn.softmax(jnp.where(seen, logits, -1e300), axis=-1)
        weights = jnp.where(seen.any(-1, keepdims=True), weights, 0.0)
        return jnp.einsum("bnts,bsnh->btnh", weights, v)
    return attend


def errors(b=2, t=256, n=4, h=64) -> None:
    """The error table, in float64 (jax's x64 on for it alone: the timings run as a user
    runs them)."""
    with jax.enable_x64(True):
        _errors(b, t, n, h)


def _errors(b, t, n, h) -> None:
    rng = np.random.default_rng(0)
    q, k, v, cotangent = (rng.standard_normal((b, t, n, h)) for _ in range(4))
    lengths = np.array([t, 0], np.int32)
    print(f"errors against float64, causal, (B, T, N, H) = ({b}, {t}, {n}, {h}); "
          f"device {jax.devices()[0].device_kind}, jax {jax.__version__}\n")
    print("| implementation | dtype | keys | output | gradients | empty |")
    print("|---|---|---|---:|---:|---:|")
    cases = [(d, None) for d in ("float32", "bfloat16", "float16")] + [("float32", "highest")]
    for dtype, precision in cases:
        for keys, key_lengths in (("all", None), ("lengths", lengths)):
            if precision is not None and key_lengths is not None:
                continue
            rows = slice(None) if key_lengths is None else slice(0, 1)   # example 0
            args = [jnp.asarray(x, dtype) for x in (q, k, v)]
            # the reference on the rounded inputs, in float64
            (_, ref), ref_grads = value_and_grads(reference(key_lengths), cotangent)(
                *(x.astype(jnp.float64) for x in args))
            for name, fn in implementations(dtype, key_lengths).items():
                try:
                    with jax.default_matmul_precision(precision or "default"):
                        (_, out), grads = value_and_grads(fn, cotangent)(*args)
                except Exception as e:  # an implementation that refuses the case
                    print(f"| {name} | {dtype} | {keys} | {type(e).__name__}: "
                          f"{str(e)[:80]} | | |")
                    continue
                out = np.asarray(out, np.float64)
                grads = [np.asarray(g, np.float64) for g in grads]
                finite = np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)
                e_out = np.abs(out[rows] - np.asarray(ref)[rows]).max()
                e_grad = max(np.abs(g[rows] - np.asarray(r)[rows]).max()
                             for g, r in zip(grads, ref_grads))
                empty = "" if key_lengths is None else f"{np.abs(out[1]).max():.2e}"
                label = dtype + (f", {precision}" if precision else "")
                print(f"| {name} | {label} | {keys} | {e_out:.2e} | {e_grad:.2e} | {empty}"
                      + ("" if finite else " NON-FINITE") + " |")


def timings(sizes) -> None:
    rng = np.random.default_rng(1)
    print("\ncausal forward+backward, median ms, interleaved; None: attnjax's choice\n")
    names = list(implementations(jnp.bfloat16))
    print("| (B, T, N, H), dtype | " + " | ".join(names) + " | jax.nn xla / attnjax None |")
    print("|---|" + "---:|" * (len(names) + 1))
    for b, t, n, h, dtype in sizes:
        q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h)), dtype) for _ in range(3))
        fns = {}
        for name, fn in implementations(dtype).items():
            if name in ("attnjax dense", "jax.nn xla") and b * n * t * t * 4 > DENSE_MAX_BYTES:
                continue
            fns[name] = jax.jit(jax.grad(
                lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                argnums=(0, 1, 2)))
        ms = {name: s * 1e3 for name, s in median_times(fns, (q, k, v), repeats=15,
                                                          warmup=2).items()}
        ratio = (f"{ms['jax.nn xla'] / ms['attnjax None']:.2f}" if "jax.nn xla" in ms
                 else "—")
        cells = [f"{ms[name]:.3f}" if name in ms else "—" for name in names]
        print(f"| ({b}, {t}, {n}, {h}), {dtype} | " + " | ".join(cells) + f" | {ratio} |")


def main() -> None:
    parser = Parser(__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="the smallest size only (runs on a CPU too)")
    args = parser.parse_args()
    if jax.default_backend() != "gpu" and not args.quick:
        parser.error(f"the full run needs a GPU (its sizes would take hours on "
                     f"{jax.default_backend()!r}); --quick runs the smallest size anywhere")
    errors()
    timings(SIZES[:1] if args.quick else SIZES)


if __name__ == "__main__":
    run_main(main)
