"""The models of `attnjax.nn.models` as flax.nnx modules.

Each nnx module holds its submodules under the names the linen module gives their
scopes (`encoder/layer_0/self/query/kernel`, …), so the two parameter trees are the same
tree: `attnjax.nnx.to_linen_params` and `from_linen_params` convert between them, and a
linen model and the nnx model holding its parameters compute the same function. They
take the same frozen configs (`TransformerConfig`, `DecoderOnlyConfig`) and the same
call arguments, plus `rngs` (an `nnx.Rngs` with a "dropout" stream) where linen takes
`rngs={"dropout": key}` in `apply`. With decode=True, `init_cache(batch_size,
max_length)` sizes every KV cache (`attnjax.kv_cache`) and the positions' counters.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from attnjax import heads, multi_head, scores
from attnjax.nn import models as linen_models
from attnjax.nn.layers import ACTIVATIONS, POSITIONAL, _sinusoids_at, check_choice
from attnjax.nn.models import (
    DecoderOnlyConfig,
    TransformerConfig,
    _both,
    check_model_config,
    check_src_lengths,
    check_tokens,
    sequence_mask,
    source_mask,
    target_masks,
)
from attnjax.nnx.attention import (MultiHeadAttention, caches_unchanged_on_error, check_rngs,
                                   write_cache)


class _Viewed:
    """`set_view` for a module with a `deterministic` attribute, which `nnx.view(model,
    deterministic=...)` sets as `model.eval()` and `model.train()` do."""

    def set_view(self, deterministic: bool | None = None):
        if deterministic is not None:
            self.deterministic = deterministic


class _ViewedModel(_Viewed):
    """`set_view` for the blocks and models: deterministic, and a clear refusal of the
    decoding views, which would reach every attention layer (an encoder's and the
    cross-attention's too) but not the position counters: built with decode=True and
    sized by init_cache, a model decodes (a view of it had decoded every token at
    position 0, silently)."""

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
                 batch_size=None, max_length: int | None = None):
        given = {name: value for name, value in (("decode", decode), ("batch_size", batch_size),
                                                 ("max_length", max_length))
                 if value is not None}
        if given:
            raise ValueError(
                f"nnx.view: attnjax.nnx's blocks and models (here a {type(self).__name__}) "
                f"take deterministic only; got {', '.join(given)}: build the model with "
                f"decode=True and call its init_cache(batch_size, max_length) "
                f"(attnjax.nnx.MultiHeadAttention alone takes them in a view)")
        super().set_view(deterministic)


class FeedForward(_Viewed, nnx.Module):
    """Position-wise Linear(d_ff) → activation → dropout → Linear(d_model): params
    wi, wo. deterministic: the call's, else the module's (`model.train()` /
    `model.eval()` set it); required when dropout_rate > 0, so that dropout is never
    silently off in training."""

    def __init__(self, d_model: int, d_ff: int, dropout_rate: float = 0.0,
                 activation: str = "relu", dtype: Any = jnp.float32, *,
                 deterministic: bool | None = None, rngs: nnx.Rngs):
        check_choice("activation", activation, ACTIVATIONS)
        self.activation = activation
        self.deterministic = deterministic
        self.wi = nnx.Linear(d_model, d_ff, dtype=dtype, rngs=rngs)
        self.wo = nnx.Linear(d_ff, d_model, dtype=dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate)

    def __call__(self, x, *, deterministic: bool | None = None,
                 rngs: nnx.Rngs | None = None):
        if deterministic is None:
            deterministic = self.deterministic
        if deterministic is None:
            if self.dropout.rate:
                raise ValueError(
                    f"FeedForward has dropout_rate={self.dropout.rate}, so deterministic is "
                    f"required: False to train (with rngs=nnx.Rngs(dropout=key)), True to "
                    f"evaluate, given to the call or set on the module (model.train(), "
                    f"model.eval()); got neither")
            deterministic = True
        act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu}[self.activation]
        # [B, L, F]
        hidden = self.dropout(act(self.wi(x)), deterministic=deterministic, rngs=rngs)
        # [B, L, D]: the sum over hidden units split in their types (Megatron's layout)
        # goes sharded as the batch
        return self.wo(hidden, out_sharding=multi_head.summed_sharding(
            hidden, self.wo.kernel[...], (hidden.ndim - 1,), (0,)))


class PositionalEncoding(nnx.Module):
    """Adds sinusoidal or learned (param "embedding" `[max_len, D]`) position encodings,
    or nothing ("none"). Positions are 0..L−1 unless given; with decode=True the
    module counts the tokens it has seen from `init_cache` (which starts or resets the
    count; a call before it is flax's error for a cache not initialised)."""

    def __init__(self, max_len: int, d_model: int, kind: str = "sinusoidal",
                 decode: bool = False, *, rngs: nnx.Rngs):
        check_choice("kind", kind, POSITIONAL)
        self.kind = kind
        self.decode = decode
        if kind == "learned":
            self.embedding = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (max_len, d_model)))
        self.position = nnx.data(None)

    def init_cache(self) -> None:
        """Start counting the tokens from position 0."""
        self.position = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(self, x, positions=None):
        length, d_model = x.shape[-2], x.shape[-1]
        if self.kind == "none":
            return x
        offset = jnp.int32(0)
        if self.decode:
            if self.position is None:
                # (positions from 0 at every call, silently, before)
                raise ValueError("Autoregressive cache not initialized, call "
                                 "``init_cache`` first.")
            offset = self.position[...]
            write_cache(self.position, offset + length)
        if positions is None:
            # [1, L]
            positions = offset + lax.broadcasted_iota(jnp.int32, (1, length), 1)
        if self.kind == "sinusoidal":
            # [B|1, L, D]
            table = _sinusoids_at(positions, d_model)
        else:
            # Positions past the table read its last row.
            table = heads.take_rows(self.embedding[...], positions, mode="clip")
        return x + table.astype(x.dtype)


def _attention(config, *, rngs, **kw) -> MultiHeadAttention:
    cap = config.attention_soft_cap
    return MultiHeadAttention(
        config.num_heads, config.d_model, num_kv_heads=config.num_kv_heads,
        dropout_rate=config.attention_dropout_rate, implementation=config.implementation,
        score_mod=None if cap is None else scores.soft_cap(cap),
        use_sinks=config.attention_sinks, score=config.attention_score,
        dtype=jnp.dtype(config.dtype), keep_rngs=False,
        rngs=rngs, **kw)


class _Residual(nnx.Module):
    """x + Dropout(f(LN(x))) (pre-LN) or LN(x + Dropout(f(x))) (post-LN)."""

    def __init__(self, config, *, rngs: nnx.Rngs):
        self.pre_ln = config.pre_ln
        self.ln = nnx.LayerNorm(config.d_model, dtype=jnp.dtype(config.dtype), rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout_rate)

    def __call__(self, x, f, *, deterministic, rngs):
        if self.pre_ln:
            return x + self.dropout(f(self.ln(x)), deterministic=deterministic, rngs=rngs)
        return self.ln(x + self.dropout(f(x), deterministic=deterministic, rngs=rngs))


def _deterministic(module, deterministic: bool | None) -> bool:
    """The call's deterministic, else the module's (`model.eval()` / `model.train()` set
    it, as in flax); a model with dropout needs one of them, so that dropout is never
    silently off in training, and one without is deterministic either way."""
    if deterministic is not None:
        return deterministic
    if module.deterministic is not None:
        return module.deterministic
    c = module.config
    if c.dropout_rate == 0.0 and c.attention_dropout_rate == 0.0:
        return True
    raise ValueError(
        f"{type(module).__name__} has dropout (dropout_rate={c.dropout_rate}, "
        f"attention_dropout_rate={c.attention_dropout_rate}), so deterministic is required: "
        f"False to train (with rngs=nnx.Rngs(dropout=key)), True to evaluate, given to the "
        f"call or set on the module (model.train(), model.eval()); got neither")


def _pair(positions):
    """Per-token positions as self-attention's (query, key) positions."""
    return None if positions is None else (positions, positions)


class EncoderBlock(_ViewedModel, nnx.Module):
    """Self-attention over the source, then the feed-forward network."""

    def __init__(self, config, *, deterministic: bool | None = None, rngs: nnx.Rngs):
        self.config = config
        self.deterministic = deterministic
        self.self = _attention(config, decode=False, rngs=rngs)
        self.self_residual = _Residual(config, rngs=rngs)
        self.ffn = FeedForward(config.d_model, config.d_ff, config.dropout_rate,
                               config.activation, jnp.dtype(config.dtype), rngs=rngs)
        self.ffn_residual = _Residual(config, rngs=rngs)

    def __call__(self, x, *, mask=None, positions=None, deterministic=None, sow_weights=False,
                 rngs=None):
        """x `[B, S, D]` -> `[B, S, D]`; as `attnjax.nn.EncoderBlock`."""
        deterministic = _deterministic(self, deterministic)
        x = self.self_residual(
            x, lambda h: self.self(h, mask=mask, positions=_pair(positions),
                                   deterministic=deterministic, rngs=rngs,
                                   sow_weights=sow_weights),
            deterministic=deterministic, rngs=rngs)
        return self.ffn_residual(
            x, lambda h: self.ffn(h, deterministic=deterministic, rngs=rngs),
            deterministic=deterministic, rngs=rngs)


class DecoderBlock(_ViewedModel, nnx.Module):
    """Causal self-attention, cross-attention to the encoder (cross=True), feed-forward."""

    def __init__(self, config, decode: bool = False, cross: bool = True, *,
                 deterministic: bool | None = None, rngs: nnx.Rngs):
        self.config = config
        self.decode = decode
        self.deterministic = deterministic
        self.self = _attention(config, is_causal=True, decode=decode, rngs=rngs)
        self.self_residual = _Residual(config, rngs=rngs)
        if cross:
            self.cross = _attention(config, decode=False, rngs=rngs)
            self.cross_residual = _Residual(config, rngs=rngs)
        else:
            self.cross = nnx.data(None)
        self.ffn = FeedForward(config.d_model, config.d_ff, config.dropout_rate,
                               config.activation, jnp.dtype(config.dtype), rngs=rngs)
        self.ffn_residual = _Residual(config, rngs=rngs)

    def __call__(self, x, memory=None, *, mask=None, memory_mask=None, positions=None,
                 deterministic=None, sow_weights=False, rngs=None):
        """x `[B, T, D]`, memory `[B, S, D]` -> `[B, T, D]`; as `attnjax.nn.DecoderBlock`."""
        deterministic = _deterministic(self, deterministic)
        # the KV cache places its tokens by its own index
        self_positions = None if self.decode else _pair(positions)
        x = self.self_residual(
            x, lambda h: self.self(h, mask=mask, positions=self_positions,
                                   deterministic=deterministic, rngs=rngs,
                                   sow_weights=sow_weights),
            deterministic=deterministic, rngs=rngs)
        if memory is not None:
            if self.cross is None:
                raise ValueError("memory was given to a DecoderBlock made with cross=False "
                                 "(no cross-attention); got memory of shape "
                                 f"{jnp.shape(memory)}")
            x = self.cross_residual(
                x, lambda h: self.cross(h, memory, mask=memory_mask, deterministic=deterministic,
                                        rngs=rngs, sow_weights=sow_weights),
                deterministic=deterministic, rngs=rngs)
        return self.ffn_residual(
            x, lambda h: self.ffn(h, deterministic=deterministic, rngs=rngs),
            deterministic=deterministic, rngs=rngs)


class _Stack(nnx.Module):
    """Layers layer_0..layer_{n-1} of one block type, and a final LayerNorm when pre-LN."""

    def __init__(self, config, num_layers: int, encoder: bool, decode: bool = False,
                 cross: bool = True, *, rngs: nnx.Rngs):
        self.num_layers = num_layers
        for i in range(num_layers):
            block = (EncoderBlock(config, rngs=rngs) if encoder
                     else DecoderBlock(config, decode, cross, rngs=rngs))
            setattr(self, f"layer_{i}", block)
        self.ln_final = (nnx.LayerNorm(config.d_model, dtype=jnp.dtype(config.dtype),
                                       rngs=rngs) if config.pre_ln else nnx.data(None))

    def __call__(self, x, memory=None, **kw):
        for i in range(self.num_layers):
            block = getattr(self, f"layer_{i}")
            x = block(x, **kw) if isinstance(block, EncoderBlock) else block(x, memory, **kw)
        return x if self.ln_final is None else self.ln_final(x)


class _Embed(nnx.Module):
    """Token embedding scaled by √D (own table "tokens", or a shared one), then
    positions, then dropout."""

    def __init__(self, config, vocab_size: int, decode: bool = False, own_table: bool = True,
                 *, rngs: nnx.Rngs):
        self.config = config
        self.vocab_size = vocab_size
        self.tokens = _embedding(config, vocab_size, rngs) if own_table else nnx.data(None)
        self.positions = PositionalEncoding(config.max_len, config.d_model, config.positional,
                                            decode, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout_rate)

    def __call__(self, tokens, positions=None, *, deterministic: bool, rngs=None, embed=None):
        embed = embed or self.tokens
        # an id outside the vocabulary (only under jit, where it cannot be checked)
        # embeds as zeros, as in the linen model
        known = (tokens >= 0) & (tokens < self.vocab_size)
        # [B, L, D]
        x = jnp.where(known[..., None], linen_models._lookup(
            embed, jnp.where(known, tokens, 0), embed.embedding[...]), 0.0)
        x = x * jnp.sqrt(jnp.float32(self.config.d_model))
        x = self.positions(x, positions)
        x = self.dropout(x, deterministic=deterministic, rngs=rngs)
        return x.astype(jnp.dtype(self.config.dtype))


def _embedding(config, vocab_size: int, rngs) -> nnx.Embed:
    """N(0, 1/D): after the √D scaling, tokens and sinusoids have the same unit scale."""
    return nnx.Embed(vocab_size, config.d_model,
                     embedding_init=nnx.initializers.normal(config.d_model ** -0.5), rngs=rngs)


def _init_caches(model, batch_size: int, max_length: int, dtype) -> None:
    """Size every decoding self-attention's cache and reset every position counter. A
    cache longer than learned positions is refused: its tokens past them would all be
    encoded at the last (the linen model's `init` refuses such an input)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, PositionalEncoding) and module.kind == "learned":
            rows = module.embedding.shape[0]
            if max_length > rows:
                raise ValueError(f"max_length={max_length} exceeds the model's max_len={rows} "
                                 f"learned positions")
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MultiHeadAttention) and module.decode:
            module.init_cache((batch_size, max_length, module.in_features), dtype)
        elif isinstance(module, PositionalEncoding) and module.decode:
            module.init_cache()


class Transformer(_ViewedModel, nnx.Module):
    """Encoder–decoder Transformer: `(src [B, S], tgt [B, T]) -> logits [B, T, V_tgt]`,
    as `attnjax.nn.Transformer` (the same arguments, plus rngs for dropout)."""

    def __init__(self, config: TransformerConfig, decode: bool = False, *,
                 deterministic: bool | None = None, rngs: nnx.Rngs):
        c = self.config = config
        check_model_config(self, TransformerConfig)
        check_rngs(rngs)
        self.decode = decode
        self.deterministic = deterministic
        shared = c.share_embeddings
        self.src_embed = _Embed(c, c.src_vocab_size, own_table=not shared, rngs=rngs)
        self.tgt_embed = _Embed(c, c.tgt_vocab_size, decode, own_table=not shared, rngs=rngs)
        self.shared_embedding = (_embedding(c, c.src_vocab_size, rngs) if shared
                                 else nnx.data(None))
        self.encoder = _Stack(c, c.num_encoder_layers, encoder=True, rngs=rngs)
        self.decoder = _Stack(c, c.num_decoder_layers, encoder=False, decode=decode, rngs=rngs)
        self.logits = nnx.Linear(c.d_model, c.tgt_vocab_size, rngs=rngs)

    def init_cache(self, batch_size: int, max_length: int) -> None:
        """Size the decoder's KV caches for `[batch_size, max_length]` targets."""
        _init_caches(self, batch_size, max_length, jnp.dtype(self.config.dtype))

    def encode(self, src, src_lengths=None, *, src_segment_ids=None, src_positions=None,
               deterministic=None, sow_weights=False, rngs=None):
        """`[B, S]` tokens -> `[B, S, D]` memory."""
        deterministic = _deterministic(self, deterministic)
        check_tokens(self.config, "src", src, self.config.src_vocab_size, src_positions)
        check_src_lengths(src_lengths, np.shape(src))
        mask = source_mask(src_lengths, src_segment_ids)
        x = self.src_embed(src, src_positions, deterministic=deterministic, rngs=rngs,
                           embed=self.shared_embedding)
        return self.encoder(x, mask=mask, positions=src_positions, deterministic=deterministic,
                            sow_weights=sow_weights, rngs=rngs)

    def decode_logits(self, tgt, memory, src_lengths=None, *, tgt_segment_ids=None,
                      src_segment_ids=None, tgt_positions=None, deterministic=None,
                      sow_weights=False, rngs=None):
        """`[B, T]` target tokens and `[B, S, D]` memory -> `[B, T, V_tgt]` logits."""
        deterministic = _deterministic(self, deterministic)
        _both("tgt_segment_ids", tgt_segment_ids, "src_segment_ids", src_segment_ids)
        check_tokens(self.config, "tgt", tgt, self.config.tgt_vocab_size, tgt_positions,
                     self.decode)
        check_src_lengths(src_lengths, np.shape(memory)[:2])
        mask, memory_mask = target_masks(src_lengths, tgt_segment_ids, src_segment_ids,
                                         self.decode)
        with caches_unchanged_on_error():
            x = self.tgt_embed(tgt, tgt_positions, deterministic=deterministic, rngs=rngs,
                               embed=self.shared_embedding)
            x = self.decoder(x, memory, mask=mask, memory_mask=memory_mask,
                             positions=tgt_positions, deterministic=deterministic,
                             sow_weights=sow_weights, rngs=rngs)
        return self.logits(x.astype(jnp.float32))

    def __call__(self, src, tgt, src_lengths=None, *, src_segment_ids=None,
                 tgt_segment_ids=None, src_positions=None, tgt_positions=None,
                 deterministic=None, sow_weights=False, rngs=None):
        memory = self.encode(src, src_lengths, src_segment_ids=src_segment_ids,
                             src_positions=src_positions, deterministic=deterministic,
                             sow_weights=sow_weights, rngs=rngs)
        return self.decode_logits(tgt, memory, src_lengths, tgt_segment_ids=tgt_segment_ids,
                                  src_segment_ids=src_segment_ids, tgt_positions=tgt_positions,
                                  deterministic=deterministic, sow_weights=sow_weights,
                                  rngs=rngs)


class DecoderOnly(_ViewedModel, nnx.Module):
    """A causal language model: `tokens [B, L] -> logits [B, L, V]`, as
    `attnjax.nn.DecoderOnly` (the same arguments, plus rngs for dropout)."""

    def __init__(self, config: DecoderOnlyConfig, decode: bool = False, *,
                 deterministic: bool | None = None, rngs: nnx.Rngs):
        c = self.config = config
        check_model_config(self, DecoderOnlyConfig)
        check_rngs(rngs)
        self.decode = decode
        self.deterministic = deterministic
        self.embed = _Embed(c, c.vocab_size, decode, rngs=rngs)
        self.decoder = _Stack(c, c.num_layers, encoder=False, decode=decode, cross=False,
                              rngs=rngs)
        self.logits = nnx.Linear(c.d_model, c.vocab_size, rngs=rngs)

    def init_cache(self, batch_size: int, max_length: int) -> None:
        """Size the KV caches for `[batch_size, max_length]` sequences."""
        _init_caches(self, batch_size, max_length, jnp.dtype(self.config.dtype))

    def __call__(self, tokens, *, padding_mask=None, segment_ids=None, positions=None,
                 mask=None, deterministic=None, sow_weights=False, rngs=None):
        """`tokens [B, L]` -> `[B, L, V]` logits; as `attnjax.nn.DecoderOnly`."""
        c = self.config
        deterministic = _deterministic(self, deterministic)
        check_tokens(c, "tokens", tokens, c.vocab_size, positions, self.decode)
        visible, positions = sequence_mask(tokens, mask, padding_mask, segment_ids, positions,
                                           self.decode)
        with caches_unchanged_on_error():
            x = self.embed(tokens, positions, deterministic=deterministic, rngs=rngs)
            x = self.decoder(x, mask=visible, positions=positions, deterministic=deterministic,
                             sow_weights=sow_weights, rngs=rngs)
        return self.logits(x.astype(jnp.float32))


def counterpart(linen_model, *, rngs: nnx.Rngs):
    """The `attnjax.nnx` model of an `attnjax.nn` `Transformer` or `DecoderOnly`: the
    same class, config and decode, with fresh parameters from rngs (load the linen
    model's with `from_linen_params`)."""
    for linen_cls, nnx_cls in ((linen_models.Transformer, Transformer),
                               (linen_models.DecoderOnly, DecoderOnly)):
        if isinstance(linen_model, linen_cls):
            return nnx_cls(linen_model.config, linen_model.decode,
                           deterministic=linen_model.deterministic, rngs=rngs)
    raise TypeError("linen_model must be an attnjax.nn.Transformer or attnjax.nn.DecoderOnly; "
                    f"got {type(linen_model).__name__}")
