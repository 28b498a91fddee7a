"""The cuDNN implementation: delegates to `jax.nn.dot_product_attention` on a GPU.

Only for what cuDNN's fused kernel supports (bool array masks and jax.nn's keywords);
anything else is a clear error rather than a silent fallback, so a user who asked for
cuDNN knows what ran.
"""

import jax
import jax.numpy as jnp

from attnjax.masks import Mask


def attention(query, key, value, score, options, *, mask, is_causal, query_lengths,
              key_lengths, window, positions):
    """`[B, T, N, H]` attention through cuDNN; arguments already validated."""
    platform = jax.default_backend()
    if platform != "gpu":
        raise ValueError(
            f"implementation='cudnn' needs a CUDA GPU; the default backend is {platform!r}. "
            "Use implementation=None or 'dense'"
        )
    unsupported = []
    if isinstance(mask, Mask):
        unsupported.append("an attnjax.Mask (pass a bool array or the jax.nn keywords)")
    for name, given in (("positions", positions is not None),
                        ("score_mod", score.mod is not None),
                        ("sinks", score.sinks is not None),
                        ("return_residual", options.return_residual)):
        if given:
            unsupported.append(name)
    if options.dropout_rate > 0.0:
        unsupported.append(f"dropout_rate={options.dropout_rate}")
    if value.shape[-1] != query.shape[-1]:
        unsupported.append(f"value head dim V={value.shape[-1]} != H={query.shape[-1]}")
    if is_causal and query.shape[1] != key.shape[1]:
        # cuDNN aligns the causal mask top-left; attnjax's is bottom-right.
        unsupported.append(f"is_causal with T={query.shape[1]} != S={key.shape[1]}")
    if window is not None and (window[1] != 0 or query.shape[1] != key.shape[1]):
        unsupported.append(f"window={window} (cuDNN takes (left, 0) with T = S)")
    if query.dtype not in (jnp.float16, jnp.bfloat16):
        unsupported.append(f"dtype {query.dtype} (cuDNN takes float16 or bfloat16)")
    if unsupported:
        raise ValueError("implementation='cudnn' does not support " + "; ".join(unsupported))
    bias = None if score.bias is None else score.bias
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=score.scale, is_causal=is_causal,
        query_seq_lengths=query_lengths, key_value_seq_lengths=key_lengths,
        local_window_size=window, implementation="cudnn",
    )
