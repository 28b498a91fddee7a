"""The cuDNN implementation: delegates to `jax.nn.dot_product_attention` on a GPU.

Only for what cuDNN's fused kernel supports (bool array masks and jax.nn's keywords);
anything else is a clear error rather than a silent fallback, so a user who asked for
cuDNN knows what ran. attnjax's semantics hold: a query row that sees no key (a key
length of 0, a padded query, a mask row of False) gives zeros, where cuDNN leaves
values in it (measured on an H100 through jax 0.11.2: up to 4.4 on random data).
"""

import jax
import jax.numpy as jnp

from attnjax.masks import Mask


def attention(query, key, value, score, options, *, mask, is_causal, query_lengths,
              key_lengths, window, positions, bound: Mask):
    """`[B, T, N, H]` attention through cuDNN; arguments already validated. `bound`:
    the call's mask bound to its shapes (which rows see a key)."""
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
    out = jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=score.scale, is_causal=is_causal,
        query_seq_lengths=query_lengths, key_value_seq_lengths=key_lengths,
        local_window_size=window, implementation="cudnn",
    )
    if mask is None and query_lengths is None and key_lengths is None:
        return out  # causal and window masks (T = S here) let every row see itself
    return jnp.where(_sees_a_key(bound, *query.shape[:3], key.shape[1])[..., None], out, 0)


def _sees_a_key(bound: Mask, b: int, t: int, n: int, s: int):
    """`[B, T, N]`: whether each query row sees at least one key (one reduction over S,
    fused by XLA: the [T, S] mask is not kept)."""
    per_head = jax.tree.map(lambda x: jnp.broadcast_to(x, (b, n) + x.shape[2:]), bound)

    def rows(head: Mask):
        return head.visible(head.coords(0, t, 0, s)).any(axis=-1)

    return jax.vmap(jax.vmap(rows))(per_head).transpose(0, 2, 1)
