"""Transformer blocks and models: an encoder–decoder `Transformer` and a `DecoderOnly`.

Each model takes one frozen config, validated when it is made. Blocks are pre-LN by
default (x + Dropout(f(LN(x)))) or post-LN as in the 2017 paper (LN(x + Dropout(f(x)))).
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from attnjax import _checks, masks, scores
from attnjax.attention import IMPLEMENTATIONS as ENGINE_IMPLEMENTATIONS
from attnjax.nn.attention import MultiHeadAttention
from attnjax.nn.layers import FeedForward, PositionalEncoding

POSITIONAL = ("sinusoidal", "learned", "none")
ACTIVATIONS = ("relu", "gelu")
DTYPES = ("float32", "bfloat16", "float16")
# "xla" is jax.nn's name, which dot_product_attention takes for its own default.
IMPLEMENTATIONS = (None, *ENGINE_IMPLEMENTATIONS, "xla")


def _check_config(config) -> None:
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool)
                                           or value <= 0):
            raise ValueError(f"{type(config).__name__}.{field.name} must be a positive int; "
                             f"got {value!r}")
    if config.d_model % config.num_heads:
        raise ValueError(f"d_model must be divisible by num_heads; got d_model={config.d_model}, "
                         f"num_heads={config.num_heads}")
    kv = config.num_kv_heads
    if kv is not None and (not isinstance(kv, int) or kv <= 0 or config.num_heads % kv):
        raise ValueError(f"num_kv_heads must be a positive divisor of num_heads="
                         f"{config.num_heads}; got {kv!r}")
    for name in ("dropout_rate", "attention_dropout_rate"):
        rate = getattr(config, name)
        if not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
            raise ValueError(f"{name} must lie in [0, 1); got {rate!r}")
    if config.attention_soft_cap is not None:
        scores.soft_cap(config.attention_soft_cap)  # checks the cap
    for name, allowed in (("positional", POSITIONAL), ("activation", ACTIVATIONS),
                          ("dtype", DTYPES), ("implementation", IMPLEMENTATIONS)):
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}; got {getattr(config, name)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """What every attention block needs; the model configs add their own fields.

    attention_soft_cap: soft-cap every attention's logits at this value
    (`attnjax.scores.soft_cap`); attention_sinks: a learned sink logit per head in every
    attention (parameter "sinks").
    """

    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int | None = None
    d_ff: int = 512
    max_len: int = 128
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    positional: str = "sinusoidal"
    pre_ln: bool = True
    activation: str = "relu"
    implementation: str | None = None
    dtype: str = "float32"
    attention_soft_cap: float | None = None
    attention_sinks: bool = False

    def __post_init__(self):
        _check_config(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig(BlockConfig):
    """An encoder–decoder Transformer (separate source and target vocabularies)."""

    src_vocab_size: int
    tgt_vocab_size: int
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    share_embeddings: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError("share_embeddings needs src_vocab_size == tgt_vocab_size; got "
                             f"{self.src_vocab_size} and {self.tgt_vocab_size}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderOnlyConfig(BlockConfig):
    """A decoder-only language model."""

    vocab_size: int
    num_layers: int = 2
    max_len: int = 256


def _attention(config, name: str, **kw) -> MultiHeadAttention:
    cap = config.attention_soft_cap
    return MultiHeadAttention(
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        dropout_rate=config.attention_dropout_rate, implementation=config.implementation,
        score_mod=None if cap is None else scores.soft_cap(cap),
        use_sinks=config.attention_sinks, dtype=jnp.dtype(config.dtype), name=name, **kw)


class _Residual(nn.Module):
    """x + Dropout(f(LN(x))) (pre-LN) or LN(x + Dropout(f(x))) (post-LN)."""

    config: Any

    @nn.compact
    def __call__(self, x, f, *, deterministic):
        drop = nn.Dropout(self.config.dropout_rate)
        if self.config.pre_ln:
            return x + drop(f(nn.LayerNorm(name="ln")(x)), deterministic=deterministic)
        return nn.LayerNorm(name="ln")(x + drop(f(x), deterministic=deterministic))


def _feed_forward(config, x, deterministic):
    """Every block's last sublayer, created in the calling block's scope."""
    ffn = FeedForward(config.d_ff, config.dropout_rate, config.activation, name="ffn")
    return _Residual(config, name="ffn_residual")(
        x, lambda h: ffn(h, deterministic=deterministic), deterministic=deterministic)


class EncoderBlock(nn.Module):
    """Self-attention over the source, then the feed-forward network."""

    config: Any

    @nn.compact
    def __call__(self, x, *, mask=None, positions=None, deterministic=True, sow_weights=False):
        """x `[B, S, D]` -> `[B, S, D]`. mask: the self-attention's `attnjax.Mask` (or a
        bool array); positions: int `[B, S]`, what its order rules read."""
        attend = _attention(self.config, "self")
        x = _Residual(self.config, name="self_residual")(
            x, lambda h: attend(h, mask=mask, positions=_pair(positions),
                                deterministic=deterministic, sow_weights=sow_weights),
            deterministic=deterministic)
        return _feed_forward(self.config, x, deterministic)


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to the encoder (when given), feed-forward."""

    config: Any
    decode: bool = False

    @nn.compact
    def __call__(self, x, memory=None, *, mask=None, memory_mask=None, positions=None,
                 deterministic=True, sow_weights=False):
        """x `[B, T, D]`, memory `[B, S, D]` -> `[B, T, D]`. mask: what the causal
        self-attention hides besides the future (an `attnjax.Mask` or bool array);
        memory_mask: the cross-attention's; positions: int `[B, T]`, what the causal
        mask reads (the KV cache reads its own)."""
        attend = _attention(self.config, "self", is_causal=True, decode=self.decode)
        # the KV cache places its tokens by its own index
        self_positions = None if self.decode else _pair(positions)
        x = _Residual(self.config, name="self_residual")(
            x, lambda h: attend(h, mask=mask, positions=self_positions,
                                deterministic=deterministic, sow_weights=sow_weights),
            deterministic=deterministic)
        if memory is not None:
            cross = _attention(self.config, "cross")
            x = _Residual(self.config, name="cross_residual")(
                x, lambda h: cross(h, memory, mask=memory_mask, deterministic=deterministic,
                                   sow_weights=sow_weights),
                deterministic=deterministic)
        return _feed_forward(self.config, x, deterministic)


def _pair(positions):
    """Per-token positions as self-attention's (query, key) positions."""
    return None if positions is None else (positions, positions)


class _Stack(nn.Module):
    """Layers layer_0..layer_{n-1} of one block type, and a final LayerNorm when pre-LN."""

    config: Any
    num_layers: int
    encoder: bool
    decode: bool = False

    @nn.compact
    def __call__(self, x, memory=None, *, mask=None, memory_mask=None, positions=None,
                 deterministic=True, sow_weights=False):
        for i in range(self.num_layers):
            if self.encoder:
                x = EncoderBlock(self.config, name=f"layer_{i}")(
                    x, mask=mask, positions=positions, deterministic=deterministic,
                    sow_weights=sow_weights)
            else:
                x = DecoderBlock(self.config, self.decode, name=f"layer_{i}")(
                    x, memory, mask=mask, memory_mask=memory_mask, positions=positions,
                    deterministic=deterministic, sow_weights=sow_weights)
        return nn.LayerNorm(name="ln_final")(x) if self.config.pre_ln else x


def _embedding_init(config):
    """N(0, 1/D): after the √D scaling, tokens and sinusoids have the same unit scale."""
    return nn.initializers.normal(config.d_model ** -0.5)


def check_tokens(config, name: str, tokens, vocab_size: int, positions=None) -> None:
    """Integer token ids `[B, L]`, and the positions a learned table can encode.

    Known values (outside jit) are checked: every id in [0, vocab_size), every position
    in [0, max_len). Traced ones cannot be: there an id outside the vocabulary embeds as
    zeros (`_Embed`) and a position past the table reads its last row."""
    dtype = tokens.dtype if hasattr(tokens, "dtype") else np.asarray(tokens).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer token ids; got dtype {dtype}")
    if not isinstance(tokens, jax.core.Tracer):
        bad = _checks.outside(np.asarray(tokens), 0, vocab_size - 1)
        if bad is not None:
            raise ValueError(f"{name} must hold token ids in [0, {vocab_size}) (the "
                             f"vocabulary); got {bad}")
    if config.positional != "learned":
        return
    if positions is None and np.shape(tokens)[-1] > config.max_len:
        raise ValueError(f"{name} has {np.shape(tokens)[-1]} tokens, more than the "
                         f"max_len={config.max_len} learned positions")
    if positions is not None and not isinstance(positions, jax.core.Tracer):
        bad = _checks.outside(np.asarray(positions), 0, config.max_len - 1)
        if bad is not None:
            raise ValueError(f"the positions of {name} must lie in [0, {config.max_len}) "
                             f"(the learned positions); got {bad}")


class _Embed(nn.Module):
    """Token embedding scaled by √D, then positions, then dropout."""

    config: Any
    vocab_size: int
    decode: bool = False

    @nn.compact
    def __call__(self, tokens, positions=None, *, deterministic=True, embed=None):
        embed = embed or nn.Embed(self.vocab_size, self.config.d_model,
                                  embedding_init=_embedding_init(self.config), name="tokens")
        # [B, L]: flax's lookup fills an out-of-range id's row with NaN (and wraps -1 to
        # the last row); under jit, where ids cannot be checked, such a token embeds as
        # zeros and the model sees only its position.
        known = (tokens >= 0) & (tokens < self.vocab_size)
        # [B, L, D]
        x = jnp.where(known[..., None], embed(jnp.where(known, tokens, 0)), 0.0)
        x = x * jnp.sqrt(jnp.float32(self.config.d_model))
        x = PositionalEncoding(self.config.max_len, self.config.positional, self.decode,
                               name="positions")(x, positions)
        x = nn.Dropout(self.config.dropout_rate)(x, deterministic=deterministic)
        return x.astype(jnp.dtype(self.config.dtype))


def _both(name_a: str, a, name_b: str, b) -> None:
    if (a is None) != (b is None):
        given, missing = (name_a, name_b) if b is None else (name_b, name_a)
        raise ValueError(f"{given} needs {missing} too (cross-attention pairs them); got "
                         f"{missing}=None")


class Transformer(nn.Module):
    """Encoder–decoder Transformer: `(src [B, S], tgt [B, T]) -> logits [B, T, V_tgt]`.

    src_lengths `[B]` marks source padding. For sequence packing, src_segment_ids
    `[B, S]` and tgt_segment_ids `[B, T]` (int; target segment i reads source segment i
    only) and src_positions / tgt_positions (int, restarting in each segment) place
    several examples in one row. With decode=True, `decode` runs on a KV cache (see
    `attnjax.nn.greedy_decode`).
    """

    config: TransformerConfig
    decode: bool = False

    def setup(self):
        c = self.config
        self.src_embed = _Embed(c, c.src_vocab_size, name="src_embed")
        self.tgt_embed = _Embed(c, c.tgt_vocab_size, self.decode, name="tgt_embed")
        self.shared = (nn.Embed(c.src_vocab_size, c.d_model, name="shared_embedding",
                                embedding_init=_embedding_init(c))
                       if c.share_embeddings else None)
        self.encoder = _Stack(c, c.num_encoder_layers, encoder=True, name="encoder")
        self.decoder = _Stack(c, c.num_decoder_layers, encoder=False, decode=self.decode,
                              name="decoder")
        self.logits = nn.Dense(c.tgt_vocab_size, name="logits")

    def encode(self, src, src_lengths=None, *, src_segment_ids=None, src_positions=None,
               deterministic=True, sow_weights=False):
        """`[B, S]` tokens -> `[B, S, D]` memory."""
        check_tokens(self.config, "src", src, self.config.src_vocab_size, src_positions)
        mask = masks.everything()
        if src_lengths is not None:
            mask = mask & masks.lengths(query=src_lengths, key=src_lengths)
        if src_segment_ids is not None:
            mask = mask & masks.segments(src_segment_ids)
        x = self.src_embed(src, src_positions, deterministic=deterministic, embed=self.shared)
        return self.encoder(x, mask=mask, positions=src_positions, deterministic=deterministic,
                            sow_weights=sow_weights)

    def decode_logits(self, tgt, memory, src_lengths=None, *, tgt_segment_ids=None,
                      src_segment_ids=None, tgt_positions=None, deterministic=True,
                      sow_weights=False):
        """`[B, T]` target tokens and `[B, S, D]` memory -> `[B, T, V_tgt]` logits."""
        _both("tgt_segment_ids", tgt_segment_ids, "src_segment_ids", src_segment_ids)
        check_tokens(self.config, "tgt", tgt, self.config.tgt_vocab_size,
                      None if self.decode else tgt_positions)
        mask, memory_mask = masks.everything(), masks.everything()
        if src_lengths is not None:
            memory_mask = masks.lengths(key=src_lengths)
        if tgt_segment_ids is not None:
            mask = masks.segments(tgt_segment_ids)
            memory_mask = memory_mask & masks.segments(tgt_segment_ids, src_segment_ids)
        x = self.tgt_embed(tgt, tgt_positions, deterministic=deterministic, embed=self.shared)
        x = self.decoder(x, memory, mask=mask, memory_mask=memory_mask, positions=tgt_positions,
                         deterministic=deterministic, sow_weights=sow_weights)
        return self.logits(x.astype(jnp.float32))

    def __call__(self, src, tgt, src_lengths=None, *, src_segment_ids=None,
                 tgt_segment_ids=None, src_positions=None, tgt_positions=None,
                 deterministic=True, sow_weights=False):
        memory = self.encode(src, src_lengths, src_segment_ids=src_segment_ids,
                             src_positions=src_positions, deterministic=deterministic,
                             sow_weights=sow_weights)
        return self.decode_logits(tgt, memory, src_lengths, tgt_segment_ids=tgt_segment_ids,
                                  src_segment_ids=src_segment_ids, tgt_positions=tgt_positions,
                                  deterministic=deterministic, sow_weights=sow_weights)


class DecoderOnly(nn.Module):
    """A causal language model: `tokens [B, L] -> logits [B, L, V]`.

    segment_ids `[B, L]` (int) packs several sequences into a row: a token sees the
    earlier tokens of its own segment only; positions `[B, L]` (int, restarting in each
    segment) feed the positional encoding and the causal mask. mask hides more keys: an
    `attnjax.Mask` or a bool array broadcastable to `[B, N, L, S]`, with S the cache
    length when decode=True (`attnjax.nn.generate` hides left padding this way).
    """

    config: DecoderOnlyConfig
    decode: bool = False

    @nn.compact
    def __call__(self, tokens, *, segment_ids=None, positions=None, mask=None,
                 deterministic=True, sow_weights=False):
        c = self.config
        check_tokens(c, "tokens", tokens, c.vocab_size, None if self.decode else positions)
        visible = masks.everything()
        if mask is not None:
            visible = mask if isinstance(mask, masks.Mask) else masks.from_array(mask)
        if segment_ids is not None:
            visible = visible & masks.segments(segment_ids)
        x = _Embed(c, c.vocab_size, self.decode, name="embed")(
            tokens, positions, deterministic=deterministic)
        x = _Stack(c, c.num_layers, encoder=False, decode=self.decode, name="decoder")(
            x, mask=visible, positions=positions, deterministic=deterministic,
            sow_weights=sow_weights)
        return nn.Dense(c.vocab_size, name="logits")(x.astype(jnp.float32))


def attention_maps(intermediates) -> dict:
    """Sown weights as `{"encoder/layer_0/self": [B, N, T, S], ...}`.

    Pass `intermediates` from `model.apply(..., sow_weights=True,
    mutable=["intermediates"])`.
    """
    maps = {}

    def walk(tree, path):
        for name, sub in tree.items():
            if name == "attention_weights":
                maps["/".join(path)] = sub[0]
            elif isinstance(sub, dict) or hasattr(sub, "items"):
                walk(sub, path + [name])

    walk(intermediates, [])
    return maps
