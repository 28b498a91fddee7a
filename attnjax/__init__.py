"""attnjax: scaled dot-product and multi-head attention for JAX.

Layers, each built on the ones before it:
  core         attention / attention_weights for one example and one head
  masks        the Mask value (causal, window, lengths, segments, prefix, chunked causal,
               from_array, from_fn, combined with & and |) and its block classifier
  scores       alignment functions, score modifications (soft_cap, alibi,
               relative_position_bias) and the score spec of a call
  options      the plain options of a call
  dense        the single-head kernel that materialises the weights (the reference)
  chunked      the single-head block-sparse online-softmax kernel, O(T + S) memory
  cudnn        delegation to jax.nn's cuDNN kernel on a GPU
  attention    dot_product_attention on [B, T, N, H]: keywords -> Mask, Score, Options;
               a kernel vmapped over heads and batch
  multi_head   init_multi_head_attention / multi_head_attention (flax's parameter tree)

Flax modules live in `attnjax.nn` (linen) and `attnjax.nnx` (imported on first use:
flax takes longer to import than the rest of attnjax); toy tasks, training and the CLI
in `attnjax.toy`.
"""

import importlib

from attnjax.attention import IMPLEMENTATIONS, dot_product_attention, score_attention
from attnjax.core import attention, attention_weights, masked_softmax
from attnjax import masks, scores
from attnjax.masks import (
    Mask,
    causal_mask,
    combine_masks,
    padding_mask,
    query_key_mask,
    sliding_window_mask,
)
from attnjax.multi_head import init_multi_head_attention, multi_head_attention
from attnjax.scores import additive_score, dot_score, general_score, scaled_dot_score

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("nn", "nnx")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"attnjax.{name}")
    raise AttributeError(f"module 'attnjax' has no attribute {name!r}")

__all__ = [
    "IMPLEMENTATIONS",
    "Mask",
    "additive_score",
    "attention",
    "attention_weights",
    "causal_mask",
    "combine_masks",
    "dot_product_attention",
    "dot_score",
    "general_score",
    "init_multi_head_attention",
    "masks",
    "masked_softmax",
    "multi_head_attention",
    "nn",
    "nnx",
    "padding_mask",
    "query_key_mask",
    "scaled_dot_score",
    "scores",
    "score_attention",
    "sliding_window_mask",
]
