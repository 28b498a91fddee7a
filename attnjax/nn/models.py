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

from attnjax import _checks, heads, masks, scores
from attnjax.attention import IMPLEMENTATIONS as ENGINE_IMPLEMENTATIONS
from attnjax.nn.attention import MultiHeadAttention, check_score
from attnjax.nn.layers import ACTIVATIONS, POSITIONAL, FeedForward, PositionalEncoding

DTYPES = ("float32", "bfloat16", "float16")
# "xla" is jax.nn's name, which dot_product_attention takes for its own default.
IMPLEMENTATIONS = (None, *ENGINE_IMPLEMENTATIONS, "xla")


def check_model_config(model, kind: type) -> None:
    """A TypeError unless the model's config is a `kind` (a Transformer's and a
    DecoderOnly's configs differ: the other's would fail on a missing field)."""
    if not isinstance(model.config, kind):
        raise TypeError(f"{type(model).__name__} takes a {kind.__name__}; got "
                        f"{type(model.config).__name__}")


def _check_config(config, unused: tuple[str, ...] = ()) -> None:
    """Every field of a model config; the fields named in `unused` may be any int >= 0."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        low = 0 if field.name in unused else 1
        if field.type in ("int", int) and not (_checks.is_int(value) and value >= low):
            wanted = "an int >= 0 (unused)" if low == 0 else "a positive int"
            raise ValueError(f"{type(config).__name__}.{field.name} must be {wanted}; got "
                             f"{value!r}")
        if field.type in ("bool", bool) and not isinstance(value, bool):
            raise ValueError(f"{type(config).__name__}.{field.name} must be a bool (True or "
                             f"False); got {value!r}")
    if config.d_model % config.num_heads:
        raise ValueError(f"d_model must be divisible by num_heads; got d_model={config.d_model}, "
                         f"num_heads={config.num_heads}")
    kv = config.num_kv_heads
    if kv is not None and not (_checks.is_int(kv) and kv > 0 and config.num_heads % kv == 0):
        raise ValueError(f"num_kv_heads must be a positive divisor of num_heads="
                         f"{config.num_heads}; got {kv!r}")
    for name in ("dropout_rate", "attention_dropout_rate"):
        rate = getattr(config, name)
        if not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
            raise ValueError(f"{name} must lie in [0, 1); got {rate!r}")
    if config.attention_soft_cap is not None:
        try:
            scores.soft_cap(config.attention_soft_cap)  # checks the cap
        except (TypeError, ValueError) as e:
            raise ValueError(f"attention_soft_cap: {e}") from None
    for name, allowed in (("positional", POSITIONAL), ("activation", ACTIVATIONS),
                          ("dtype", DTYPES), ("implementation", IMPLEMENTATIONS)):
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}; got {getattr(config, name)!r}")
    check_score(config.attention_score, config.implementation, "attention_score")


def _plain_numbers(config) -> None:
    """A config's numbers of any kind (NumPy's, a concrete jax scalar) stored as Python's,
    so that the config stays hashable and reads plainly (a jnp.float32 cap had made it
    unhashable, a np.float32 rate had been refused as out of range)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None or isinstance(value, (bool, str)):
            continue
        try:
            number = np.asarray(value)
        except Exception:   # a tracer, say: the checks name it
            continue
        if number.shape == () and number.dtype.kind in "iuf":
            # a float by its shortest decimal: np.float32(0.1) as 0.1
            object.__setattr__(config, field.name, float(str(number[()]))
                               if number.dtype.kind == "f" else int(number))


def _dtype_name(dtype) -> str:
    """A config's dtype as its name: a string, a jnp/numpy dtype or scalar type alike."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        raise ValueError(f"dtype must be one of {DTYPES} (a name, or jnp.float32, ...); got "
                         f"{dtype!r}") from None
    if isinstance(dtype, str) and name != dtype and name not in DTYPES:
        # the name given, with numpy's for it ("float" is float64)
        raise ValueError(f"dtype must be one of {DTYPES}; got {dtype!r} ({name})")
    return name


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockConfig:
    """What every attention block needs; the model configs add their own fields.

    d_model: the width D; num_heads: N query heads (H = D / N each); num_kv_heads: K
    key/value heads dividing N (None: N); d_ff: the feed-forward's hidden width;
    max_len: the positions learned ones hold (and the longest input then); dropout_rate:
    on embeddings, sublayer outputs and feed-forward hidden units (training only: the
    models then need deterministic); attention_dropout_rate: on attention weights;
    positional: "sinusoidal", "learned" or "none"; pre_ln: LayerNorm before each
    sublayer (False: after); activation: "relu" or "gelu"; implementation: every
    attention's kernel (None, "dense", "chunked", "cudnn"); dtype: the computation's
    (parameters stay float32). attention_soft_cap: soft-cap every attention's logits at
    this value (`attnjax.scores.soft_cap`); attention_sinks: a learned sink logit per head in every
    attention (parameter "sinks"); attention_score: every attention's alignment,
    "scaled_dot" (default), "dot", "general" or "additive" (`MultiHeadAttention.score`).
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
    dtype: str | type | np.dtype = "float32"   # stored as its name: "bfloat16"
    attention_soft_cap: float | None = None
    attention_sinks: bool = False
    attention_score: str = "scaled_dot"

    def __post_init__(self):
        # jnp.bfloat16 and "bfloat16" are one config (equal, hashable, written as a name)
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        _plain_numbers(self)
        _check_config(self, self._unused_fields())

    def _unused_fields(self) -> tuple[str, ...]:
        """Int fields this config carries but its model does not use (0 allowed)."""
        return ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig(BlockConfig):
    """An encoder–decoder Transformer (separate source and target vocabularies).

    src_vocab_size, tgt_vocab_size: the token ids' ranges; num_encoder_layers,
    num_decoder_layers: the stacks' depths; share_embeddings: one embedding table
    ("shared_embedding") for source and target tokens, which needs equal vocabularies
    (the output projection stays its own). The other fields: `BlockConfig`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from attnjax import nn
        >>> config = nn.TransformerConfig(src_vocab_size=20, tgt_vocab_size=16, d_model=32,
        ...                               num_heads=4, dtype=jnp.bfloat16)
        >>> config.dtype, config.d_model // config.num_heads   # the dtype, H of [B, T, N, H]
        ('bfloat16', 8)
    """

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
    """A decoder-only language model.

    vocab_size: the token ids' range; num_layers: the decoder's depth; max_len defaults
    to 256 here. The other fields: `BlockConfig`.

    Examples:
        >>> from attnjax import nn
        >>> config = nn.DecoderOnlyConfig(vocab_size=16, d_model=32, num_heads=4)
        >>> config.num_layers, config.d_model // config.num_heads    # layers, H of [B, T, N, H]
        (2, 8)
    """

    vocab_size: int
    num_layers: int = 2
    max_len: int = 256


def _attention(config, name: str, **kw) -> MultiHeadAttention:
    cap = config.attention_soft_cap
    return MultiHeadAttention(
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        dropout_rate=config.attention_dropout_rate, implementation=config.implementation,
        score_mod=None if cap is None else scores.soft_cap(cap),
        use_sinks=config.attention_sinks, score=config.attention_score,
        dtype=jnp.dtype(config.dtype), name=name, **kw)


class _Residual(nn.Module):
    """x + Dropout(f(LN(x))) (pre-LN) or LN(x + Dropout(f(x))) (post-LN)."""

    config: Any

    @nn.compact
    def __call__(self, x, f, *, deterministic):
        drop = nn.Dropout(self.config.dropout_rate)
        ln = nn.LayerNorm(dtype=jnp.dtype(self.config.dtype), name="ln")
        if self.config.pre_ln:
            return x + drop(f(ln(x)), deterministic=deterministic)
        return ln(x + drop(f(x), deterministic=deterministic))


def _feed_forward(config, x, deterministic):
    """Every block's last sublayer, created in the calling block's scope."""
    ffn = FeedForward(config.d_ff, config.dropout_rate, config.activation,
                      dtype=jnp.dtype(config.dtype), name="ffn")
    return _Residual(config, name="ffn_residual")(
        x, lambda h: ffn(h, deterministic=deterministic), deterministic=deterministic)


def _deterministic(module, deterministic: bool | None) -> bool:
    """flax's convention: `deterministic` given to the constructor or to the call, not
    both. A module with dropout needs one of them when it is applied, so that dropout is
    never silently off in training; `init` (whose parameters dropout does not change) and
    a module without dropout are deterministic either way."""
    c = module.config
    if deterministic is None and module.deterministic is None:
        if (c.dropout_rate == 0.0 and c.attention_dropout_rate == 0.0) or (
                module.is_initializing()):
            return True
        raise ValueError(
            f"{type(module).__name__} has dropout (dropout_rate={c.dropout_rate}, "
            f"attention_dropout_rate={c.attention_dropout_rate}), so deterministic is "
            f"required: False to train (with rngs={{'dropout': key}}), True to evaluate, "
            f"given to the call or the constructor; got neither")
    return nn.merge_param("deterministic", module.deterministic, deterministic)


class EncoderBlock(nn.Module):
    """Self-attention over the source, then the feed-forward network.

    deterministic: as in flax, here or at the call (required when the config has
    dropout): False applies dropout, with a "dropout" rng.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> config = nn.TransformerConfig(src_vocab_size=8, tgt_vocab_size=8, d_model=32,
        ...                               num_heads=4, d_ff=64, dropout_rate=0.1)
        >>> block = nn.EncoderBlock(config)
        >>> x = jnp.ones((2, 5, 32), jnp.float32)                          # [B, S, D]
        >>> params = block.init(jax.random.key(0), x)["params"]
        >>> block.apply({"params": params}, x, deterministic=True).shape
        (2, 5, 32)
    """

    config: Any
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, x, *, mask=None, positions=None, deterministic=None, sow_weights=False):
        """x `[B, S, D]` -> `[B, S, D]`. mask: the self-attention's `attnjax.Mask` (or a
        bool array); positions: int `[B, S]`, what its order rules read."""
        deterministic = _deterministic(self, deterministic)
        attend = _attention(self.config, "self")
        x = _Residual(self.config, name="self_residual")(
            x, lambda h: attend(h, mask=mask, positions=_pair(positions),
                                deterministic=deterministic, sow_weights=sow_weights),
            deterministic=deterministic)
        return _feed_forward(self.config, x, deterministic)


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to the encoder (when given), feed-forward.

    deterministic: as in flax, here or at the call (required when the config has
    dropout).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> config = nn.TransformerConfig(src_vocab_size=8, tgt_vocab_size=8, d_model=32,
        ...                               num_heads=4, d_ff=64, dropout_rate=0.0)
        >>> block = nn.DecoderBlock(config)
        >>> x = jnp.ones((2, 3, 32), jnp.float32)                          # [B, T, D]
        >>> memory = jnp.ones((2, 5, 32), jnp.float32)                     # [B, S, D]
        >>> block.apply(block.init(jax.random.key(0), x, memory), x, memory).shape
        (2, 3, 32)
    """

    config: Any
    decode: bool = False
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, x, memory=None, *, mask=None, memory_mask=None, positions=None,
                 deterministic=None, sow_weights=False):
        """x `[B, T, D]`, memory `[B, S, D]` -> `[B, T, D]`. mask: what the causal
        self-attention hides besides the future (an `attnjax.Mask` or bool array);
        memory_mask: the cross-attention's; positions: int `[B, T]`, what the causal
        mask reads (the KV cache reads its own)."""
        deterministic = _deterministic(self, deterministic)
        attend = _attention(self.config, "self", is_causal=True, decode=self.decode)
        # the KV cache places its tokens by its own index
        self_positions = None if self.decode else _pair(positions)
        x = _Residual(self.config, name="self_residual")(
            x, lambda h: attend(h, mask=mask, positions=self_positions,
                                deterministic=deterministic, sow_weights=sow_weights),
            deterministic=deterministic)
        if memory is not None:
            # decoding projects the memory once and keeps it in the cache
            cross = _attention(self.config, "cross", cache_key_value=self.decode)
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
                 deterministic: bool, sow_weights=False):
        for i in range(self.num_layers):
            if self.encoder:
                x = EncoderBlock(self.config, name=f"layer_{i}")(
                    x, mask=mask, positions=positions, deterministic=deterministic,
                    sow_weights=sow_weights)
            else:
                x = DecoderBlock(self.config, self.decode, name=f"layer_{i}")(
                    x, memory, mask=mask, memory_mask=memory_mask, positions=positions,
                    deterministic=deterministic, sow_weights=sow_weights)
        if not self.config.pre_ln:
            return x
        return nn.LayerNorm(dtype=jnp.dtype(self.config.dtype), name="ln_final")(x)


def _embedding_init(config):
    """N(0, 1/D): after the √D scaling, tokens and sinusoids have the same unit scale."""
    return nn.initializers.normal(config.d_model ** -0.5)


def check_tokens(config, name: str, tokens, vocab_size: int, positions=None,
                 decode: bool = False) -> None:
    """Integer token ids `[B, L]`, and the positions a learned table can encode.

    Known values (outside jit) are checked: every id in [0, vocab_size), every position
    in [0, max_len) (decoding: below max_len; a negative one marks a padding slot, as
    `generate` gives them). Traced ones cannot be: there an id outside the vocabulary
    embeds as zeros (`_Embed`) and a position past the table reads its last row."""
    dtype = tokens.dtype if hasattr(tokens, "dtype") else np.asarray(tokens).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must hold integer token ids; got dtype {dtype}")
    shape = np.shape(tokens)
    if positions is not None:
        try:
            fits = np.broadcast_shapes(np.shape(positions), shape) == shape
        except ValueError:
            fits = False
        if not fits:   # (jax's broadcasting error, deep in the embedding, before)
            raise ValueError(f"the positions of {name} must broadcast to its shape "
                             f"{_checks.shape_str(shape)}; got "
                             f"{_checks.shape_str(np.shape(positions))}")
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
        positions = np.asarray(positions)
        bad = _checks.outside(positions[positions >= 0] if decode else positions, 0,
                              config.max_len - 1)
        if bad is not None:
            raise ValueError(f"the positions of {name} must lie in [0, {config.max_len}) "
                             f"(the learned positions); got {bad}")


class _Embed(nn.Module):
    """Token embedding scaled by √D, then positions, then dropout."""

    config: Any
    vocab_size: int
    decode: bool = False

    @nn.compact
    def __call__(self, tokens, positions=None, *, deterministic: bool, embed=None):
        embed = embed or nn.Embed(self.vocab_size, self.config.d_model,
                                  embedding_init=_embedding_init(self.config), name="tokens")
        # [B, L]: flax's lookup fills an out-of-range id's row with NaN (and wraps -1 to
        # the last row); under jit, where ids cannot be checked, such a token embeds as
        # zeros and the model sees only its position.
        known = (tokens >= 0) & (tokens < self.vocab_size)
        # [B, L, D]
        x = jnp.where(known[..., None],
                      _lookup(embed, jnp.where(known, tokens, 0), embed.embedding), 0.0)
        x = x * jnp.sqrt(jnp.float32(self.config.d_model))
        x = PositionalEncoding(self.config.max_len, self.config.positional, self.decode,
                               name="positions")(x, positions)
        x = nn.Dropout(self.config.dropout_rate)(x, deterministic=deterministic)
        return x.astype(jnp.dtype(self.config.dtype))


def _lookup(embed, ids, table):
    """`embed(ids)`, flax's lookup in `table` (a linen or nnx Embed's); where ids are
    sharded in their type (a mesh of Explicit axes) its rows go sharded as the ids
    (`heads.take_rows`: flax's own lookup is a ShardingTypeError there)."""
    if heads.explicit_spec(ids) is None:
        return embed(ids)
    (table,) = nn.dtypes.promote_dtype(table, dtype=embed.dtype, inexact=False)
    return heads.take_rows(table, ids)


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
    several examples in one row (training and scoring: with decode=True, `decode_logits`
    runs on a KV cache of one sequence per row, see `attnjax.nn.greedy_decode`).
    deterministic: as in flax, here or at the call (required when the config has
    dropout): False applies dropout, with a "dropout" rng.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax.nn import Transformer, TransformerConfig
        >>> config = TransformerConfig(src_vocab_size=20, tgt_vocab_size=16, d_model=32,
        ...                            num_heads=4, d_ff=64, dropout_rate=0.0)
        >>> src, tgt = jnp.ones((2, 9), jnp.int32), jnp.ones((2, 5), jnp.int32)  # [B, S], [B, T]
        >>> params = Transformer(config).init(jax.random.key(0), src, tgt)["params"]
        >>> Transformer(config).apply({"params": params}, src, tgt).shape       # [B, T, V]
        (2, 5, 16)
    """

    config: TransformerConfig
    decode: bool = False
    deterministic: bool | None = None

    def setup(self):
        check_model_config(self, TransformerConfig)
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
               deterministic=None, sow_weights=False):
        """`[B, S]` tokens -> `[B, S, D]` memory."""
        deterministic = _deterministic(self, deterministic)
        check_tokens(self.config, "src", src, self.config.src_vocab_size, src_positions)
        check_src_lengths(src_lengths, np.shape(src))
        mask = source_mask(src_lengths, src_segment_ids)
        x = self.src_embed(src, src_positions, deterministic=deterministic, embed=self.shared)
        return self.encoder(x, mask=mask, positions=src_positions, deterministic=deterministic,
                            sow_weights=sow_weights)

    def decode_logits(self, tgt, memory, src_lengths=None, *, tgt_segment_ids=None,
                      src_segment_ids=None, tgt_positions=None, deterministic=None,
                      sow_weights=False):
        """`[B, T]` target tokens and `[B, S, D]` memory -> `[B, T, V_tgt]` logits."""
        deterministic = _deterministic(self, deterministic)
        _both("tgt_segment_ids", tgt_segment_ids, "src_segment_ids", src_segment_ids)
        check_tokens(self.config, "tgt", tgt, self.config.tgt_vocab_size, tgt_positions,
                     self.decode)
        check_src_lengths(src_lengths, np.shape(memory)[:2])
        mask, memory_mask = target_masks(src_lengths, tgt_segment_ids, src_segment_ids,
                                         self.decode)
        x = self.tgt_embed(tgt, tgt_positions, deterministic=deterministic, embed=self.shared)
        x = self.decoder(x, memory, mask=mask, memory_mask=memory_mask, positions=tgt_positions,
                         deterministic=deterministic, sow_weights=sow_weights)
        return self.logits(x.astype(jnp.float32))

    def __call__(self, src, tgt, src_lengths=None, *, src_segment_ids=None,
                 tgt_segment_ids=None, src_positions=None, tgt_positions=None,
                 deterministic=None, sow_weights=False):
        """`src [B, S]`, `tgt [B, T]` -> `[B, T, V_tgt]` logits (see the class)."""
        memory = self.encode(src, src_lengths, src_segment_ids=src_segment_ids,
                             src_positions=src_positions, deterministic=deterministic,
                             sow_weights=sow_weights)
        return self.decode_logits(tgt, memory, src_lengths, tgt_segment_ids=tgt_segment_ids,
                                  src_segment_ids=src_segment_ids, tgt_positions=tgt_positions,
                                  deterministic=deterministic, sow_weights=sow_weights)


class DecoderOnly(nn.Module):
    """A causal language model: `tokens [B, L] -> logits [B, L, V]`.

    padding_mask `[B, L]` (bool, True = a token) batches sequences of different lengths,
    left- or right-padded: nothing attends to padding, and positions count the tokens
    only, so each sequence gets the logits it gets alone (those at padding mean
    nothing). segment_ids `[B, L]` (int) packs several sequences into a row (not with
    decode=True: a cache row is one sequence): a token sees the earlier tokens of its own
    segment only; positions `[B, L]` (int, restarting
    in each segment) feed the positional encoding and the causal mask. mask hides more
    keys: an `attnjax.Mask` or a bool array broadcastable to `[B, N, L, S]`, with S the
    cache length when decode=True (`attnjax.nn.generate` hides padding this way).
    deterministic: as in flax, here or at the call (required when the config has
    dropout): False applies dropout, with a "dropout" rng.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax.nn import DecoderOnly, DecoderOnlyConfig
        >>> lm = DecoderOnly(DecoderOnlyConfig(vocab_size=16, d_model=32, num_heads=4,
        ...                                    d_ff=64, dropout_rate=0.1))
        >>> tokens = jnp.array([[5, 6, 7, 0], [0, 0, 8, 9]])      # right- and left-padded
        >>> padding = tokens != 0
        >>> params = lm.init(jax.random.key(0), tokens, deterministic=True)["params"]
        >>> lm.apply({"params": params}, tokens, padding_mask=padding,
        ...          deterministic=True).shape                      # [B, L, V]
        (2, 4, 16)
    """

    config: DecoderOnlyConfig
    decode: bool = False
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, tokens, *, padding_mask=None, segment_ids=None, positions=None,
                 mask=None, deterministic=None, sow_weights=False):
        """`tokens [B, L]` -> `[B, L, V]` logits (see the class)."""
        check_model_config(self, DecoderOnlyConfig)
        c = self.config
        deterministic = _deterministic(self, deterministic)
        check_tokens(c, "tokens", tokens, c.vocab_size, positions, self.decode)
        visible, positions = sequence_mask(tokens, mask, padding_mask, segment_ids, positions,
                                           self.decode)
        x = _Embed(c, c.vocab_size, self.decode, name="embed")(
            tokens, positions, deterministic=deterministic)
        x = _Stack(c, c.num_layers, encoder=False, decode=self.decode, name="decoder")(
            x, mask=visible, positions=positions, deterministic=deterministic,
            sow_weights=sow_weights)
        return nn.Dense(c.vocab_size, name="logits")(x.astype(jnp.float32))


def check_lengths(name: str, lengths, batch: int, longest: int | float, shortest: int = 1,
                  of: str = "", shared: bool = False) -> None:
    """lengths, if given: int `[B]` (or `[]` with shared: one for every example), each in
    [shortest, longest] when known (of: what they measure, for the messages)."""
    if lengths is None:
        return
    if np.shape(lengths) != (batch,) and not (shared and np.shape(lengths) == ()):
        raise ValueError(f"{name} must have shape [B] = ({batch},){' or ()' * shared}{of}; "
                         f"got {np.shape(lengths)}")
    dtype = lengths.dtype if hasattr(lengths, "dtype") else np.asarray(lengths).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype; got {dtype}")
    if not isinstance(lengths, jax.core.Tracer):
        bad = _checks.outside(np.asarray(lengths), shortest, longest)
        if bad is not None:
            raise ValueError(f"{name} must lie in [{shortest}, {longest}]{of}; got {bad}")


def check_src_lengths(src_lengths, src_shape: tuple[int, int]) -> None:
    """src_lengths, if given: int `[B]` of the source `[B, S]` (or `[]`, shared), each
    at least 0 when known (0: a source of padding only, whose rows see nothing; past S,
    all of it, as dot_product_attention's key lengths)."""
    check_lengths("src_lengths", src_lengths, src_shape[0], np.inf, shortest=0, shared=True,
                  of=f" (the source [B, S] = {_checks.shape_str(src_shape)})")


def source_mask(src_lengths, src_segment_ids) -> masks.Mask:
    """The encoder's self-attention Mask: source padding and packed segments."""
    mask = masks.everything()
    if src_lengths is not None:
        mask = mask & masks.lengths(query=src_lengths, key=src_lengths)
    if src_segment_ids is not None:
        mask = mask & masks.segments(src_segment_ids)
    return mask


def target_masks(src_lengths, tgt_segment_ids, src_segment_ids,
                 decode: bool = False) -> tuple[masks.Mask, masks.Mask]:
    """The decoder's (self-attention, cross-attention) Masks besides causality."""
    _whole_rows("tgt_segment_ids", tgt_segment_ids, decode)
    mask, memory_mask = masks.everything(), masks.everything()
    if src_lengths is not None:
        memory_mask = masks.lengths(key=src_lengths)
    if tgt_segment_ids is not None:
        mask = masks.segments(tgt_segment_ids)
        memory_mask = memory_mask & masks.segments(tgt_segment_ids, src_segment_ids)
    return mask, memory_mask


def sequence_mask(tokens, mask, padding_mask, segment_ids, positions, decode: bool):
    """The decoder-only model's (Mask besides causality, positions) from its arguments."""
    visible = masks.everything()
    if mask is not None:
        visible = mask if isinstance(mask, masks.Mask) else masks.from_array(mask)
    if padding_mask is not None:
        padding_mask = _check_padding_mask(padding_mask, tokens, decode)
        # [B, 1, 1, L]: padding is never a key
        visible = visible & masks.from_array(padding_mask[:, None, None, :])
        if positions is None:
            # [B, L]: each sequence from 0 at its first token (padding repeats a
            # neighbour's position, unseen)
            positions = jnp.maximum(jnp.cumsum(padding_mask, axis=1, dtype=jnp.int32) - 1, 0)
    if segment_ids is not None:
        _whole_rows("segment_ids", segment_ids, decode)
        visible = visible & masks.segments(segment_ids)
    return visible, positions


def _whole_rows(name: str, segment_ids, decode: bool) -> None:
    """Packed rows are for training and scoring: a cache decodes one sequence per row."""
    if decode and segment_ids is not None:
        raise ValueError(f"{name} packs several sequences into a row, for training and "
                         f"scoring; with decode=True each row of the cache is one sequence: "
                         f"call without {name}")


def _check_padding_mask(padding_mask, tokens, decode: bool):
    """A bool `[B, L]` of the tokens' shape, as a jnp array."""
    if decode:
        raise ValueError("padding_mask applies to whole sequences; with decode=True, hide "
                         "padding with mask= over the cache, as attnjax.nn.generate does")
    dtype = getattr(padding_mask, "dtype", None)
    if dtype != jnp.bool_:
        raise TypeError(f"padding_mask must be a bool array [B, L] (True = a token); got "
                        f"{dtype if dtype is not None else type(padding_mask).__name__}")
    if np.shape(padding_mask) != np.shape(tokens):
        raise ValueError(f"padding_mask must have the shape of tokens [B, L] = "
                         f"{_checks.shape_str(np.shape(tokens))}; got "
                         f"{_checks.shape_str(np.shape(padding_mask))}")
    return jnp.asarray(padding_mask)


def attention_maps(intermediates) -> dict:
    """Sown weights as `{"encoder/layer_0/self": [B, N, T, S], ...}`.

    Pass `intermediates` from `model.apply(..., sow_weights=True,
    mutable=["intermediates"])`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from attnjax import nn
        >>> lm = nn.DecoderOnly(nn.DecoderOnlyConfig(vocab_size=16, d_model=32, num_heads=4,
        ...                                          d_ff=64, num_layers=1, dropout_rate=0.0))
        >>> tokens = jnp.ones((2, 5), jnp.int32)
        >>> params = lm.init(jax.random.key(0), tokens)["params"]
        >>> _, state = lm.apply({"params": params}, tokens, sow_weights=True,
        ...                     mutable=["intermediates"])
        >>> {k: v.shape for k, v in nn.attention_maps(state["intermediates"]).items()}
        {'decoder/layer_0/self': (2, 4, 5, 5)}
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
