"""Ring attention on 4 devices: the balanced (zig-zag) causal ring against the plain
(contiguous) one, per-device memory against one device holding the whole sequence (the
attention alone, and a decoder-only model's training step with its sequence split
over "seq"), against dense attention on the same 4 devices (memory) and against
chunked attention on one device (time).

Balance. With a causal mask the plain ring's device 0 sees one shard and device 3
all four; the zig-zag layout (device i holds chunks i and 2P − 1 − i, laid out once
at the input as the trainer does) gives every device the same work. Both skip the
steps they cannot see. Each ring step waits for the slowest device, so on devices
with compute of their own the plain ring takes half a step (its own shard) and P − 1
whole ones, the balanced ring P half steps: 2 − 1/P times faster (1.75× for P = 4);
emulated devices sharing a CPU's cores add up everyone's work instead, and show
little. So the benchmark also times each device's step alone and sums, over the
steps, the slowest device's, and compares that with the wall clock: about 1 where the
emulated devices ran side by side as devices of their own would (XLA's CPU runtime
runs the devices concurrently: 1.02 on 16 cores), well above 1 where they share the
cores (2 cores for 4 devices).

Memory is XLA's compiled temporary allocation per device
(`memory_analysis().temp_size_in_bytes` of the SPMD program, which is per device), with
the sequence sharded over the 4 devices for both ring and dense (XLA partitions the
dense computation as it sees fit). On a CPU the 4 devices are emulated
(`--xla_force_host_platform_device_count=4`) and share its cores, so the time shows the
ring's overhead on the same total work, not a speed-up.

Three masks: none, causal, and causal over 8 packed documents of uneven lengths
(`segment_ids`; their boundaries cross the shards).

    python benchmarks/ring.py [--length 16384] [--repeats 3] [--only-balance]
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()

import contextlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attnjax  # noqa: E402
from _timing import Parser, median_times, positive_int  # noqa: E402
from _timing import run as run_main  # noqa: E402
from attnjax import masks  # noqa: E402
from attnjax.nn import DecoderOnly, DecoderOnlyConfig  # noqa: E402
from attnjax.nn.attention import attention_engine  # noqa: E402
from attnjax.parallel import context, ring, ring_self_attention  # noqa: E402
from attnjax.parallel import mesh as mesh_lib  # noqa: E402
from attnjax.core import MASKED  # noqa: E402
from attnjax.scores import Score  # noqa: E402

MIB = 2 ** 20


def temp_mib(fn, args, **jit_kwargs) -> float:
    compiled = jax.jit(fn, **jit_kwargs).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / MIB


def main():
    parser = Parser(__doc__)
    parser.add_argument("--length", type=positive_int, default=16384,
                        help="T = S, a multiple of 8 (two chunks a device on 4 devices)")
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--only-balance", action="store_true",
                        help="the balance and per-device memory tables only")
    args = parser.parse_args()
    if args.length % 8:
        parser.error(f"argument --length: must be a multiple of 8 (two chunks a device on 4 "
                     f"devices); got {args.length}")
    t, n, h = args.length, args.heads, args.head_dim
    devices = jax.devices()[:4]
    mesh = Mesh(np.asarray(devices), ("seq",))
    sharded = NamedSharding(mesh, PartitionSpec(None, "seq", None, None))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (1, t, n, h), jnp.float32) for key in keys)
    on_mesh = [jax.device_put(x, sharded) for x in (q, k, v, d_out)]
    print(f"B=1 T=S={t} N={n} H={h} float32, {len(devices)} {devices[0].platform} devices, "
          f"jax {jax.__version__}\n")

    balance(q, k, v, d_out, mesh, args.repeats)
    model_memory(t, devices)
    if args.only_balance:
        return

    ids = packed_ids(t, documents=8)
    # mask -> (ring_self_attention's keywords, dot_product_attention's)
    cases = {
        "none": (dict(), dict()),
        "causal": (dict(is_causal=True), dict(is_causal=True)),
        "causal, 8 packed documents": (dict(is_causal=True, segment_ids=ids),
                                       dict(is_causal=True, mask=masks.segments(ids))),
    }

    def ring(case):
        return lambda q, k, v: ring_self_attention(q, k, v, mesh, **cases[case][0])

    def single(case, implementation):
        return lambda q, k, v: attnjax.dot_product_attention(
            q, k, v, implementation=implementation, **cases[case][1])

    def with_grad(fn):
        def loss(q, k, v, d_out):
            return jnp.sum(fn(q, k, v) * d_out)
        return jax.grad(loss, argnums=(0, 1, 2))

    print("\n| mask | pass | ring, 4 devices | dense, 4 devices | dense / ring |")
    print("|---|---|---:|---:|---:|")
    for case in cases:
        for name, wrap, inputs in (("fwd", lambda f: f, on_mesh[:3]),
                                   ("fwd+bwd", with_grad, on_mesh)):
            kwargs = dict(out_shardings=sharded) if name == "fwd" else {}
            ring_mib = temp_mib(wrap(ring(case)), inputs, **kwargs)
            dense_mib = temp_mib(wrap(single(case, "dense")), inputs, **kwargs)
            print(f"| {case} | {name} | {ring_mib:.1f} MiB | {dense_mib:.1f} MiB | "
                  f"{dense_mib / ring_mib:.2f} |", flush=True)

    print("\n| mask | ring forward, 4 devices | chunked forward, 1 device | ring / chunked |")
    print("|---|---:|---:|---:|")
    for case in cases:
        times = {
            "ring": median_times({"ring": jax.jit(ring(case))}, tuple(on_mesh[:3]),
                                 repeats=args.repeats, warmup=1)["ring"],
            "chunked": median_times({"chunked": jax.jit(single(case, "chunked"))}, (q, k, v),
                                    repeats=args.repeats, warmup=1)["chunked"],
        }
        print(f"| {case} | {times['ring'] * 1e3:.0f} ms | {times['chunked'] * 1e3:.0f} ms | "
              f"{times['ring'] / times['chunked']:.2f} |", flush=True)


def balance(q, k, v, d_out, mesh, repeats: int):
    """The causal ring, zig-zag against contiguous, on shards laid out once; per-device
    temporary memory against one device holding the whole sequence."""
    p = mesh.shape["seq"]
    t = q.shape[1]
    spec = PartitionSpec(None, "seq", None, None)
    sharded = NamedSharding(mesh, spec)

    def ring_fn(layout, mesh=mesh):
        return jax.shard_map(
            lambda q, k, v: ring.ring_attention(q, k, v, axis_name="seq", is_causal=True,
                                                layout=layout),
            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)

    def with_grad(fn):
        return jax.grad(lambda q, k, v, d_out: jnp.sum(fn(q, k, v) * d_out), argnums=(0, 1, 2))

    # The layout decides the positions each shard holds; the values are any (and the
    # same for both): the zig-zag inputs are laid out once, as the trainer does.
    inputs = [jax.device_put(ring.zigzag(x, p), sharded) for x in (q, k, v, d_out)]
    print(f"Causal ring attention, T=S={t}, {p} devices: balanced (zig-zag) against plain "
          f"(contiguous), median of {repeats} interleaved calls\n")
    print("| pass | plain ring | balanced ring | plain / balanced |")
    print("|---|---:|---:|---:|")
    walls = {}
    for name, wrap, count in (("fwd", lambda f: f, 3), ("fwd+bwd", with_grad, 4)):
        times = walls[name] = median_times({layout: jax.jit(wrap(ring_fn(layout)))
                                            for layout in ("contiguous", "zigzag")},
                                           tuple(inputs[:count]), repeats=repeats, warmup=1)
        print(f"| {name} | {times['contiguous'] * 1e3:.0f} ms | {times['zigzag'] * 1e3:.0f} ms "
              f"| {times['contiguous'] / times['zigzag']:.2f}× |", flush=True)

    # Each ring step waits for its slowest device: on devices of their own the ring
    # takes the sum over steps of the slowest device's step. Each (device, step) pair is
    # timed alone on one device: the ring's own step (`ring.visit_shard`), its queries
    # against the visiting shard at the layout's positions (skipped when it sees none).
    shard, n, h = t // p, q.shape[2], q.shape[3]

    @jax.jit
    def attend(q, k, v, q_pos, k_pos):
        mask = masks.causal().bind(masks.Shape(1, shard, shard, n), (q_pos, k_pos))
        # the running output and log-sum-exp: [B, K, G, T, V], [B, K, G, T]
        rows = (1, n, 1, shard)
        return ring.visit_shard(q, k, v, mask, Score(h ** -0.5),
                                jnp.zeros(rows + (h,), jnp.float32),
                                jnp.full(rows, MASKED, jnp.float32))
    # keys and values head-major, as the ring carries them
    local = [q[:, :shard], ring.head_major(k[:, :shard]), ring.head_major(v[:, :shard])]
    print(f"\nThe same on devices of their own: the sum over the {p} steps of the slowest "
          f"device's step, each timed alone (fastest of {2 * repeats + 1}: the machine is "
          f"shared)\n")
    print("| layout | per-step times of device 0..P−1, step 0..P−1 (ms) | sum of slowest |")
    print("|---|---|---:|")
    paths = {}
    for layout in ("contiguous", "zigzag"):
        steps = np.zeros((p, p))
        for me in range(p):
            for step in range(p):
                positions = tuple(ring._shard_positions(i, p, shard, layout)
                                  for i in (me, (me - step) % p))
                steps[me, step] = fastest(attend, (*local, *positions), 2 * repeats + 1)
        paths[layout] = steps.max(axis=0).sum()
        table = "; ".join(" ".join(f"{x * 1e3:.0f}" for x in row) for row in steps)
        print(f"| {layout} | {table} | {paths[layout] * 1e3:.0f} ms |", flush=True)
    print(f"\nbalanced ring: {paths['contiguous'] / paths['zigzag']:.2f}× the plain ring's "
          f"speed on devices of their own (> 1: faster)")
    print(f"forward wall clock / sum of slowest: plain "
          f"{walls['fwd']['contiguous'] / paths['contiguous']:.2f}, balanced "
          f"{walls['fwd']['zigzag'] / paths['zigzag']:.2f} (about 1: the emulated devices "
          f"ran side by side as devices of their own; well above 1: they shared cores)")

    one = jax.devices()[:1]
    one_mesh = Mesh(np.asarray(one), ("seq",))
    whole = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, d_out)]
    chunked = lambda q, k, v: attnjax.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, implementation="chunked")
    print(f"\nPer-device attention temporaries (XLA memory_analysis), causal T=S={t}:\n")
    print(f"| pass | balanced ring, {p} devices | chunked, 1 device | ring, 1 device | "
          f"ring / chunked | ring / ring on 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, wrap, count in (("fwd", lambda f: f, 3), ("fwd+bwd", with_grad, 4)):
        ring_mib = temp_mib(wrap(ring_fn("zigzag")), inputs[:count])
        chunked_mib = temp_mib(wrap(chunked), whole[:count])
        one_mib = temp_mib(wrap(ring_fn("zigzag", one_mesh)), whole[:count])
        print(f"| {name} | {ring_mib:.1f} MiB | {chunked_mib:.1f} MiB | {one_mib:.1f} MiB | "
              f"{ring_mib / chunked_mib:.2f} | {ring_mib / one_mib:.2f} |", flush=True)


def fastest(fn, args, repeats: int) -> float:
    """The fastest of `repeats` calls after one warm-up, in seconds."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def model_memory(t: int, devices):
    """A decoder-only model's training step (forward and backward, d_model=128, 4 heads,
    2 layers), its sequence split over "seq" (attention as the balanced ring, the rest
    where its tokens are) against one device: per-device temporaries and arguments."""
    config = DecoderOnlyConfig(vocab_size=64, d_model=128, num_heads=4, d_ff=512,
                               num_layers=2, max_len=t, dropout_rate=0.0)
    model = DecoderOnly(config)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                               jnp.zeros((1, 16), jnp.int32))["params"])

    def loss(params, tokens, positions):
        logits = model.apply({"params": params}, tokens, positions=positions)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    print(f"\nA decoder-only training step (d_model=128, 4 heads, 2 layers), T={t}, "
          f"per device:\n")
    print("| mesh | temporaries | of one device |")
    print("|---|---:|---:|")
    first = None
    for p in (1, len(devices)):
        mesh = mesh_lib.make_mesh({"seq": p}, devices[:p])
        rows = NamedSharding(mesh, PartitionSpec(None, "seq"))
        tokens = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=rows)

        def step(params, tokens, positions, mesh=mesh):
            engine = (attention_engine(context.ring_engine(mesh)) if mesh.shape["seq"] > 1
                      else contextlib.nullcontext())
            with engine:
                return jax.grad(loss)(params, tokens, positions)

        mib = temp_mib(step, (params, tokens, tokens))
        first = first or mib
        print(f"| seq={p} | {mib:.1f} MiB | {mib / first:.2f} |", flush=True)


def packed_ids(length: int, documents: int):
    """int32 `[1, length]`: `documents` consecutive documents of uneven lengths."""
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, length), documents - 1,
                                                   replace=False))
    return jnp.asarray(np.searchsorted(cuts, np.arange(length), side="right")[None],
                       jnp.int32)

if __name__ == "__main__":
    run_main(main)
