"""Generation with the KV cache vs recomputing the whole prefix at every step.

    python benchmarks/decode.py [--tokens 256] [--repeats 3]

One decoder-only model (4 layers, d_model 256, 4 heads), batch 4, a 16-token prompt,
greedy decoding of --tokens tokens, both under jax.jit, in one process: attnjax.nn.generate
(prefill, then one token a step on the cache) against a loop that runs the full causal
forward over the fixed-size token buffer at every step and reads off the next token.
Both produce the same tokens (checked); the median wall time of --repeats runs after a
warm-up, timed interleaved, is reported.

Then one attention layer decoding token by token, each token one jitted call (B=1,
D=256, 4 heads, a 256-token cache): flax's MultiHeadDotProductAttention against
attnjax's, its step traced as is (each append checks for an overrun, with a host callback
that takes the step off jit's fast dispatch) and inside nn.sized_for_every_append.

Then the encoder–decoder of the dates config (configs/dates.yaml, one layer a side), and
the same model with two layers a side (the config's model until it trained one), greedily
decoding the sources of its held-out set, 1,000 at a time: its cross-attentions projecting the
encoder's memory once and keeping it in the cache (attnjax.nn.greedy_decode's default)
against projecting it at every step (memory_cache=False): in one compiled loop
(greedy_decode, the encoder's pass included), with one jitted call per token (a streaming
server's loop, the encoder's pass included), and that loop's decoding of the encoder's
memory alone (its starting cache and its steps: what the cache can shorten); the same
tokens in all six (checked), timed interleaved (median of --repeats rounds).
"""

import functools
import os
import statistics
import sys
import time

import flax.linen
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnjax import nn  # noqa: E402
from attnjax.nn import decoding  # noqa: E402
from attnjax.toy import make_task  # noqa: E402
from attnjax.toy import train as training  # noqa: E402
from attnjax.toy.config import load_config  # noqa: E402
from attnjax.toy.tasks import BOS, EOS, PAD  # noqa: E402
from _timing import Parser, median_times, positive_int  # noqa: E402
from _timing import run as run_main  # noqa: E402


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens"))
def generate_without_cache(model, params, prompt, *, max_new_tokens: int):
    """Greedy decoding that recomputes the full forward over the buffer every step."""
    b, p = prompt.shape
    tokens = jnp.concatenate([prompt, jnp.zeros((b, max_new_tokens), jnp.int32)], axis=1)

    def step(i, tokens):
        # Causal attention: positions after p + i cannot change the logits at p + i − 1.
        logits = model.apply({"params": params}, tokens, deterministic=True)
        token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, p + i - 1, 1, False), -1)
        return jax.lax.dynamic_update_slice_in_dim(tokens, token.astype(jnp.int32)[:, None],
                                                   p + i, 1)

    return jax.lax.fori_loop(0, max_new_tokens, step, tokens)


def main() -> None:
    parser = Parser(__doc__)
    parser.add_argument("--tokens", type=positive_int, default=256)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--dates-only", action="store_true",
                        help="only the encoder–decoder's cross-attention cache")
    parser.add_argument("--layer-only", action="store_true",
                        help="only one attention layer's token-by-token step")
    args = parser.parse_args()
    if args.dates_only:
        return dates_memory_caches(args.repeats)
    if args.layer_only:
        return layer_steps(args.repeats)
    prompt_len, batch = 16, 4
    config = nn.DecoderOnlyConfig(vocab_size=64, d_model=256, num_heads=4, num_layers=4,
                                  d_ff=1024, max_len=prompt_len + args.tokens)
    model = nn.DecoderOnly(config)
    prompt = jax.random.randint(jax.random.key(0), (batch, prompt_len), 1, 64, jnp.int32)
    params = model.init(jax.random.key(1), prompt, deterministic=True)["params"]

    cached = lambda: nn.generate(model, params, prompt, max_new_tokens=args.tokens)  # noqa: E731
    recomputed = lambda: generate_without_cache(  # noqa: E731
        model, params, prompt, max_new_tokens=args.tokens)
    same = bool(jnp.all(cached() == recomputed()))
    seconds = median_times({"cached": cached, "recomputed": recomputed}, (),
                           repeats=args.repeats, warmup=1)
    t_cached, t_recomputed = seconds["cached"], seconds["recomputed"]
    print(f"device: {jax.devices()[0].device_kind}; DecoderOnly 4×256, batch {batch}, prompt "
          f"{prompt_len}, {args.tokens} new tokens, greedy; same tokens: {same}")
    print("| decoding | s | tokens/s | speed-up |")
    print("|---|---:|---:|---:|")
    for name, t in (("KV cache (attnjax.nn.generate)", t_cached),
                    ("recompute the prefix every step", t_recomputed)):
        print(f"| {name} | {t:.3f} | {batch * args.tokens / t:.0f} | {t_recomputed / t:.1f}× |")
    print()
    layer_steps(args.repeats)
    print()
    dates_memory_caches(args.repeats)


def layer_steps(repeats: int, batch: int = 1, length: int = 256, width: int = 256,
                heads: int = 4) -> None:
    """One attention layer's decoding step, one jitted call a token, for flax's module and
    attnjax's (as is, and traced inside nn.sized_for_every_append): the median time of a
    token over `repeats` passes through a `length`-token cache, taken in turns."""
    x = jax.random.normal(jax.random.key(0), (batch, length, width), jnp.float32)

    def stepper(module_cls, sized: bool):
        module = module_cls(num_heads=heads, decode=True)
        variables = module.init(jax.random.key(1), x)      # sizes the cache: length tokens

        def step(params, cache, token):
            out, mutated = module.apply({"params": params, "cache": cache}, token,
                                        mutable=["cache"])
            return out, mutated["cache"]

        step = nn.sized_for_every_append()(step) if sized else step
        return jax.jit(step, donate_argnums=1), variables

    steppers = {"flax.linen.MultiHeadDotProductAttention": stepper(
                    flax.linen.MultiHeadDotProductAttention, False),
                "attnjax.nn.MultiHeadDotProductAttention": stepper(
                    nn.MultiHeadDotProductAttention, False),
                "the same, traced inside nn.sized_for_every_append": stepper(
                    nn.MultiHeadDotProductAttention, True)}
    seconds = {name: [] for name in steppers}
    outputs = {}
    for rep in range(repeats + 1):        # the first pass compiles, and is not counted
        for name, (step, variables) in steppers.items():
            cache, rows, times = jax.tree.map(jnp.copy, variables["cache"]), [], []
            for i in range(length):
                start = time.perf_counter()
                out, cache = step(variables["params"], cache, x[:, i:i + 1])
                jax.block_until_ready(out)
                times.append(time.perf_counter() - start)
                rows.append(out)
            seconds[name] += times if rep else []
            outputs[name] = jnp.concatenate(rows, axis=1)
    same = all(bool(jnp.allclose(out, outputs["flax.linen.MultiHeadDotProductAttention"],
                                 atol=1e-5)) for out in outputs.values())
    flax_time = statistics.median(seconds["flax.linen.MultiHeadDotProductAttention"])
    print(f"one attention layer, B={batch}, D={width}, {heads} heads, a {length}-token cache "
          f"filled one jitted call a token; the same outputs (atol 1e-5): {same}")
    print("| decoding step | µs a token | flax / this |")
    print("|---|---:|---:|")
    for name, times in seconds.items():
        t = statistics.median(times)
        print(f"| {name} | {t * 1e6:.0f} | {flax_time / t:.2f}× |")


def stepwise_greedy_decode(model, params, src, lengths, *, max_len: int, memory_cache: bool):
    """attnjax.nn.greedy_decode with one jitted call per token, as a streaming server
    decodes (the decode=True modules' cache, `apply(..., mutable=["cache"])` a token at a
    time): each call is its own program, so no compiler can lift the projection of the
    encoder's memory out of the loop; only the cache keeps it from being redone. As a
    server would, it traces the model once: the encoder's pass, the starting cache and
    each token are jitted calls, each token's traced inside nn.sized_for_every_append
    (the caches hold every token)."""
    model = model.clone(deterministic=True)
    return stepwise_decode(model, params, _encode(model, params, src, lengths), lengths,
                           max_len=max_len, memory_cache=memory_cache)


def stepwise_decode(model, params, memory, lengths, *, max_len: int, memory_cache: bool):
    """`stepwise_greedy_decode`'s decoding of the encoder's memory: the starting cache
    (with the memory projected, or without), then one jitted call per token."""
    decoder = model.clone(decode=True)
    cache = _start_cache(model, params, memory, lengths, max_len=max_len,
                         memory_cache=memory_cache)
    tokens = []
    last = jnp.full((memory.shape[0],), BOS, jnp.int32)
    done = jnp.zeros((memory.shape[0],), bool)
    for _ in range(max_len):
        last, done, cache = _decode_step(decoder, params, cache, last, memory, lengths, done,
                                         memory_cache=memory_cache)
        tokens.append(last)
    return jnp.stack(tokens, axis=1)


@functools.partial(jax.jit, static_argnames="model")
def _encode(model, params, src, lengths):
    return model.apply({"params": params}, src, lengths, method=nn.Transformer.encode)


# the cache greedy_decode starts from (with the projected memory, or without it for the
# steps to project)
_start_cache = jax.jit(decoding._start_cache, static_argnames=("model", "max_len", "memory_cache"))


@functools.partial(jax.jit, static_argnames=("decoder", "memory_cache"),
                   donate_argnames=("cache",))
@nn.sized_for_every_append()   # its caches hold every token: no overrun check
def _decode_step(decoder, params, cache, last, memory, lengths, done, *, memory_cache: bool):
    logits, variables = decoder.apply(
        {"params": params, "cache": cache}, last[:, None], memory, lengths,
        method=nn.Transformer.decode_logits, mutable=["cache"])
    token = jnp.where(done, PAD, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
    cache = variables["cache"] if memory_cache else decoding._without_memory(variables["cache"])
    return token, done | (token == EOS), cache


def dates_memory_caches(repeats: int) -> None:
    """`dates_memory_cache` for the shipped dates model, then with two layers a side: the
    memory's projections are a larger part of a step's work the more layers project it."""
    dates_memory_cache(repeats, [])
    print()
    dates_memory_cache(repeats, ["model.num_encoder_layers=2", "model.num_decoder_layers=2"])


def dates_memory_cache(repeats: int, overrides: list[str]) -> None:
    """Greedy decoding of the dates task with and without the cross-attention cache, the
    dates config's model changed by `overrides` (`--set` syntax)."""
    config = load_config("dates", overrides)
    task = make_task(config.task)
    model = training.make_model(config, task).clone(deterministic=True)
    held_out = training.eval_set(task, config)
    src = jnp.asarray(held_out.src[:config.eval_batch_size])
    lengths = jnp.asarray(held_out.src_lengths[:config.eval_batch_size])
    params = model.init(jax.random.key(0), src, jnp.full((src.shape[0], 2), BOS, jnp.int32),
                        lengths)["params"]
    max_len = held_out.tgt_out.shape[1]
    memory = _encode(model, params, src, lengths)

    def compiled(memory_cache):
        return lambda: nn.greedy_decode(model, params, src, lengths, max_len=max_len, bos_id=BOS,
                                        eos_id=EOS, pad_id=PAD, memory_cache=memory_cache)

    def stepwise(memory_cache):
        return lambda: stepwise_greedy_decode(model, params, src, lengths, max_len=max_len,
                                              memory_cache=memory_cache)

    def decoding_alone(memory_cache):
        return lambda: stepwise_decode(model, params, memory, lengths, max_len=max_len,
                                       memory_cache=memory_cache)

    runs = {(loop, cached): make(cached)
            for loop, make in (("compiled", compiled), ("stepwise", stepwise),
                               ("decoding", decoding_alone))
            for cached in (True, False)}
    # the encoder's pass alone, which every run makes once and the cache cannot shorten
    runs["encoder", None] = lambda: _encode(model, params, src, lengths)
    reference = runs["compiled", True]()
    same = all(bool(jnp.all(run() == reference))
               for (loop, _), run in runs.items() if loop != "encoder")
    seconds = median_times(runs, (), repeats=repeats, warmup=1)
    encoding = seconds["encoder", None]
    print(f"dates encoder–decoder ({config.model.num_decoder_layers} decoder layers, d_model "
          f"{config.model.d_model}), {src.shape[0]} sources of {src.shape[1]} tokens, "
          f"{max_len} target tokens, greedy; same tokens in all six: {same}; the "
          f"encoder's pass alone {encoding * 1e3:.1f} ms")
    print("| decoding loop | cross-attention memory | ms | speed-up |")
    print("|---|---|---:|---:|")
    for loop, name in (("compiled", "one compiled loop (attnjax.nn.greedy_decode), the "
                                    "encoder's pass included"),
                       ("stepwise", "one jitted call per token, the encoder's pass "
                                    "included"),
                       ("decoding", "one jitted call per token, after the encoder's pass "
                                    "(the starting cache and the steps)")):
        every = seconds[loop, False]
        for cached, memory_name in ((True, "projected once, kept in the cache"),
                                    (False, "projected every step")):
            t = seconds[loop, cached]
            print(f"| {name} | {memory_name} | {t * 1e3:.1f} | {every / t:.2f}× |")


if __name__ == "__main__":
    run_main(main)
