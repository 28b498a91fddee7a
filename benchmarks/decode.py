"""Generation with the KV cache vs recomputing the whole prefix at every step.

    python benchmarks/decode.py [--tokens 256] [--repeats 3]

One decoder-only model (4 layers, d_model 256, 4 heads), batch 4, a 16-token prompt,
greedy decoding of --tokens tokens, both under jax.jit, in one process: attnjax.nn.generate
(prefill, then one token a step on the cache) against a loop that runs the full causal
forward over the fixed-size token buffer at every step and reads off the next token.
Both produce the same tokens (checked); the median wall time of --repeats runs after a
warm-up is reported.
"""

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnjax import nn  # noqa: E402


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def generate_without_cache(model, params, prompt, *, max_new_tokens: int):
    """Greedy decoding that recomputes the full forward over the buffer every step."""
    b, p = prompt.shape
    tokens = jnp.concatenate([prompt, jnp.zeros((b, max_new_tokens), jnp.int32)], axis=1)

    def step(i, tokens):
        # Causal attention: positions after p + i cannot change the logits at p + i − 1.
        logits = model.apply({"params": params}, tokens)
        token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, p + i - 1, 1, False), -1)
        return jax.lax.dynamic_update_slice_in_dim(tokens, token.astype(jnp.int32)[:, None],
                                                   p + i, 1)

    return jax.lax.fori_loop(0, max_new_tokens, step, tokens)


def median_seconds(fn, repeats):
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompt_len, batch = 16, 4
    config = nn.DecoderOnlyConfig(vocab_size=64, d_model=256, num_heads=4, num_layers=4,
                                  d_ff=1024, max_len=prompt_len + args.tokens)
    model = nn.DecoderOnly(config)
    prompt = jax.random.randint(jax.random.key(0), (batch, prompt_len), 1, 64, jnp.int32)
    params = model.init(jax.random.key(1), prompt)["params"]

    cached = lambda: nn.generate(model, params, prompt, max_new_tokens=args.tokens)  # noqa: E731
    recomputed = lambda: generate_without_cache(  # noqa: E731
        model, params, prompt, max_new_tokens=args.tokens)
    same = bool(jnp.all(cached() == recomputed()))
    t_cached = median_seconds(cached, args.repeats)
    t_recomputed = median_seconds(recomputed, args.repeats)
    print(f"device: {jax.devices()[0].device_kind}; DecoderOnly 4×256, batch {batch}, prompt "
          f"{prompt_len}, {args.tokens} new tokens, greedy; same tokens: {same}")
    print("| decoding | s | tokens/s | speed-up |")
    print("|---|---:|---:|---:|")
    for name, t in (("KV cache (attnjax.nn.generate)", t_cached),
                    ("recompute the prefix every step", t_recomputed)):
        print(f"| {name} | {t:.3f} | {batch * args.tokens / t:.0f} | {t_recomputed / t:.1f}× |")


if __name__ == "__main__":
    main()
