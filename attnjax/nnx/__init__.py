"""Flax NNX modules on attnjax's functions: the `attnjax.nn` (linen) modules as
`flax.nnx` modules, their parameters convertible to and from the linen ones.

  attention   MultiHeadAttention: a drop-in for flax.nnx.MultiHeadAttention (its
              constructor, call, state, init_cache and errors) on attnjax's engine
  models      FeedForward, PositionalEncoding, EncoderBlock, DecoderBlock, Transformer,
              DecoderOnly, configured by attnjax.nn's frozen configs
  convert     to_linen_params / from_linen_params: the parameters of a model as the
              linen model's tree, and back
"""

from attnjax.nnx.attention import MultiHeadAttention
from attnjax.nnx.convert import from_linen_params, to_linen_params
from attnjax.nnx.models import (
    DecoderBlock,
    DecoderOnly,
    EncoderBlock,
    FeedForward,
    PositionalEncoding,
    Transformer,
)

__all__ = [
    "DecoderBlock",
    "DecoderOnly",
    "EncoderBlock",
    "FeedForward",
    "MultiHeadAttention",
    "PositionalEncoding",
    "Transformer",
    "from_linen_params",
    "to_linen_params",
]
