"""The dense implementation: one head, all T×S weights materialised.

The reference implementation, and the only one that can return the weights. The batched
API (`attnjax.attention.dot_product_attention`) vmaps it over heads and batch.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnjax import core, masks


def dense_attention(
    q: Float[ArrayLike, "T H"],
    k: Float[ArrayLike, "S H"],
    v: Float[ArrayLike, "S V"],
    *,
    bias: Float[ArrayLike, "#T #S"] | None,
    mask: Bool[ArrayLike, "#T #S"] | None,
    query_length: Int[ArrayLike, ""] | None,
    key_length: Int[ArrayLike, ""] | None,
    is_causal: bool,
    window: tuple[int, int] | None,
    scale: float | None,
    dropout_rate: float,
    dropout_key: Array | None,
    return_weights: bool,
    score_fn=None,
) -> tuple[Float[ArrayLike, "T V"], Float[ArrayLike, "T S"] | None]:
    """Attention of one head with every mask applied; weights before dropout if asked."""
    num_queries, num_keys = q.shape[0], k.shape[0]
    q_pos, k_pos = masks.positions(num_queries, num_keys)
    # [T, S] or None: the structural rule (causal, window, lengths) and the user's mask.
    visible = masks.visible(
        q_pos,
        k_pos,
        num_queries=num_queries,
        num_keys=num_keys,
        is_causal=is_causal,
        window=window,
        query_length=query_length,
        key_length=key_length,
    )
    visible = masks.combine_masks(visible, mask)
    # [T, S], float32; a custom alignment replaces the scaled dot product and its scale.
    scores = core.logits(q, k, bias=bias, scale=None if score_fn else scale, score_fn=score_fn)
    weights = core.masked_softmax(scores, visible)
    mixed = weights
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_key, 1.0 - dropout_rate, weights.shape)
        mixed = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    out = core.mix_values(mixed, v)
    return out, (weights.astype(q.dtype) if return_weights else None)
