"""An independent float64 NumPy statement of DESIGN.md's attention semantics."""

import numpy as np


def visible(t, s, *, is_causal=False, window=None, query_length=None, key_length=None):
    """[T, S] bool, written as the rules read: query i sits at i' = i + (S − T)."""
    out = np.ones((t, s), dtype=bool)
    for i in range(t):
        aligned = i + (s - t)
        for j in range(s):
            if is_causal and j > aligned:
                out[i, j] = False
            if window is not None and not (aligned - window[0] <= j <= aligned + window[1]):
                out[i, j] = False
            if query_length is not None and i >= query_length:
                out[i, j] = False
            if key_length is not None and j >= key_length:
                out[i, j] = False
    return out


def attention(query, key, value, *, bias=None, mask=None, scale=None, is_causal=False,
              query_lengths=None, key_lengths=None, window=None):
    """[B, T, N, V] float64 attention; rows that see no key are zero."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (query, key, value))
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    k = np.repeat(k, n // kh, axis=2)
    v = np.repeat(v, n // kh, axis=2)
    scale = 1.0 / np.sqrt(h) if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, dtype=np.float64)
    keep = np.ones((b, n, t, s), dtype=bool)
    if mask is not None:
        keep &= np.broadcast_to(np.asarray(mask), keep.shape)
    for e in range(b):
        keep[e] &= visible(
            t, s, is_causal=is_causal, window=window,
            query_length=None if query_lengths is None else int(query_lengths[e]),
            key_length=None if key_lengths is None else int(key_lengths[e]),
        )
    out = np.zeros((b, t, n, v.shape[-1]))
    for e in range(b):
        for head in range(n):
            for i in range(t):
                row = keep[e, head, i]
                if not row.any():
                    continue
                z = logits[e, head, i][row]
                w = np.exp(z - z.max())
                w /= w.sum()
                out[e, i, head] = w @ v[e, row, head]
    return out
