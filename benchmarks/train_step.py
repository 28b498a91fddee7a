"""A training step of multi-head attention: attnjax against flax, on the same machine.

    python benchmarks/train_step.py [--repeats 21]

The step is the loss of one `MultiHeadDotProductAttention` layer (causal self-attention,
a sum of squares of its output against fresh random targets) and its gradients with
respect to the parameters and the inputs, under jax.jit, float32, at the shapes
(B, T, D, N) where attnjax's users train: the toy tasks' (32, 64, 128, 4), a mid-size
(8, 512, 256, 8) and a long (1, 4096, 512, 8) sequence. Both modules share one set of
parameters (attnjax's tree is flax's). Then a whole training step (loss, gradients,
Adam update) of the toy copy model, built once on attnjax's attention and once on
flax's. Each pair is timed interleaved call by call (median after warm-up); the ratio
is flax's time over attnjax's (> 1: attnjax faster). XLA's temporary memory of each
compiled step is printed beside it.
"""

import argparse
import os
import sys

import flax.linen as fnn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnjax import nn  # noqa: E402
from _timing import median_times  # noqa: E402

SHAPES = [(32, 64, 128, 4), (8, 512, 256, 8), (1, 4096, 512, 8)]


def _compiled(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, compiled.memory_analysis().temp_size_in_bytes


def attention_step(module_cls, shape, causal: bool):
    """The jitted step of one attention layer and its arguments."""
    b, t, d, n = shape
    kx, ky, kp = jax.random.split(jax.random.key(t), 3)
    x = jax.random.normal(kx, (b, t, d), jnp.float32)
    target = jax.random.normal(ky, (b, t, d), jnp.float32)
    params = nn.MultiHeadDotProductAttention(num_heads=n).init(kp, x)["params"]
    mask = fnn.make_causal_mask(jnp.ones((b, t)), dtype=jnp.bool_) if causal else None
    module = module_cls(num_heads=n)

    def loss(params, x):
        out = module.apply({"params": params}, x, mask=mask)
        return jnp.mean((out - target) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1)), (params, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, float32; "
          f"median of {args.repeats} interleaved steps")
    print()
    print("| B, T, D, N | mask | attnjax ms | flax ms | flax / attnjax | temp MiB attnjax / flax |")
    print("|---|---|---:|---:|---:|---:|")
    for shape in SHAPES:
        for causal in (True, False):
            fns, temps = {}, {}
            for name, cls in (("attnjax", nn.MultiHeadDotProductAttention),
                              ("flax", fnn.MultiHeadDotProductAttention)):
                step, step_args = attention_step(cls, shape, causal)
                fns[name], temps[name] = _compiled(step, *step_args)
            repeats = args.repeats if shape[1] < 4096 else max(3, args.repeats // 4)
            times = median_times(fns, step_args, repeats=repeats, warmup=2)
            print(f"| {', '.join(map(str, shape))} | {'causal' if causal else 'none'} | "
                  f"{times['attnjax'] * 1e3:.2f} | {times['flax'] * 1e3:.2f} | "
                  f"{times['flax'] / times['attnjax']:.2f} | "
                  f"{temps['attnjax'] / 2**20:.1f} / {temps['flax'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
