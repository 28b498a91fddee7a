"""A training step of multi-head attention: attnjax against flax, on the same machine.

    python benchmarks/train_step.py [--repeats 101] [--max-length 4096] [--only-model]
                                    [--dtype bfloat16]

The step is the loss of one `MultiHeadDotProductAttention` layer (causal self-attention,
a sum of squares of its output against fresh random targets) and its gradients with
respect to the parameters and the inputs, under jax.jit, float32 (--dtype: the layers'
computation dtype, float32 parameters), at the shapes
(B, T, D, N) where attnjax's users train: the toy tasks' (32, 64, 128, 4), a mid-size
(8, 512, 256, 8) and a long (1, 4096, 512, 8) sequence. Both modules share one set of
parameters (attnjax's tree is flax's). Then a whole training step (loss, gradients,
Adam update) of the toy copy model, built once on attnjax's attention and once on
flax's. Each pair is timed interleaved call by call (median after warm-up); the ratio
is flax's time over attnjax's (> 1: attnjax faster). Beside it, timed in the same
interleaved run: where implementation=None picks the chunked kernel, the same ratio with
the dense kernel; and on a CPU where the dense kernel runs on parts of the batch, the
ratio with the dense kernel on the batch whole. XLA's temporary memory of each compiled step is printed too, and
the seconds it took to lower and compile (the causal steps close over flax's constant
causal mask, as a flax user's do).
"""

import contextlib
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnjax  # noqa: E402
import attnjax.attention  # noqa: E402,F401
from attnjax import masks, nn  # noqa: E402
from attnjax.nn import models  # noqa: E402
from attnjax.parallel import mesh as mesh_lib  # noqa: E402
from attnjax.toy import make_task  # noqa: E402
from attnjax.toy import train as training  # noqa: E402
from attnjax.toy.config import load_config  # noqa: E402
from _timing import Parser, median_times, positive_int  # noqa: E402
from _timing import run as run_main  # noqa: E402

# the module, not the function of the same name that attnjax exports
attention_module = sys.modules["attnjax.attention"]

COPY_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "copy.yaml"

SHAPES = [(32, 64, 128, 4), (8, 512, 256, 8), (1, 4096, 512, 8)]


def long_repeats(repeats: int) -> int:
    """The steps timed at T = 4096, where one takes about a second."""
    return max(3, repeats // 20)


def _compiled(fn, *args):
    """The compiled fn, its XLA temp memory (bytes) and its lowering and compile time
    (seconds)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - start
    return compiled, compiled.memory_analysis().temp_size_in_bytes, seconds


def attention_step(module_cls, shape, causal: bool, dtype=jnp.float32):
    """The jitted step of one attention layer and its arguments."""
    b, t, d, n = shape
    kx, ky, kp = jax.random.split(jax.random.key(t), 3)
    x = jax.random.normal(kx, (b, t, d), jnp.float32)
    target = jax.random.normal(ky, (b, t, d), jnp.float32)
    params = nn.MultiHeadDotProductAttention(num_heads=n).init(kp, x)["params"]
    mask = fnn.make_causal_mask(jnp.ones((b, t)), dtype=jnp.bool_) if causal else None
    module = module_cls(num_heads=n, dtype=dtype)

    def loss(params, x):
        out = module.apply({"params": params}, x, mask=mask)
        return jnp.mean((out.astype(jnp.float32) - target) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1)), (params, x.astype(dtype))


def _as_array(mask, positions, b: int, t: int, s: int):
    """An `attnjax.Mask` as the bool `[B, 1, T, S]` array a flax user passes, from the
    rule's own comparisons of indices and positions (what flax's `make_attention_mask`
    and `make_causal_mask` compute), not from an attention call."""
    bound = mask.bind(masks.Shape(b, t, s, 1), positions)
    # [B, ...]: each example's own slice of the rule's arrays
    per_example = jax.tree.map(lambda x: jnp.broadcast_to(x, (b, 1) + x.shape[2:])[:, 0],
                               bound)
    grid = jax.vmap(lambda rule: rule.visible(rule.coords(0, t, 0, s)))(per_example)
    return grid[:, None]


class FlaxAttention(fnn.MultiHeadDotProductAttention):
    """flax's attention with the call of attnjax's: the Mask (and is_causal) become a
    bool array, then flax's module runs. The copy model's other fields are unused
    (default values)."""

    num_kv_heads: Any = None
    implementation: Any = None
    score_mod: Any = None
    use_sinks: bool = False
    is_causal: bool = False
    score: Any = "scaled_dot"
    projection_activation: Any = None
    cache_key_value: bool = False

    def __call__(self, inputs_q, inputs_k=None, *, mask=None, positions=None,
                 deterministic=None, sow_weights=False):
        inputs_k = inputs_q if inputs_k is None else inputs_k
        rule = masks.everything() if mask is None else mask
        rule = rule & masks.causal() if self.is_causal else rule
        dense = _as_array(rule, positions, inputs_q.shape[0], inputs_q.shape[1],
                          inputs_k.shape[1])
        return super().__call__(inputs_q, inputs_k, mask=dense, deterministic=deterministic,
                                sow_weights=sow_weights)


@contextlib.contextmanager
def _set(module, name: str, value):
    """module.name is value while inside: the models built (the attention class) or the
    steps traced (the dense kernel's parts) then use it."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def copy_model_step(attention_cls):
    """The default copy config's whole training step (loss, gradients, AdamW update),
    jitted and compiled with `attention_cls` in every layer, and its arguments."""
    config = load_config(COPY_CONFIG)
    task = make_task(config.task)
    mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
    optimizer = training.make_optimizer(config.optim, config.steps)
    with _set(models, "MultiHeadAttention", attention_cls):
        model = training.make_model(config, task)
        state = training.init_state(model, optimizer, task, config.seed, mesh)
        batch = training.train_batch(task, config, 0, mesh)

        def step(state, batch):
            grads, metrics = jax.grad(training.loss_and_metrics, has_aux=True)(
                state.params, batch, model, config.optim.label_smoothing)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state, metrics["loss"]

        compiled, temp, _ = _compiled(step, state, batch)
    return compiled, temp, (state, batch)


def main() -> None:
    parser = Parser(__doc__)
    # A step of a few ms varies by tens of percent call to call on a small VM (page
    # faults, caches): the median of 21 moved the smallest size's ratio by up to 15%
    # from run to run.
    parser.add_argument("--repeats", type=positive_int, default=101)
    parser.add_argument("--only-model", action="store_true", help="time the whole copy-model step only")
    parser.add_argument("--max-length", type=positive_int, default=SHAPES[-1][1],
                        help="time only the shapes of at most this T (default: all)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the attention layers' computation dtype (the copy model: float32)")
    args = parser.parse_args()
    if args.max_length < SHAPES[0][1] and not args.only_model:
        parser.error(f"argument --max-length: the shortest shape has T = {SHAPES[0][1]}; got "
                     f"{args.max_length} (--only-model times the copy model alone)")
    dtype = jnp.dtype(args.dtype)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, {dtype}; "
          f"median of {args.repeats} interleaved steps ({long_repeats(args.repeats)} at T = 4096)")
    print()
    print("| B, T, D, N | mask | kernel | attnjax ms | flax ms | flax / attnjax | flax / "
          "attnjax, dense | flax / attnjax, dense, batch whole | temp MiB attnjax / flax | "
          "compile s attnjax / flax |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    dense_cls = functools.partial(nn.MultiHeadDotProductAttention, implementation="dense")
    for shape in [] if args.only_model else [size for size in SHAPES if size[1] <= args.max_length]:
        b, t, _, n = shape
        kernel = attention_module._auto_kernel(b, t, t, n)
        # the dense kernel where the chunked one is picked for a grid dense can take (at
        # T = 4096 the dense kernel is what flax runs); its parts of the batch on a CPU,
        # and the same step without them
        peers = {"dense": kernel == "chunked" and t * t <= attention_module.AUTO_CHUNKED_ABOVE,
                 "whole": attention_module._dense_parts(b, t, t, n) > 1}
        for causal in (True, False):
            fns, temps, compile_s = {}, {}, {}
            for name, cls in (("attnjax", nn.MultiHeadDotProductAttention),
                              ("flax", fnn.MultiHeadDotProductAttention)):
                step, step_args = attention_step(cls, shape, causal, dtype)
                fns[name], temps[name], compile_s[name] = _compiled(step, *step_args)
            dense_step = lambda: _compiled(  # noqa: E731
                attention_step(dense_cls, shape, causal, dtype)[0], *step_args)[0]
            if peers["dense"]:
                fns["dense"] = dense_step()
            if peers["whole"]:
                with _set(attention_module, "DENSE_PARTS_MAX", 1):  # batch whole
                    fns["whole"] = dense_step()
            repeats = args.repeats if shape[1] < 4096 else long_repeats(args.repeats)
            times = median_times(fns, step_args, repeats=repeats, warmup=2)
            ratio = lambda name: (  # noqa: E731
                f"{times['flax'] / times[name]:.2f}" if name in fns else "—")
            print(f"| {', '.join(map(str, shape))} | {'causal' if causal else 'none'} | "
                  f"{kernel} | {times['attnjax'] * 1e3:.2f} | {times['flax'] * 1e3:.2f} | "
                  f"{ratio('attnjax')} | {ratio('dense')} | {ratio('whole')} | "
                  f"{temps['attnjax'] / 2**20:.1f} / {temps['flax'] / 2**20:.1f} | "
                  f"{compile_s['attnjax']:.2f} / {compile_s['flax']:.2f} |")
    print()
    fns, temps = {}, {}
    for name, cls in (("attnjax", models.MultiHeadAttention), ("flax", FlaxAttention)):
        fns[name], temps[name], step_args = copy_model_step(cls)
    times = median_times(fns, step_args, repeats=args.repeats, warmup=3)
    print(f"whole copy-model train step (configs/copy.yaml, batch {step_args[1].src.shape[0]}): "
          f"attnjax {times['attnjax'] * 1e3:.2f} ms, flax {times['flax'] * 1e3:.2f} ms, "
          f"flax / attnjax {times['flax'] / times['attnjax']:.2f}; temp MiB "
          f"{temps['attnjax'] / 2**20:.1f} / {temps['flax'] / 2**20:.1f}")


if __name__ == "__main__":
    run_main(main)
