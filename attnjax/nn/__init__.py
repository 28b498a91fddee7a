"""Flax linen modules on attnjax's functions (layer 5), and KV-cache decoding.

  attention   MultiHeadDotProductAttention (and MultiHeadAttention, SelfAttention): a
              drop-in for flax's, with its fields, parameters, cache and auto-names
  layers      FeedForward, PositionalEncoding (sinusoidal or learned)
  models      EncoderBlock, DecoderBlock, Transformer, DecoderOnly, their configs,
              attention_maps; segment ids and positions for packed sequences, a
              padding mask for padded ones
  decoding    greedy_decode (encoder–decoder), generate (decoder-only, prompts of
              different lengths left- or right-padded); sized_for_every_append, for
              a decoding step of one's own
"""

from attnjax.kv_cache import sized_for_every_append
from attnjax.nn.attention import (
    MultiHeadAttention,
    MultiHeadDotProductAttention,
    SelfAttention,
)
from attnjax.nn.decoding import generate, greedy_decode
from attnjax.nn.layers import FeedForward, PositionalEncoding, sinusoids
from attnjax.nn.models import (
    DecoderBlock,
    DecoderOnly,
    DecoderOnlyConfig,
    EncoderBlock,
    Transformer,
    TransformerConfig,
    attention_maps,
)

__all__ = [
    "DecoderBlock",
    "DecoderOnly",
    "DecoderOnlyConfig",
    "EncoderBlock",
    "FeedForward",
    "MultiHeadAttention",
    "MultiHeadDotProductAttention",
    "PositionalEncoding",
    "SelfAttention",
    "Transformer",
    "TransformerConfig",
    "attention_maps",
    "generate",
    "greedy_decode",
    "sinusoids",
    "sized_for_every_append",
]
