"""Ring attention on 4 devices against dense attention on the same 4 devices (memory)
and against chunked attention on one device (time).

Memory is XLA's compiled temporary allocation per device
(`memory_analysis().temp_size_in_bytes` of the SPMD program, which is per device), with
the sequence sharded over the 4 devices for both ring and dense (XLA partitions the
dense computation as it sees fit). On a CPU the 4 devices are emulated
(`--xla_force_host_platform_device_count=4`) and share its cores, so the time shows the
ring's overhead on the same total work, not a speed-up.

Three masks: none, causal, and causal over 8 packed documents of uneven lengths
(`segment_ids`; their boundaries cross the shards).

    python benchmarks/ring.py [--length 16384] [--repeats 3]
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]).strip()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import attnjax  # noqa: E402
from _timing import median_times  # noqa: E402
from attnjax import masks  # noqa: E402
from attnjax.parallel import ring_self_attention  # noqa: E402

MIB = 2 ** 20


def temp_mib(fn, args, **jit_kwargs) -> float:
    compiled = jax.jit(fn, **jit_kwargs).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes / MIB


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    t, n, h = args.length, args.heads, args.head_dim
    devices = jax.devices()[:4]
    mesh = Mesh(np.asarray(devices), ("seq",))
    sharded = NamedSharding(mesh, PartitionSpec(None, "seq", None, None))
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (1, t, n, h), jnp.float32) for key in keys)
    on_mesh = [jax.device_put(x, sharded) for x in (q, k, v, d_out)]
    print(f"B=1 T=S={t} N={n} H={h} float32, {len(devices)} {devices[0].platform} devices, "
          f"jax {jax.__version__}\n")

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

    print("| mask | pass | ring, 4 devices | dense, 4 devices | dense / ring |")
    print("|---|---|---:|---:|---:|")
    for case in cases:
        for name, wrap, inputs in (("fwd", lambda f: f, on_mesh[:3]),
                                   ("fwd+bwd", with_grad, on_mesh)):
            kwargs = dict(out_shardings=sharded) if name == "fwd" else {}
            ring_mib = temp_mib(wrap(ring(case)), inputs, **kwargs)
            dense_mib = temp_mib(wrap(single(case, "dense")), inputs, **kwargs)
            print(f"| {case} | {name} | {ring_mib:.1f} MiB | {dense_mib:.1f} MiB | "
                  f"{dense_mib / ring_mib:.0f}× less |", flush=True)

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


def packed_ids(length: int, documents: int):
    """int32 `[1, length]`: `documents` consecutive documents of uneven lengths."""
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, length), documents - 1,
                                                   replace=False))
    return jnp.asarray(np.searchsorted(cuts, np.arange(length), side="right")[None],
                       jnp.int32)

if __name__ == "__main__":
    main()
