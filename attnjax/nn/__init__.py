"""Flax linen modules on attnjax's functions (layer 5), and KV-cache decoding.

  attention   MultiHeadAttention: flax's parameters and cache convention
  layers      FeedForward, PositionalEncoding (sinusoidal or learned)
  models      EncoderBlock, DecoderBlock, Transformer, DecoderOnly, their configs,
              attention_maps; segment ids and positions for packed sequences
  decoding    greedy_decode (encoder–decoder), generate (decoder-only, prompts of
              different lengths left-padded)
"""

from attnjax.nn.attention import MultiHeadAttention
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
    "PositionalEncoding",
    "Transformer",
    "TransformerConfig",
    "attention_maps",
    "generate",
    "greedy_decode",
    "sinusoids",
]
