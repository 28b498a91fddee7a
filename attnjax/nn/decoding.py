"""Decoding with the KV cache, under `jax.jit`: greedy for the encoder–decoder,
greedy or sampled generation for the decoder-only model.

The public functions check their arguments first, outside jit, where the values of the
prompts and lengths are still known; the decoding loops are jit-compiled."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attnjax import _checks, heads, kv_cache
from attnjax.nn.attention import PROJECTED_KEY_VALUE
from attnjax.nn.models import DecoderOnly, Transformer, check_lengths, check_tokens


def _check_count(name: str, value, low: int) -> None:
    if not _checks.is_int(value) or value < low:
        raise ValueError(f"{name} must be an int >= {low}; got {value!r}")


def _check_id(name: str, value, vocab_size: int) -> None:
    if not _checks.is_int(value) or not 0 <= value < vocab_size:
        raise ValueError(f"{name} must be a token id in [0, {vocab_size}); got {value!r}")


def _check_batch(name: str, tokens) -> None:
    if np.ndim(tokens) != 2 or 0 in np.shape(tokens):
        raise ValueError(f"{name} must be a non-empty int array [B, L]; got shape "
                         f"{np.shape(tokens)}")


def _check_model(function: str, model, kind: type, other: str) -> None:
    if not isinstance(model, kind):
        raise TypeError(f"{function} takes an attnjax.nn.{kind.__name__}; got "
                        f"{type(model).__name__} ({other})")


def _empty_cache(model, params, *args, method=None):
    """The zero-filled "cache" collection a decode=True model starts from, each array
    sharded as a call on params makes it where that is in its type (a mesh of Explicit
    axes: a while loop's carry keeps its type from step to step, and the keys of
    parameters in Megatron's layout are split by heads, which init's are not)."""
    shapes = _without_memory(jax.eval_shape(lambda params, *args: model.apply(
        {"params": params}, *args, method=method, mutable=["cache"])[1], params, *args))

    def zeros(shape):
        empty = jnp.zeros(shape.shape, shape.dtype)
        if not heads.is_explicit(shape.sharding):
            return empty
        return jax.sharding.reshard(empty, shape.sharding)

    return jax.tree.map(zeros, shapes["cache"])


def greedy_decode(model: Transformer, params, src, src_lengths=None, *, max_len: int,
                  bos_id: int, eos_id: int, pad_id: int = 0, memory_cache: bool = True):
    """Greedy decoding: `src [B, S]` -> `[B, max_len]` target tokens (without BOS).

    Each sequence stops at its EOS (kept; pad after it); the loop stops when every
    sequence has, or at max_len. The encoder runs once; the decoder runs one token a
    step on the KV cache, and its cross-attentions project the encoder's memory once,
    before the first step, and keep it in the cache (memory_cache=False: at every step,
    the same tokens more slowly). max_len must be at least 1 (and at most the model's max_len
    with learned positions); the ids must be in the target vocabulary; src tokens and
    src_lengths (each in [1, S]) are checked when they are known, outside jit.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> model = nn.Transformer(nn.TransformerConfig(src_vocab_size=12, tgt_vocab_size=10,
        ...                                             d_model=32, num_heads=4, d_ff=64))
        >>> src = jnp.ones((2, 7), jnp.int32)                              # [B, S]
        >>> params = model.init(jax.random.key(0), src, src[:, :3])["params"]
        >>> nn.greedy_decode(model, params, src, jnp.array([7, 4]), max_len=5, bos_id=1,
        ...                  eos_id=2).shape                               # [B, max_len]
        (2, 5)
    """
    _check_model("greedy_decode", model, Transformer, "generate continues a DecoderOnly")
    config = model.config
    _check_batch("src", src)
    check_tokens(config, "src", src, config.src_vocab_size)
    _check_count("max_len", max_len, 1)
    if config.positional == "learned" and max_len > config.max_len:
        raise ValueError(f"max_len={max_len} exceeds the model's max_len={config.max_len} "
                         f"learned positions")
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
        _check_id(name, value, config.tgt_vocab_size)
    check_lengths("src_lengths", src_lengths, np.shape(src)[0], np.shape(src)[1])
    if not isinstance(memory_cache, bool):
        raise TypeError(f"memory_cache must be a bool; got {memory_cache!r}")
    # lists too: one array each, not a pytree of numbers to trace
    src, src_lengths = _checks.as_array("src", src), _checks.as_array("src_lengths", src_lengths)
    return _greedy_decode(model, params, src, src_lengths, max_len=int(max_len),
                          bos_id=int(bos_id), eos_id=int(eos_id), pad_id=int(pad_id),
                          memory_cache=memory_cache)


# The decoding loops are traced knowing that their caches hold every token they append
# (each is sized for the loop's whole length): no overrun check, whose host callback
# would keep the compiled loop out of jax's persistent compilation cache.
@functools.partial(jax.jit, static_argnames=("model", "max_len", "bos_id", "eos_id", "pad_id",
                                             "memory_cache"))
@kv_cache.sized_for_every_append()
def _greedy_decode(model: Transformer, params, src, src_lengths, *, max_len: int,
                   bos_id: int, eos_id: int, pad_id: int, memory_cache: bool = True):
    b = src.shape[0]
    src, src_lengths = heads.batch_sharded_as(src, src_lengths)   # (as generate's)
    model = model.clone(deterministic=True)   # decoding never drops out
    memory, cache = _start(model, params, src, src_lengths, max_len=max_len,
                           memory_cache=memory_cache)
    decoder = model.clone(decode=True)

    def step(state):
        i, tokens, last, done, cache = state
        logits, variables = decoder.apply(
            {"params": params, "cache": cache}, last[:, None], memory, src_lengths,
            method=Transformer.decode_logits, mutable=["cache"])
        # [B]
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        token = jnp.where(done, pad_id, token)
        tokens = tokens.at[:, i].set(token)
        cache = variables["cache"] if memory_cache else _without_memory(variables["cache"])
        return i + 1, tokens, token, done | (token == eos_id), cache

    def running(state):
        i, _, _, done, _ = state
        return (i < max_len) & ~jnp.all(done)

    # (each [B] and [B, max_len] array split by examples as src, where src is split)
    init = (jnp.int32(0), *heads.batch_sharded_as(src, (
        jnp.full((b, max_len), pad_id, jnp.int32), jnp.full((b,), bos_id, jnp.int32),
        jnp.zeros((b,), bool)))[1], cache)
    return lax.while_loop(running, step, init)[1]


def _start(model: Transformer, params, src, src_lengths, *, max_len: int,
           memory_cache: bool = True):
    """The encoder's memory `[B, S, D]` and the cache that decoding starts from
    (`_start_cache`)."""
    memory = model.apply({"params": params}, src, src_lengths, method=Transformer.encode)
    return memory, _start_cache(model, params, memory, src_lengths, max_len=max_len,
                                memory_cache=memory_cache)


def _start_cache(model: Transformer, params, memory, src_lengths, *, max_len: int,
                 memory_cache: bool = True):
    """The cache of `model.clone(decode=True)` that decoding of the encoder's memory
    starts from: the self-attention caches, empty, and the cross-attentions' projected
    memory (left out without memory_cache: every step projects it).

    The memory is projected by a decoder pass over one token whose cache is then
    dropped: of that pass only the memory's projections reach the result, and XLA
    compiles nothing else of it (a first decoding step outside the loop compiled the
    whole decoder a second time). Its appends are traced without the overrun check,
    whose host callback XLA would keep (a program with one leaves jit's C++ dispatch:
    the dates model's starting cache, jitted alone, took 3.0 ms a call against 2.2-2.6)."""
    _, tgt = heads.batch_sharded_as(memory, jnp.zeros((memory.shape[0], max_len), jnp.int32))
    decoder = model.clone(decode=True)
    # (init keeps no projected memory: the first call that decodes projects its own)
    cache = _empty_cache(decoder, params, memory, tgt, method=_full_length_decoder)
    if not memory_cache:
        return cache
    with kv_cache.sized_for_every_append():   # one token into caches of max_len
        _, variables = decoder.apply({"params": params, "cache": cache}, tgt[:, :1], memory,
                                     src_lengths, method=Transformer.decode_logits,
                                     mutable=["cache"])
    return _with_memory(cache, variables["cache"])


def _with_memory(cache, primed):
    """cache with the cross-attentions' projected memory of primed added."""
    return {name: (sub if name in PROJECTED_KEY_VALUE
                   else _with_memory(cache.get(name, {}), sub) if hasattr(sub, "items")
                   else cache[name])
            for name, sub in primed.items()}


def _without_memory(cache):
    """The cache without the cross-attentions' projected memory (nor the collections
    that held only that), as init leaves it."""
    kept = {}
    for name, sub in cache.items():
        if name in PROJECTED_KEY_VALUE:
            continue
        if hasattr(sub, "items"):
            sub = _without_memory(sub)
            if not sub:
                continue
        kept[name] = sub
    return kept


def _full_length_decoder(module, memory, tgt):
    """Sizes the decoder's cache: one decoder pass over a full-length target."""
    return module.decode_logits(tgt, memory)


def generate(model: DecoderOnly, params, prompt, prompt_lengths=None, *, max_new_tokens: int,
             temperature: float | np.floating = 0.0, rng=None, padding_side: str = "left"):
    """Continue `prompt [B, P]` by max_new_tokens: `[B, P + max_new_tokens]`.

    The prompt is prefilled in one call on the KV cache, then tokens come one at a
    time: the most likely (temperature 0) or sampled from softmax(logits / temperature)
    with `rng`. Prompts of different lengths come padded, with prompt_lengths int `[B]`:
    left-padded (padding_side="left", example b's prompt is its last prompt_lengths[b]
    tokens; its row of the result is the padding, the prompt, then the new tokens) or
    right-padded ("right": its first prompt_lengths[b] tokens; its row is the prompt,
    the new tokens, then the padding). Either way its positions start at 0 at its first
    token and nothing attends to the padding, so each example continues as it would
    alone.

    max_new_tokens is an int >= 0 (with learned positions, P + max_new_tokens - 1 at
    most the model's max_len: the model reads the prompt and every new token but the
    last), temperature a finite float >= 0; the prompt's tokens and prompt_lengths (each
    in [1, P]) are checked when they are known, outside jit.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> config = nn.DecoderOnlyConfig(vocab_size=16, d_model=32, num_heads=4, d_ff=64)
        >>> lm = nn.DecoderOnly(config)
        >>> prompt = jnp.array([[0, 5, 6], [7, 8, 9]])                     # left-padded, [B, P]
        >>> params = lm.init(jax.random.key(0), prompt)["params"]
        >>> nn.generate(lm, params, prompt, jnp.array([2, 3]), max_new_tokens=4).shape
        (2, 7)
    """
    _check_model("generate", model, DecoderOnly, "greedy_decode decodes a Transformer")
    config = model.config
    _check_batch("prompt", prompt)
    check_tokens(config, "prompt", prompt, config.vocab_size)
    b, p = np.shape(prompt)
    _check_count("max_new_tokens", max_new_tokens, 0)
    if config.positional == "learned" and _tokens_read(p, max_new_tokens) > config.max_len:
        raise ValueError(f"prompt length {p} + max_new_tokens={max_new_tokens} - 1 (the model "
                         f"reads every new token but the last) exceeds the model's "
                         f"max_len={config.max_len} learned positions")
    # a Python or NumPy number (np.float32(0.7) as a config computes it); a traced one
    # cannot choose between argmax and sampling, so it is refused
    if (isinstance(temperature, (bool, np.bool_))
            or not isinstance(temperature, (int, float, np.integer, np.floating))
            or not (math.isfinite(temperature) and temperature >= 0)):
        raise ValueError(f"temperature must be a finite number >= 0; got {temperature!r}")
    if temperature > 0.0 and rng is None:
        raise ValueError(f"temperature={temperature} samples and needs an rng; got None")
    check_lengths("prompt_lengths", prompt_lengths, b, p)
    # lists too: one array each, not a pytree of numbers to trace
    prompt = _checks.as_array("prompt", prompt)
    prompt_lengths = _checks.as_array("prompt_lengths", prompt_lengths)
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}; got {padding_side!r}")
    if padding_side == "right" and prompt_lengths is not None:
        # [B]: each row turned about so that its padding comes first, and back after
        shift = p - jnp.asarray(prompt_lengths, jnp.int32)
        tokens = _generate(model, params, _roll_rows(jnp.asarray(prompt), shift),
                           prompt_lengths, max_new_tokens=int(max_new_tokens),
                           temperature=float(temperature), rng=rng)
        return _roll_rows(tokens, -shift)
    return _generate(model, params, prompt, prompt_lengths, max_new_tokens=int(max_new_tokens),
                     temperature=float(temperature), rng=rng)


PADDING_SIDES = ("left", "right")


def _tokens_read(prompt_length: int, max_new_tokens: int) -> int:
    """How many tokens generate's model reads, each into a slot of its cache: the prompt
    and every new token but the last, which nothing reads back."""
    return prompt_length + max(max_new_tokens - 1, 0)


@jax.jit
def _roll_rows(x, shift):
    """Row b of `x [B, L]` rolled right by shift[b] (left when negative)."""
    columns = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :] - shift[:, None]
    return jnp.take_along_axis(x, columns % x.shape[1], axis=1)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "temperature"))
@kv_cache.sized_for_every_append()   # (see _greedy_decode)
def _generate(model: DecoderOnly, params, prompt, prompt_lengths, *, max_new_tokens: int,
              temperature: float, rng):
    b, p = prompt.shape
    # (lengths split by examples beside a prompt that is not: the prompt's sharding)
    prompt, prompt_lengths = heads.batch_sharded_as(prompt, prompt_lengths)
    rng = jax.random.key(0) if rng is None else rng
    decoder = model.clone(decode=True, deterministic=True)   # decoding never drops out
    total = _tokens_read(p, max_new_tokens)
    cache = _empty_cache(decoder, params, jnp.zeros((b, total), jnp.int32))
    # [B]: the cache slot of each example's first token
    start = jnp.zeros((b,), jnp.int32) if prompt_lengths is None else (
        p - jnp.asarray(prompt_lengths, jnp.int32))
    # [B, total]: each slot's position in its example
    positions = jnp.arange(total, dtype=jnp.int32)[None, :] - start[:, None]
    # [B, 1, 1, total]: the slots that hold the example's tokens
    mask = (positions >= 0)[:, None, None, :]

    def pick(logits, key):
        if temperature > 0.0:
            # [B, V] <= 0, the largest logit 0: the same distribution as logits /
            # temperature, which overflows to inf (NaN in the softmax) where the
            # temperature is tiny; there every other logit goes to -inf, as it should
            shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
            scaled = jnp.where(shifted == 0, 0.0, shifted / temperature)
            return jax.random.categorical(key, scaled).astype(jnp.int32)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    logits, variables = decoder.apply({"params": params, "cache": cache}, prompt,
                                      positions=positions[:, :p], mask=mask, mutable=["cache"])
    tokens = jnp.concatenate([prompt.astype(jnp.int32), heads.batch_sharded_as(
        prompt, jnp.zeros((b, max_new_tokens), jnp.int32))[1]], axis=1)
    first = pick(logits[:, -1], jax.random.fold_in(rng, 0))
    tokens = tokens.at[:, p].set(first)

    def step(i, state):
        tokens, cache = state
        slot = p + i - 1
        logits, variables = decoder.apply(
            {"params": params, "cache": cache}, lax.dynamic_slice_in_dim(tokens, slot, 1, 1),
            positions=lax.dynamic_slice_in_dim(positions, slot, 1, 1), mask=mask,
            mutable=["cache"])
        token = pick(logits[:, -1], jax.random.fold_in(rng, i))
        return lax.dynamic_update_slice_in_dim(tokens, token[:, None], p + i, 1), variables["cache"]

    return lax.fori_loop(1, max_new_tokens, step, (tokens, variables["cache"]))[0]
