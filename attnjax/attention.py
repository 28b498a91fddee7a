"""Layer 4: batched, multi-head `dot_product_attention` on `[B, T, N, H]` arrays.

The public keywords become one `Mask`, one `Score` and one `Options` here, once, and
nothing else travels down: a kernel takes `(q, k, v, mask, score, options)`. Every
per-call array (segment ids, lengths, positions, bias, sinks, dropout keys) is laid out
as `[B|1, N|1, ...]` when it is bound, so that mapping over the batch (B), the key/value
heads (K) and the query heads of each group (G) hands each head its own slice
(`attnjax.heads`): the dense kernel is one head mapped so; the chunked kernel maps the
arithmetic of one block so, inside block loops that run over all heads at once.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import weakref

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
from jax.extend.core.primitives import jit_p
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Real

from attnjax import _checks, chunked, core, cudnn, dense, heads, masks
from attnjax.masks import Mask, Shape
from attnjax.options import Options
from attnjax.scores import Score, _logits_dtype

# name -> can it return the weights?
_KERNELS = {"dense": True, "chunked": False}
IMPLEMENTATIONS = ("dense", "chunked", "cudnn")
CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")

# implementation=None on a CPU runs dense while T·S is at most AUTO_CHUNKED_ABOVE, chunked
# above it, and chunked already above AUTO_CHUNKED_GRID when the batch's float32 logits,
# B·N·T·S·4 bytes, exceed AUTO_DENSE_BYTES. Measured on a 2-core CPU, attention alone,
# forward and backward, each kernel timed in runs of its own (N=8, H=32 or 64, causal
# and not), the chunked kernel against dense: at T=S=512, 0.96-1.03 at B=1 (8 MiB of
# logits), 1.03-1.19 at B=2, 1.34-2.34 at B=4; at T=S=384, 1.01-1.06 at B=2, H=64
# (9 MiB); at T=S=256 dense stays ahead to B=16 (32 MiB: 0.82-1.08), at T=S=128 to
# B=64 (0.82-1.01). Below them the dense weights fit in cache and the blocked loop only
# adds overhead.
AUTO_CHUNKED_ABOVE = 512 * 512
AUTO_CHUNKED_GRID = 256 * 256
AUTO_DENSE_BYTES = 8 * 2**20
# On a GPU or TPU, implementation=None runs dense while the batch's float32 logits,
# B·N·T·S·4 bytes, are at most AUTO_ACCELERATOR_DENSE_BYTES, whatever the grid: XLA's
# fused dense attention there is several times faster than the blocked loop. Measured on
# an H100 (jax 0.11.2), causal attention's forward and backward, the chunked kernel's
# time over dense's: 5.9 at (B, T, N, H) = (4, 2048, 16, 128) bfloat16 (30.7 against
# 5.2 ms, jax.nn's XLA 5.1 ms); a whole attention layer's training step at (1, 4096, 512
# model width, 8 heads) ran 11.5 ms chunked against flax's 3.5 ms dense. Above the bound
# (4 GiB of logits; dense attention's forward and backward keep 2.1-2.5 times the logits
# in XLA temporaries, by XLA's memory_analysis of the batch-whole program a GPU runs,
# compiled for a CPU) the chunked kernel's memory, linear in S, keeps long sequences on
# the device. TPUs are not measured. On a device that tells the memory jax may use
# (`memory_stats()["bytes_limit"]`: by default 75% of a GPU's), the bound is also at most
# AUTO_ACCELERATOR_DENSE_SHARE of it, so that dense's temporaries take at most about a
# fifth of it: 4 GiB of logits, ~10 GiB of temporaries, would not fit the ~11 GiB that
# jax takes of a 16 GB card, where the chunked kernel's would. (An H100 or H200, 75% of
# 80 or 139 GiB, keeps the 4 GiB.)
AUTO_ACCELERATOR_DENSE_BYTES = 4 * 2**30
AUTO_ACCELERATOR_DENSE_SHARE = 1 / 12
# A decoding step (T = 1) on a CPU runs chunked when its keys, B·S·K·H·4 bytes, reach
# AUTO_DECODE_KEY_BYTES and one example's, S·K·H·4, reach AUTO_DECODE_EXAMPLE_BYTES:
# the dense kernel copies k into its head-major layout at every step and makes its
# [S, V] products with v, the chunked one works block by block, in cache. From 32 MiB
# on, glibc maps each such buffer afresh at every step (its mmap threshold), and
# faulting its pages in costs more than the work. Measured, one step against a cache
# (float32, T = 1, k and v laid out [B, S, K, H], each kernel timed interleaved), dense
# over chunked time, N=K=8, H=64: B=8, S=2048 (32 MiB) 1.43; B=4, S=4096 1.44; B=1,
# S=16384 2.16, S=32768 2.73; N=K=16, H=128: B=1, S=4096 2.45; B=2, S=2048 1.73; below
# 32 MiB 0.77-1.05 (B=4, S=2048 0.77; B=1, S=8192 1.05; B=2, S=4096 0.97, 1.34 in
# another run); a batch of short caches stays dense (B=16, S=1024, 2 MiB an example:
# 0.74; B=64, S=256: 0.39).
AUTO_DECODE_KEY_BYTES = 32 * 2**20
AUTO_DECODE_EXAMPLE_BYTES = 4 * 2**20


def dot_product_attention(
    query: Float[ArrayLike, "*B T N H"],
    key: Float[ArrayLike, "*B S K H"],
    value: Float[ArrayLike, "*B S K V"],
    bias: Float[ArrayLike, "..."] | None = None,
    mask: Mask | Bool[ArrayLike, "..."] | None = None,
    *,
    scale: float | Real[ArrayLike, ""] | None = None,
    is_causal: bool = False,
    query_lengths: Int[ArrayLike, "*B"] | None = None,
    key_lengths: Int[ArrayLike, "*B"] | None = None,
    window: int | tuple[int, int] | None = None,
    positions: tuple[Int[ArrayLike, "..."], Int[ArrayLike, "..."]] | None = None,
    score_mod=None,
    sinks: Float[ArrayLike, " N"] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    dropout_broadcast: bool = False,
    return_weights: bool = False,
    return_residual: bool = False,
    implementation: str | None = None,
    block_sizes: tuple[int, int] | None = None,
    alignment=None,
    causal_alignment: str = "bottom_right",
    query_seq_lengths: Int[ArrayLike, "*B"] | None = None,
    key_value_seq_lengths: Int[ArrayLike, "*B"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
):
    """Scaled dot-product attention over a batch and several heads.

    softmax(score_mod(Q Kᵀ · scale + bias)) V per example and head, over the keys each
    query may see. Axis letters: B batch, T query length, S key length, N query heads,
    K key/value heads (N = K·G: grouped-query attention when K < N), H query/key head
    dim, V value head dim.

    Every argument of `jax.nn.dot_product_attention` is accepted with its meaning
    (`query_seq_lengths`, `key_value_seq_lengths`, `local_window_size` and
    `implementation="xla"` are other spellings of attnjax's own). Two deliberate
    differences: causal and window masks align the last query with the last key when
    T ≠ S (`causal_alignment="top_left"` gives jax.nn's), and a query that sees no key
    gets zeros where jax.nn averages every value.

    The kernel runs as one jitted function, compiled once per shape and static options:
    called eagerly, or under an eager grad or vmap, it is one program (its derivative
    one more); inside jit XLA inlines it. A call with a score_mod, an alignment or a
    `masks.from_fn` rule of its own is traced into the caller's program instead, or, on
    concrete arrays, compiled once the same functions come again.

    Args:
      query: `[B, T, N, H]`, or `[T, N, H]` for one unbatched example.
      key: `[B, S, K, H]` (or `[S, K, H]`); K must divide N.
      value: `[B, S, K, V]` (or `[S, K, V]`); same dtype as query and key.
      bias: float, broadcastable to `[B, N, T, S]` (`[N, T, S]` unbatched, or jax.nn's
        `[1, N, T, S]`); added to the logits. Use it for additive masks and
        relative-position biases.
      mask: an `attnjax.Mask` (`attnjax.masks.causal() & masks.segments(ids)`, ...)
        or a bool array broadcastable to `[B, N, T, S]` (`[N, T, S]` unbatched, or
        `[1, N, T, S]`), True = may attend. A float array is a TypeError: pass
        additive values as bias.
      scale: logit scale; 1/√H when None. A number or a 0-d array, checked to lie in
        [1.2e-38, 1e4]; under jit or grad it may be traced (not checked then), as a
        learned temperature.
      is_causal: key j is visible to query i when j ≤ i + (S − T): the *last* query
        sees every key. The usual triangle when T = S, and right for a KV-cache step or
        chunked prefill (T < S). `jax.nn.dot_product_attention` aligns top-left
        (j ≤ i) instead: see causal_alignment. Same as `mask=masks.causal()`.
      query_lengths: int `[B]` (`[]` or `[1]` unbatched), the valid query lengths;
        query rows at or past the length are padding and give zeros.
      key_lengths: int `[B]` (`[]` or `[1]` unbatched), the valid key lengths; keys at
        or past the length are never attended to.
      window: `(left, right)` or an int w for `(w, w)`: query i sees key j when
        i' − left ≤ j ≤ i' + right, with i' = i + (S − T) its position.
      positions: `(query_positions, key_positions)`, int `[B, T]` and `[B, S]` (or
        `[T]` and `[S]` shared by the batch): the positions causal, window, prefix and
        chunked-causal masks and score_mod read. Default: bottom-right aligned, query i
        at i + (S − T) and key j at j.
      score_mod: `score_mod(score, b, n, q_pos, k_pos) -> score`, applied elementwise
        to the scaled logits (plus bias) before masking, on blocks: score float32
        `[T', S']`, b and n int32 scalars, q_pos `[T', 1]`, k_pos `[1, S']`; it returns
        floating scores of the score's shape (a bool rule is a mask: `masks.from_fn`).
        Gradients reach the arrays it closes over. Built in: `attnjax.scores.soft_cap`, `alibi`,
        `relative_position_bias`, `chain`.
      sinks: float `[N]`, one learned logit per query head that joins every row's
        softmax denominator with a zero value vector (attention sinks); differentiable.
      dropout_rate: inverted dropout on the attention weights, in [0, 1); independent
        per example and head. The masks drawn from one key differ by implementation
        (the chunked kernel draws one per block, so its block sizes count too).
      dropout_rng: a `jax.random` key; required when dropout_rate > 0.
      dropout_broadcast: share one dropout mask across the batch and the heads
        (flax's `broadcast_dropout=True`) instead of drawing one per example and head.
      return_weights: also return the `[B, N, T, S]` weights (before dropout); only
        the dense implementation can.
      return_residual: also return the log-sum-exp of each row's logits, `[B, T, N]`
        in the input dtype (jax.nn's name, layout and dtype; float32 inside for 16-bit),
        differentiable. A row that sees no key (and no sink) has log-sum-exp −1e30
        (`attnjax.core.MASKED`; float16's lowest value in float16), never −inf; one
        beyond the input dtype's range is its largest value, never inf.
      implementation: "dense" (materialises the `[T, S]` weights of each head),
        "chunked" (block-sparse online softmax: O(T + S) memory forward and backward,
        blocks the mask hides skipped) or "cudnn" (delegates to
        `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only, bool arrays
        and the jax.nn keywords only). None picks dense when weights are asked for;
        on a CPU, for T·S ≤ 512² (above 256² only while the batch's logits are at
        most 8 MiB: B·N·T·S ≤ 2²¹; and not for one query against keys of 32 MiB or
        more, 4 MiB an example, a decoding step against a long cache), where the
        value alone (no derivative taken) of 64 queries or more runs chunked once
        the logits pass 8 MiB under a mask, 16 MiB without; on a GPU or TPU, while the
        batch's float32 logits are at most 4 GiB (B·N·T·S ≤ 2³⁰) and a twelfth of the
        device's memory limit; and chunked otherwise. "xla" (jax.nn's name) is the
        same as None, both kernels being plain XLA.
      block_sizes: `(block_q, block_k)` for the chunked implementation (a ValueError
        where the call runs another kernel, None's choice included); chosen per shape
        when None. Lengths need not be multiples of them.
      alignment: `(score_fn, params)`, a learned alignment `score_fn(q [T, Hq],
        k [S, Hk], **params) -> [T, S]` (e.g. `attnjax.general_score`) replacing the
        scaled dot product, with each of `params` `[N, ...]` (one set per query head);
        dense only, and scale does not apply.
      causal_alignment: where the default positions put the queries when T ≠ S:
        "bottom_right" (query i at i + (S − T): the last query sees every key) or
        "top_left" (query i at i: key j ≤ i under is_causal, jax.nn's alignment, also
        for window). The same as `positions=(arange(T), arange(S))`; not combined with
        positions. Equal when T = S.
      query_seq_lengths: jax.nn's name for query_lengths, int `[B]`; give one of them.
      key_value_seq_lengths: jax.nn's name for key_lengths, int `[B]`; give one of them.
      local_window_size: jax.nn's name for window, `(left, right)` or an int; give one
        of them.

    Returns:
      `[B, T, N, V]` (or `[T, N, V]`) in the input dtype. With return_weights, the
      pair (output, weights `[B, N, T, S]`); with return_residual, (output,
      log-sum-exp `[B, T, N]`); with both, (output, weights, log-sum-exp). A query that
      sees no key gets zeros, and zero gradients, in every dtype. Softmax and
      accumulation run in float32 for float16/bfloat16 inputs.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> query = jnp.ones((2, 5, 8, 16))                                # [B, T, N, H]
        >>> key = jnp.ones((2, 9, 2, 16))                                  # [B, S, K, H]
        >>> value = jnp.ones((2, 9, 2, 32))                                # [B, S, K, V]
        >>> attnjax.dot_product_attention(query, key, value, is_causal=True).shape
        (2, 5, 8, 32)
    """
    for name, flag in (("is_causal", is_causal), ("dropout_broadcast", dropout_broadcast),
                       ("return_weights", return_weights), ("return_residual", return_residual)):
        _checks.check_flag(name, flag)
    query_lengths = _one_of("query_lengths", query_lengths, "query_seq_lengths", query_seq_lengths)
    key_lengths = _one_of("key_lengths", key_lengths, "key_value_seq_lengths",
                          key_value_seq_lengths)
    window = _one_of("window", window, "local_window_size", local_window_size)
    # Python lists and numbers too, as jax.nn takes them
    bias, mask, query_lengths, key_lengths = (_checks.as_array(name, x) for name, x in (
        ("bias", bias), ("mask", mask), ("query_lengths", query_lengths),
        ("key_lengths", key_lengths)))
    if implementation == "xla":
        # jax.nn's name for plain XLA, which both of attnjax's own kernels are.
        implementation = None
    query, key, value, shape = _check_inputs(query, key, value, alignment is None)
    dtype = key.dtype
    if (dtype in (jnp.float16, jnp.bfloat16) and alignment is None
            and implementation != "cudnn" and isinstance(scale, jax.core.Tracer)):
        # A traced scale is folded into the queries (`_traced_scale`), which in 16 bits
        # would round it and every q (a bfloat16 scale of 0.3: 0.30078): float32
        # inside, as for the softmax, and the results in the inputs' dtype. (A number
        # is applied to the float32 logits instead: `scores.split_scale`.)
        query, key, value = (x.astype(jnp.float32) for x in (query, key, value))
    query, scale = _traced_scale(query, scale, alignment)
    if shape.unbatched:   # jax.nn's forms too: it gives an unbatched call a batch of one
        bias, mask = _batch_of_one_dropped(bias, 4), _batch_of_one_dropped(mask, 4)
        query_lengths = _batch_of_one_dropped(query_lengths, 1)
        key_lengths = _batch_of_one_dropped(key_lengths, 1)
    positions = _aligned_positions(shape, causal_alignment, positions)
    attention_mask = _mask_from_keywords(
        shape, mask, is_causal=is_causal, query_lengths=query_lengths,
        key_lengths=key_lengths, window=window)
    score = _score(shape, query.shape[-1], bias, scale, score_mod, sinks, alignment)
    # one example's keys [S, K, H], in bytes
    key_bytes = int(np.prod(key.shape[1:])) * key.dtype.itemsize
    typed = _sharded_in_types(query, key, value)
    name = _select_implementation(implementation, return_weights, shape, score, key_bytes, typed)
    if typed:
        query, key, value = _sequences_gathered(query, key, value)
    options = _options(shape, name, implementation, dropout_rate, dropout_rng,
                       dropout_broadcast, return_weights, return_residual, block_sizes)
    bound = attention_mask.bind(shape, positions, traced=not _concrete(query))
    if name == "cudnn":
        out = cudnn.attention(
            query, key, value, score, options, mask=mask, is_causal=is_causal,
            query_lengths=query_lengths, key_lengths=key_lengths,
            window=_checks.resolve_window(window), positions=positions, bound=bound)
        lse = weights = None
    else:
        compute = _per_head
        computed = _compiles(query, key, value, bound, score, options)
        if computed is not None:
            compute = functools.partial(_compiled_per_head, computed, _trace_settings())
        value_name = (name if typed else
                      _value_kernel(implementation, name, shape, attention_mask, score, options))
        try:
            out, lse, weights = compute(name, query, key, value, bound, score, options,
                                        value_name=value_name)
        except TypeError as error:   # jax's message names neither kernel
            if name != "chunked" or "forward-mode autodiff" not in str(error):
                raise
            raise TypeError(
                "implementation='chunked' is differentiated in reverse mode (jax.grad, "
                "jax.vjp) only: forward mode (jax.jvp, jax.linearize, jax.jacfwd, "
                "jax.hessian) takes implementation='dense'") from None
    if shape.unbatched:
        out, lse, weights = (None if x is None else x[0] for x in (out, lse, weights))
    out, weights = (None if x is None else x.astype(dtype) for x in (out, weights))
    if lse is not None and lse.dtype != dtype:
        # in the inputs' dtype, as jax.nn returns it (computed in float32 for float16 and
        # bfloat16): code written for jax.nn hands back a cotangent of that dtype. A row
        # that sees nothing keeps a finite log-sum-exp: float16's lowest, not −inf; one
        # past float16's range (logits of 1e5 from float16 inputs) its largest, not inf.
        lowest, largest = (jnp.asarray(f, lse.dtype) for f in (jnp.finfo(dtype).min,
                                                               jnp.finfo(dtype).max))
        lse = jnp.clip(lse, lowest, largest).astype(dtype)
    extras = ((weights,) if return_weights else ()) + ((lse,) if return_residual else ())
    return (out, *extras) if extras else out


def score_attention(query, key, value, score_fn, score_params, bias=None, mask=None,
                    **options):
    """Batched multi-head attention with a learned alignment function (always dense).

    Batched multi-head attention with a learned alignment function and per-head
    parameters: `dot_product_attention(query, key, value, bias, mask,
    alignment=(score_fn, score_params), **options)`, always dense.

    Args:
      query: `[B, T, N, Hq]` (or `[T, N, Hq]`).
      key: `[B, S, K, Hk]` (or `[S, K, Hk]`).
      value: `[B, S, K, V]` (or `[S, K, V]`).
      score_fn: the alignment function, `score_fn(q [T, Hq], k [S, Hk], **params)`
        (e.g. `attnjax.general_score`, `attnjax.additive_score`).
      score_params: a dict of its keyword parameters, each with a leading axis of size N
        (one set per query head).
      bias: as for `dot_product_attention`.
      mask: as for `dot_product_attention`.
      **options: any other keyword of `dot_product_attention` but scale.

    Returns:
      As `dot_product_attention`.

    Examples:
        >>> import jax.numpy as jnp, attnjax
        >>> q = k = v = jnp.ones((2, 5, 4, 8))                             # [B, T, N, H]
        >>> w = jnp.stack([jnp.eye(8)] * 4)                                # [N, H, H]
        >>> attnjax.score_attention(q, k, v, attnjax.general_score, {"w": w}).shape
        (2, 5, 4, 8)
    """
    return dot_product_attention(query, key, value, bias, mask,
                                 alignment=(score_fn, score_params), **options)


# --------------------------------------------------------------------------------------
# The boundary: checks, and the keywords turned into Mask, Score and Options.


def _one_of(name: str, value, alias: str, alias_value):
    """A keyword given under attnjax's name or jax.nn's, not both."""
    if alias_value is None:
        return value
    if value is not None:
        raise ValueError(f"{name} and {alias} are two names for one argument; give one of "
                         f"them, got both")
    return alias_value


def _batch_of_one_dropped(x, rank: int):
    """An unbatched call's array x without its leading axis when it has `rank` axes and
    that one has size 1: jax.nn adds a batch of one to an unbatched call and takes
    its bias and mask 4-D (`[1, N, T, S]`) and its lengths `[1]`."""
    if x is None or isinstance(x, Mask) or np.ndim(x) != rank or np.shape(x)[0] != 1:
        return x
    return x[0] if hasattr(x, "shape") else np.asarray(x)[0]


def _traced_scale(query, scale, alignment):
    """(query, scale) with a traced scale (under jit, or a learned temperature under grad,
    as jax.nn takes it) folded into the query (float32 or float64 by then). The kernels'
    first step is q·scale in q's dtype, so the result has the bits it has for that number
    given as a Python float (which is range-checked; a traced one cannot be), for float32
    and float64 inputs."""
    if alignment is not None or not isinstance(scale, jax.core.Tracer):
        return query, scale
    if not _checks.is_real_scalar(scale):
        raise TypeError(f"scale must be a real number or a 0-d array of one; got a traced "
                        f"{scale.dtype} {_checks.shape_str(scale.shape)}")
    return query * scale.astype(query.dtype), 1.0


def _aligned_positions(shape: Shape, causal_alignment, positions):
    """The call's positions: given, or None (bottom-right, the Mask's default), or
    top-left (query i at position i)."""
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}; got "
                         f"{causal_alignment!r}")
    if causal_alignment == "bottom_right":
        return positions
    if positions is not None:
        raise ValueError("causal_alignment='top_left' places the queries by default "
                         "positions; with positions= given, leave causal_alignment at "
                         "'bottom_right' (positions decide)")
    # With T = S both alignments are the same positions; None keeps the default path
    # (and cuDNN, which takes no positions).
    if shape.t == shape.s:
        return None
    return jnp.arange(shape.t, dtype=jnp.int32), jnp.arange(shape.s, dtype=jnp.int32)


def _check_inputs(query, key, value, same_head_dim: bool):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if hasattr(x, "dtype"):   # the dtype given: jnp.asarray makes int64 int32 (no x64)
            _checks.check_floating(name, x)
    query, key, value = (_checks.as_array(name, x, required=True) for name, x in (
        ("query", query), ("key", key), ("value", value)))
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.check_floating(name, x)
        _checks.check_concrete_shape(name, x)
    if query.ndim == 2:
        raise ValueError(
            f"query must have rank 3 or 4 ([B, T, N, H] or [T, N, H]); got shape "
            f"{_checks.shape_str(query.shape)} (rank 2): the heads axis N is missing. For "
            f"one head, add it with query[:, None, :] (and key, value alike), or use "
            f"attnjax.attention on [T, H]")
    _checks.check_rank("query", query, (3, 4), "[B, T, N, H] or [T, N, H]")
    unbatched = query.ndim == 3
    layouts = {
        "query": "[T, N, H]" if unbatched else "[B, T, N, H]",
        "key": "[S, K, H]" if unbatched else "[B, S, K, H]",
        "value": "[S, K, V]" if unbatched else "[B, S, K, V]",
    }
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim:
            short = "query" if query.ndim < x.ndim else name
            axis = "N" if short == "query" else "K"
            raise ValueError(
                f"{name} must have the rank of query; got {name} "
                f"{_checks.shape_str(x.shape)} (rank {x.ndim}) and query "
                f"{_checks.shape_str(query.shape)} (rank {query.ndim}). Batched, they are "
                f"query [B, T, N, H], key [B, S, K, H], value [B, S, K, V]: {short} lacks "
                f"an axis; if it is [B, L, H], its heads axis {axis} is missing: add it "
                f"with {short}[:, :, None, :]"
            )
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.check_floating(name, x)
    _checks.check_same_dtype(query=query, key=key, value=value)
    # An empty axis leaves nothing to attend with (1/√H, the kernels' row reductions and
    # block loops need one element); an empty V is fine: the output is empty too.
    sizes = dict(zip("TNH" if unbatched else "BTNH", query.shape))
    sizes |= dict(zip("SK", key.shape[-3:-1]))
    if 0 in sizes.values():
        raise ValueError(
            f"query, key and value must not be empty; got "
            f"{', '.join(f'{axis}=0' for axis, size in sizes.items() if size == 0)} in query "
            f"{_checks.shape_str(query.shape)} {layouts['query']}, key "
            f"{_checks.shape_str(key.shape)} {layouts['key']}")
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    _check_shapes(query, key, value, layouts, same_head_dim)
    b, t, n, _ = query.shape
    return query, key, value, Shape(b, t, key.shape[1], n, unbatched)


def _check_shapes(query, key, value, layouts, same_head_dim: bool) -> None:
    b, t, n, h = query.shape
    unbatched = layouts["query"] == "[T, N, H]"
    # as given: an unbatched example without the batch axis added to it
    shapes = {name: _checks.shape_str(x.shape[1:] if unbatched else x.shape) for name, x in
              (("query", query), ("key", key), ("value", value))}

    # Rank-3 arrays are one unbatched example; batched ones that lost their heads axis
    # look the same, and then fail here.
    hint = ("; rank 3 is one example [T, N, H]: if the first axis is the batch, the heads "
            "axis is missing ([B, T, H]): add it with x[:, :, None, :]"
            if unbatched else "")

    def fail(what: str) -> None:
        raise ValueError(
            f"{what}; got query {shapes['query']} {layouts['query']}, key {shapes['key']} "
            f"{layouts['key']}, value {shapes['value']} {layouts['value']}{hint}"
        )

    if not key.shape[0] == value.shape[0] == b:
        fail("query, key and value must share the batch size B")
    if key.shape[1] != value.shape[1]:
        fail("key and value must share the key length S")
    if key.shape[2] != value.shape[2]:
        fail("key and value must share the number of key/value heads K")
    if same_head_dim and key.shape[3] != h:
        fail("query and key must share the head dim H")
    if key.shape[2] == 0 or n % key.shape[2] != 0:
        fail(f"the number of key/value heads K={key.shape[2]} must divide the query heads N={n}")


def _mask_from_keywords(shape: Shape, mask, *, is_causal, query_lengths, key_lengths,
                        window) -> Mask:
    """The jax.nn-style keywords and a bool array or Mask, as one Mask."""
    rank_layout = "[B]" if not shape.unbatched else "[]"
    expected = () if shape.unbatched else (shape.b,)
    for name, x in (("query_lengths", query_lengths), ("key_lengths", key_lengths)):
        if x is not None:
            _checks.check_lengths(name, x, expected, rank_layout)
    parts = []
    if mask is not None:
        parts.append(mask if isinstance(mask, Mask) else masks.from_array(mask))
    if is_causal:
        parts.append(masks.causal())
    if window is not None:
        parts.append(masks.window(*_checks.resolve_window(window)))
    if query_lengths is not None or key_lengths is not None:
        parts.append(masks.lengths(query_lengths, key_lengths))
    result = masks.everything()
    for part in parts:
        result = result & part
    return result


def _score(shape: Shape, head_dim: int, bias, scale, score_mod, sinks, alignment) -> Score:
    """The score spec, its arrays checked and laid out per head."""
    layout = "[N, T, S]" if shape.unbatched else "[B, N, T, S]"
    target = (shape.b, shape.n, shape.t, shape.s)
    if bias is not None:
        _checks.check_bias("bias", bias, target[1:] if shape.unbatched else target, layout)
        bias = jnp.asarray(bias)
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable score_mod(score, b, n, q_pos, k_pos); "
                        f"got {type(score_mod).__name__}")
    if score_mod is not None:
        _checks.check_arguments("score_mod", score_mod, "score_mod(score, b, n, q_pos, k_pos)",
                                5)
    made_for = getattr(score_mod, "num_heads", None)
    if made_for is not None and made_for != shape.n:
        raise ValueError(f"score_mod holds values for {made_for} query heads (its slopes "
                         f"or table, `[..., N]`); got N={shape.n} query heads")
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        _checks.check_floating("sinks", sinks)
        _checks.check_param_shape("sinks", sinks, (shape.n,), "[N]")
        _checks.check_finite_or_minus_inf("sinks", sinks, "no sink")
        # Under jit a sink's value is unknown: +inf, the limit of a sink that takes
        # every weight, is taken as the largest finite logit, so that its head's output
        # is zeros and every gradient finite (inf - inf made them NaN).
        sinks = jnp.minimum(sinks, jnp.finfo(sinks.dtype).max)[None]
    align, align_params = None, None
    if alignment is None:
        scale = _checks.resolve_scale(scale, head_dim)
    else:
        if scale is not None:
            raise ValueError(f"scale={scale} applies to the scaled dot product only; with "
                             "alignment, put the scale inside score_fn")
        align, align_params = _check_alignment(alignment, shape.n)
        align_params = {name: x[None] for name, x in align_params.items()}
    return Score(scale, score_mod, align, bias, sinks, align_params)


def _check_alignment(alignment, num_heads: int):
    if not isinstance(alignment, (tuple, list)) or len(alignment) != 2:
        raise TypeError(f"alignment must be a pair (score_fn, params); got {alignment!r}")
    score_fn, score_params = alignment
    if not callable(score_fn):
        raise TypeError(f"score_fn must be callable; got {type(score_fn).__name__}")
    if not isinstance(score_params, dict):
        raise TypeError(f"score_params must be a dict of arrays; got {type(score_params).__name__}")
    for name, x in score_params.items():
        if jnp.ndim(x) < 1 or jnp.shape(x)[0] != num_heads:
            raise ValueError(
                f"score_params[{name!r}] must have a leading head axis of size N={num_heads}; "
                f"got shape {_checks.shape_str(jnp.shape(x))}"
            )
    return score_fn, {name: jnp.asarray(x) for name, x in score_params.items()}


def _sharded_in_types(*arrays) -> str | None:
    """Where the chunked kernel's loops cannot run these arrays `[B, L, ...]`: a
    sequence axis sharded in its type (a mesh of Explicit axes), whose blocks the loops
    would slice across devices; None where it can (the batch and the heads may be
    sharded)."""
    for x in arrays:
        spec = _sequence_sharded(x)
        if spec is not None:
            return (f"on a sequence sharded in its type (a mesh of jax.sharding.AxisType."
                    f"Explicit axes, jax.make_mesh's default under jax.set_mesh; got "
                    f"sharding {spec}); attnjax.parallel's ring attention runs a sharded "
                    f"sequence")
    return None


def _sequence_axis(x) -> int:
    """The length axis of `[B, L, ...]` (or unbatched `[L, N, ·]`)."""
    return 0 if x.ndim == 3 else 1


def _sequence_sharded(x):
    """x's PartitionSpec where a mesh of Explicit axes shards its sequence axis in its
    type; else None."""
    spec, axis = heads.explicit_spec(x), _sequence_axis(x)
    return spec if spec is not None and axis < len(spec) and spec[axis] is not None else None


def _sequences_gathered(*arrays):
    """The arrays with their sequence axis unsharded, where a mesh of Explicit axes
    shards it in their types: the dense kernel's products over a sharded length axis
    are ambiguous to jax (a ShardingTypeError), gathered they are not."""
    def gathered(x):
        spec = _sequence_sharded(x)
        if spec is None:
            return x
        return heads.reshard(
            x, [None if a == _sequence_axis(x) else entry for a, entry in enumerate(spec)])
    return tuple(map(gathered, arrays))


def _select_implementation(implementation, return_weights: bool, shape: Shape,
                           score: Score, key_bytes: int, typed: str | None = None) -> str:
    """The kernel of a call. typed: `_sharded_in_types`' reason, where the chunked
    kernel cannot run (implementation=None then runs the dense one)."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, None or jax.nn's 'xla'; got "
            f"{implementation!r}"
        )
    if implementation == "chunked" and typed:
        raise ValueError(f"implementation='chunked' does not run {typed}; "
                         f"implementation='dense' does")
    name = implementation
    if name is None:
        name = ("dense" if return_weights or score.align is not None or typed
                else _auto_kernel(shape.b, shape.t, shape.s, shape.n, key_bytes))
    if return_weights and not _KERNELS.get(name, False):
        raise ValueError(
            f"return_weights=True needs implementation='dense' (the only one that "
            f"materialises the [B, N, T, S] weights); got implementation={implementation!r}"
        )
    if score.align is not None and name != "dense":
        raise ValueError(f"a learned alignment (score_fn) runs on implementation='dense' "
                         f"only; got implementation={implementation!r}")
    return name


def _logits_bytes(batch: int, t: int, s: int, num_heads: int) -> int:
    """The bytes of a call's logits in float32, B·N·T·S·4: what the kernel rules weigh."""
    return batch * num_heads * t * s * 4


def _user_functions(mask: Mask, score: Score) -> tuple:
    """The user's functions a call carries (score_mod, an alignment, from_fn masks):
    compiled into its program, and free to close over arrays."""
    return tuple(f for f in (score.mod, score.align, *mask.functions()) if f is not None)


def _auto_kernel(batch: int, t: int, s: int, num_heads: int, key_bytes: int = 0) -> str:
    """The kernel implementation=None runs where either can (see AUTO_CHUNKED_ABOVE and
    AUTO_ACCELERATOR_DENSE_BYTES); key_bytes: one example's keys, S·K·H·itemsize."""
    grid = t * s
    logits_bytes = _logits_bytes(batch, t, s, num_heads)
    if jax.default_backend() != "cpu":
        return "dense" if logits_bytes <= _accelerator_dense_bytes() else "chunked"
    dense = grid <= AUTO_CHUNKED_ABOVE and (
        grid <= AUTO_CHUNKED_GRID or logits_bytes <= AUTO_DENSE_BYTES)
    long_cache = (t == 1 and key_bytes >= AUTO_DECODE_EXAMPLE_BYTES
                  and batch * key_bytes >= AUTO_DECODE_KEY_BYTES)
    return "dense" if dense and not long_cache else "chunked"


# On a CPU the value alone (no derivative taken: evaluation, inference) of a call that
# implementation=None runs dense, of VALUE_CHUNKED_MIN_T queries or more, goes to the
# chunked kernel once the batch's float32 logits pass AUTO_DENSE_BYTES under a mask,
# twice that without one; its derivatives stay dense, faster there. Forward only, 2-core
# CPU, dense's time over chunked's: causal at (B, T, N, H) = (8, 256, 8, 32), 16 MiB of
# logits, 2.1-3.2; (16, 256, 4, 64) 2.1, (32, 128, 8, 32) 2.5, (256, 64, 8, 16) 2.8, (128,
# 64, 8, 32) 1.1, (8, 256, 8, 64) 1.0-1.2; (4, 256, 8, 32), 8 MiB, 0.85; unmasked at 16
# MiB 0.72-0.93 ((128, 64, 8, 32) 1.05), at 32 MiB 1.3-1.7; with key lengths, (B, T, S,
# N, H) = (32, 64, 1024, 8, 32) 2.5, but fewer queries make the chunked kernel's blocks
# thin: (64, 16, 1024, 8, 64) 0.65, a decoding step (512, 1, 1024, 8, 64) 0.36. With
# derivatives, dense's over chunked's at 16 MiB: 0.64-1.00.
VALUE_CHUNKED_MIN_T = 64


def _value_kernel(implementation, name: str, shape: Shape, mask: Mask, score: Score,
                  options: Options) -> str:
    """The kernel of the call's value alone, where no derivative is taken."""
    if (implementation is not None or name != "dense" or jax.default_backend() != "cpu"
            or shape.t < VALUE_CHUNKED_MIN_T or score.align is not None
            or options.dropout_rate > 0.0 or options.return_weights):
        return name
    logits_bytes = _logits_bytes(shape.b, shape.t, shape.s, shape.n)
    limit = AUTO_DENSE_BYTES * (1 if not mask.is_everything else 2)
    return "chunked" if logits_bytes > limit else name


def _accelerator_dense_bytes() -> float:
    """The most logits (bytes) implementation=None runs dense on a GPU or TPU: 4 GiB, or
    AUTO_ACCELERATOR_DENSE_SHARE of the device's memory limit where that is less."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except (RuntimeError, NotImplementedError):   # a backend that cannot tell
        stats = None
    limit = (stats or {}).get("bytes_limit")
    if not limit:
        return float(AUTO_ACCELERATOR_DENSE_BYTES)
    return min(float(AUTO_ACCELERATOR_DENSE_BYTES), AUTO_ACCELERATOR_DENSE_SHARE * limit)


def _options(shape: Shape, name: str, implementation, dropout_rate, dropout_rng,
             dropout_broadcast, return_weights, return_residual, block_sizes) -> Options:
    dropout_rate = _checks.check_dropout(dropout_rate, dropout_rng)
    blocks = (None, None)
    if block_sizes is not None:
        blocks = _checks.resolve_block_sizes(block_sizes)
        if name != "chunked":
            raise ValueError(
                f"block_sizes={block_sizes} applies to implementation='chunked'; "
                f"got implementation={implementation!r}, which runs {name!r}"
            )
    keys = None
    if dropout_rate > 0.0:
        # One key per (example, query head): dropout masks independent across both,
        # unless one mask is to be shared by all.
        if dropout_broadcast:
            keys = jnp.asarray(dropout_rng)[None, None]
        else:
            keys = jax.random.split(dropout_rng, shape.b * shape.n)
            keys = keys.reshape((shape.b, shape.n) + keys.shape[1:])
    return Options(dropout_rate, bool(return_weights), bool(return_residual), *blocks, keys)


# --------------------------------------------------------------------------------------
# One kernel, mapped over G, K and B.


def _per_head(name: str, query, key, value, mask: Mask, score: Score, options: Options,
              value_name: str | None = None):
    """The kernel `name` for every example and head: out `[B, T, N, V]`, log-sum-exp
    `[B, T, N]`, weights `[B, N, T, S]` or None. The value alone (no derivative taken)
    runs on the kernel `value_name` (default: `name`)."""
    # the query's batch sharding for every array of the call (keys put on a mesh beside
    # a query that is not, lengths split by examples beside unsplit inputs), as the
    # results and the chunked kernel's accumulators take the query's
    query, (key, value, mask, score, options) = heads.batch_sharded_as(
        query, (key, value, mask, score, options))
    mask, score = heads.past_heads_whole((mask, score))
    spec = heads.explicit_spec(query)
    if spec is not None and any(tuple(spec)[:3]) and _user_functions(mask, score):
        # Batch or heads sharded in their type (a mesh of Explicit axes): the user's
        # functions index arrays by the example and head indices, sharded there, and jax
        # cannot tell how to shard such a gather (`slopes[n]`: a ShardingTypeError). The
        # kernel runs with the mesh's Explicit axes Auto, its results sharded as the query.
        b, _, n = (tuple(spec) + (None,) * 3)[:3]
        out_sharding = [heads.sharding(entries, query) for entries in (
            (b, None, n, None), (b, None, n), (b, n, None, None))]
        if not options.return_weights:
            out_sharding[2] = None
        mesh = jax.typeof(query).sharding.mesh
        explicit = tuple(axis for axis, kind in zip(mesh.axis_names, mesh.axis_types)
                         if kind == jax.sharding.AxisType.Explicit)  # (not shard_map's)
        # arrays on the mesh that the functions close over (a table made under
        # jax.set_mesh) are Explicit there, which the kernel's Auto context refuses:
        # they come in as arguments, made Auto as the others
        mask, score, taken, give = _on_mesh_taken_out(mesh, query, key, mask, score)

        def kernel(query, key, value, mask, score, options, taken):
            mask, score = give(mask, score, taken)
            return _per_head_kernel(name, query, key, value, mask, score, options,
                                    value_name)

        return jax.sharding.auto_axes(kernel, axes=explicit, out_sharding=tuple(
            out_sharding))(query, key, value, mask, score, options, taken)
    if spec is not None and _user_functions(mask, score):
        # batch and heads whole: the functions run on the mesh as they are, and one
        # closing over an array split over it is the named error above, not jax's
        _on_mesh_taken_out(jax.typeof(query).sharding.mesh, query, key, mask, score)
    return _per_head_kernel(name, query, key, value, mask, score, options, value_name)


def _on_mesh(x) -> bool:
    """Whether x is a jax array typed on a mesh of Explicit axes."""
    return isinstance(x, jax.Array) and heads.explicit_spec(x) is not None


def _on_mesh_taken_out(mesh, query, key, mask: Mask, score: Score):
    """`(mask, score, taken, give)`: the call's functions (`_function_examples`) with
    the arrays on `mesh` that they close over, `taken`, made their arguments, and
    `give(mask, score, taken)`, the functions given them back. Given back, a function is
    traced in `mesh`'s context (where the arrays it reads are typed) on arguments of the
    shapes it is called with, and its jaxpr run there, on the arrays given."""
    taken, converted = [], {}
    for name, fn, args, kwargs in _function_examples(query, key, mask, score):
        try:
            closed = jax.make_jaxpr(lambda a, k, fn=fn: fn(*a, **k))(args, kwargs)
        except Exception as error:  # noqa: BLE001 (the kernel reports the function's)
            if type(error).__name__ != "ShardingTypeError":
                continue
            raise ValueError(
                f"the {name} function closes over an array split over the mesh, which "
                f"one example and head's indices cannot index in jax (an array it "
                f"indexes by them must be on the mesh replicated, "
                f"jax.sharding.reshard(x, P()), or a NumPy array): {error}") from None
        on_mesh = [c for c in closed.consts if _on_mesh(c)]
        if on_mesh:
            converted[id(fn)] = (len(taken), [id(c) for c in on_mesh])
            taken += on_mesh

    def give(mask: Mask, score: Score, taken: list):
        def given(fn):
            if id(fn) not in converted:
                return fn
            start, ids = converted[id(fn)]
            values = dict(zip(ids, taken[start:start + len(ids)]))

            def run(*args, **kwargs):
                shapes = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)),
                    (args, kwargs))
                with jax.sharding.use_abstract_mesh(mesh):
                    closed, out = jax.make_jaxpr(lambda a, k: fn(*a, **k),
                                                 return_shape=True)(*shapes)
                consts = [values.get(id(c), c) for c in closed.consts]
                try:
                    outs = _run_here(closed.jaxpr, consts, jax.tree.leaves((args, kwargs)))
                except ValueError as error:   # an operation's types of the mesh's axes
                    if "should match" not in str(error):
                        raise
                    raise _cannot_run_here(f"an operation whose types keep the mesh's axes "
                                           f"({str(error).splitlines()[0]})") from None
                return jax.tree.unflatten(jax.tree.structure(out), outs)

            return run

        return (mask.with_functions(lambda fn: (given(fn), ())),
                dataclasses.replace(score, mod=given(score.mod), align=given(score.align)))

    return mask, score, taken, give


def _per_head_kernel(name: str, query, key, value, mask: Mask, score: Score,
                     options: Options, value_name: str | None = None):
    b, t, n, h = query.shape
    s, kv_heads = key.shape[1], key.shape[2]
    g = n // kv_heads
    meta = heads.group((mask, score, options), n, kv_heads)
    # [B, T, K, G, H]
    grouped = query.reshape(b, t, kv_heads, g, h)
    if name == "chunked":  # its block loops run over all heads at once
        out, lse, weights = chunked.attend(grouped, key, value, *meta)
    else:
        mapped = lambda size: heads.over_heads(  # noqa: E731
            functools.partial(dense.attend, group=g), (size, kv_heads, g),
            ("rows", "kv", "kv", "heads", "heads", "heads"),
            ("rows", "rows", "heads"))
        whole, parts = mapped(b), _dense_parts(b, t, s, n)
        derived = heads.in_parts(mapped, b, parts) if parts > 1 else whole
        alone = chunked.attend if value_name == "chunked" else whole
        out, lse, weights = _value_and_derivatives(
            alone, derived, (grouped, key, value, *meta),
            closures=bool(_user_functions(mask, score)))
    # out [B, T, K, G, V], lse [B, T, K, G], weights [B, K, G, T, S] or None
    return (out.reshape(b, t, n, value.shape[-1]), lse.reshape(b, t, n),
            None if weights is None else weights.reshape(b, n, t, s))


# On a CPU the dense kernel's derivatives run on parts of the batch whose logits
# (float32, all heads) are about this many bytes: independent computations that XLA's
# CPU runtime runs side by side on the cores, each on intermediates small enough to
# stay in cache. A causal attention training step on a 2-core CPU against flax's
# (benchmarks/train_step.py, which prints the batch-whole ratio beside): at (B, T, N) =
# (32, 64, 4), 2 MiB of logits, 1.10x in 4 parts against 1.00x whole (with this
# constant at 2 and 1 MiB and 256 KiB, in 2 parts 1.05x, in 8 0.91x); at (8, 512, 8),
# 64 MiB, 1.61x in 8 parts (one example each) against 1.14x whole (in 4 parts 1.39x).
# Each part is traced and compiled on its own, so there are at most DENSE_PARTS_MAX.
# Heads of fewer than DENSE_PART_MIN_GRID logits (a toy task's 16-token sources) are
# too little work for parts of this size: a batch of them runs in two halves, one per
# core of a 2-core CPU, once its logits reach half a part (the copy model's whole
# training step, 128 sources of 16 tokens, 4 heads: flax's time over attnjax's 1.05-1.07
# in two halves against 1.03-1.05 whole, five runs of 101 steps interleaved; the default
# `python train_toy.py` 11.3-11.6 s against 11.6-11.8 s from an empty compilation
# cache), and a decoding step (T = 1) runs whole.
# A forward pass alone runs whole: against jax.nn.dot_product_attention, forward only,
# dense, causal / not, 2-core CPU, one process: (B, T, N, H) = (4, 128, 8, 64) 0.91 /
# 0.83 in 4 parts, 1.05 / 1.12 whole; (8, 128, 8, 64) 0.94 / 0.85 in 8, 1.20 / 1.30
# whole; (32, 64, 4, 32) 0.95 / 1.02 in 4, 1.04 / 1.06 whole.
DENSE_PART_BYTES = 2**19
DENSE_PARTS_MAX = 8
DENSE_PART_MIN_GRID = 64 * 64


def _value_and_derivatives(alone, derived, args: tuple, *, closures: bool):
    """`alone(*args)`, with the derivatives of `derived(*args)`, the same function
    computed otherwise: the dense kernel's derivatives in parts of the batch, its value
    whole (faster so, see DENSE_PART_BYTES) or on the chunked kernel (see _value_kernel).

    With `closures` (the functions may close over arrays: a score_mod's table, a from_fn
    mask's ids, traced by an enclosing jit or grad) the arrays they close over become
    arguments of the custom JVP, which could not close over them."""
    if alone is derived:
        return alone(*args)
    alone_consts = derived_consts = ()
    if closures:
        alone, alone_consts = chunked.closure_convert(alone, *args)
        derived, derived_consts = chunked.closure_convert(derived, *args)
    given, kept = len(args), len(alone_consts)

    @jax.custom_jvp
    def run(*xs):
        return alone(*xs[:given], *xs[given:given + kept])

    @run.defjvp
    def run_jvp(primals, tangents):
        # the closed-over arrays come twice, once for each function; derivatives flow
        # through derived's
        return jax.jvp(lambda *xs: derived(*xs[:given], *xs[given + kept:]), primals,
                       tangents)

    return run(*args, *alone_consts, *derived_consts)


def _dense_parts(batch: int, t: int, s: int, num_heads: int) -> int:
    """How many parts of the batch the dense kernel runs on (see DENSE_PART_BYTES)."""
    if jax.default_backend() != "cpu":
        return 1
    logits = _logits_bytes(batch, t, s, num_heads)
    if t * s < DENSE_PART_MIN_GRID:
        return 2 if t > 1 and batch > 1 and logits >= DENSE_PART_BYTES // 2 else 1
    return max(1, min(batch, DENSE_PARTS_MAX, logits // DENSE_PART_BYTES))


def _concrete(x) -> bool:
    """Whether x has a value now: a concrete array, or one an eager jax.grad or jvp
    traces (not a value jit, vmap or shard_map traces)."""
    try:
        jax.extend.core.concrete_or_error(None, x)
    except jax.errors.ConcretizationTypeError:
        return False
    return True


# A call runs as one jitted function, compiled once per shape and static options, rather
# than as the hundreds of one-operation programs the kernel is made of: a user's eager
# call, a flax module outside jit, and an eager jax.grad or jax.vmap of either get one
# program (an eager gradient of a masked call: 0.4 s of CPU to its first result where
# operation by operation took 2.3 s); inside jit the nested call is traced once per shape
# (a model's layers of one shape share it) and XLA inlines it. The functions a call
# carries (score_mod, an alignment, from_fn masks) are part of what it is compiled for: a
# call on traced arrays with functions is traced into the caller's program as it is, as
# is a call whose functions are new (a lambda written in the call; compiling for a
# function used once would cost more); once the same functions come again on concrete
# arrays, they compile, for what they compute at that call (`functions_as_of`): a
# function that reads a Python number or an array it closes over, changed since,
# compiles again, as an eager call reads the state of the moment.
def _per_head_as_of(computed, settings, *args, **kwargs):
    """`_per_head(*args, **kwargs)`, compiled apart for each `computed` (see
    functions_as_of) and `settings` (`_trace_settings`)."""
    del computed, settings
    return _per_head(*args, **kwargs)


_compiled_per_head = jax.jit(_per_head_as_of, static_argnums=(0, 1, 2),
                             static_argnames="value_name")


def _trace_settings() -> tuple:
    """What the kernels read while they are traced besides their arguments: the backend
    and the tuning constants, which a benchmark, a test or a user may change. Part of
    the compiled call's key, so that a change is traced anew (a cached trace had kept
    the old parts of the batch, say)."""
    return (jax.default_backend(), DENSE_PART_BYTES, DENSE_PARTS_MAX, DENSE_PART_MIN_GRID,
            chunked.DEFAULT_BLOCK_Q, chunked.DEFAULT_BLOCK_K, chunked.LOGITS_BLOCK_BYTES,
            chunked.BOUNDED_RANGE, core.ONE_PASS_TERMS)


# The functions of recent calls, held weakly where they allow it (a lambda is kept alive
# by nothing here, and a new one never matches a dead one).
_RECENT_FUNCTIONS: collections.OrderedDict = collections.OrderedDict()
_RECENT_LIMIT = 64
_RECENT_LOCK = threading.Lock()


def _weak(f):
    try:
        return weakref.ref(f)
    except TypeError:
        return f


def _compiles(query, key, value, mask: Mask, score: Score, options: Options):
    """Whether this call runs as `_compiled_per_head` (see above): None if not, else
    what its functions compute (`functions_as_of`; () without functions)."""
    functions = tuple(_weak(f) for f in _user_functions(mask, score))
    if not functions:
        return ()
    if any(isinstance(x, jax.core.Tracer)
           for x in jax.tree.leaves((query, key, value, mask, score, options))):
        return None
    try:
        hash(functions)
    except TypeError:  # a callable object that is unhashable cannot be a static argument
        return None
    with _RECENT_LOCK:
        seen = functions in _RECENT_FUNCTIONS
        _RECENT_FUNCTIONS[functions] = None
        _RECENT_FUNCTIONS.move_to_end(functions)
        if len(_RECENT_FUNCTIONS) > _RECENT_LIMIT:
            _RECENT_FUNCTIONS.popitem(last=False)
    return functions_as_of(query, key, mask, score) if seen else None


def _run_here(jaxpr, consts, args) -> list:
    """The jaxpr's outputs on `args`, its operations bound in the context of the moment
    (`jax.core.eval_jaxpr` binds each in the one it was traced in: a mesh's Explicit
    axes inside the kernel's Auto ones), without the shardings on that mesh that they
    were traced with. Calls of jitted functions run inline; control flow and functions
    of custom derivatives (traced there) are a TypeError."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        params = {name: None if name in ("sharding", "out_sharding") and heads.is_explicit(
            value) else value for name, value in eqn.params.items()}
        if eqn.primitive.name in ("reshard", "mesh_cast") and heads.is_explicit(
                params.get("dst_sharding")):   # to a sharding on the mesh: as it is here
            outs = ins if eqn.primitive.multiple_results else ins[0]
        elif eqn.primitive is jit_p:
            outs = _run_here(params["jaxpr"].jaxpr, params["jaxpr"].consts, ins)
        elif any(True for _ in jax.extend.core.jaxprs_in_params(params)):
            # control flow, and functions of custom derivatives (jax.nn.relu), whose
            # rules were traced on the mesh's Explicit axes
            raise _cannot_run_here(eqn.primitive)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(params))
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update((v, x) for v, x in zip(eqn.outvars, outs)
                   if not isinstance(v, jax.extend.core.DropVar))
    return [read(v) for v in jaxpr.outvars]


def _cannot_run_here(what) -> TypeError:
    return TypeError(
        f"a score_mod, from_fn or alignment closing over arrays on a mesh of Explicit "
        f"axes, in attention split over that mesh, runs there as jax's plain operations, "
        f"without control flow or custom derivatives; got {what} (closing over NumPy "
        f"arrays or arrays made without the mesh, it runs as written)")


def _function_examples(query, key, mask: Mask, score: Score) -> list:
    """`(name, fn, args, kwargs)` for each of the call's functions (score_mod, from_fn,
    alignment): its name, the function, and abstract arguments of its signature, as
    one head's."""
    index, grid = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((1, 1), jnp.int32)
    examples = []
    if score.mod is not None:
        logits = jax.ShapeDtypeStruct((1, 1), _logits_dtype(query.dtype))
        examples.append(("score_mod", score.mod, (logits, index, index, grid, grid), {}))
    examples += [("from_fn", fn, (index, index, grid, grid), {}) for fn in mask.functions()]
    if score.align is not None:  # per head: q [T, Hq], k [S, Hk], params after [B|1, N|1]
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype),
                              score.align_params)
        head = lambda x: jax.ShapeDtypeStruct((x.shape[1], x.shape[-1]), x.dtype)  # noqa: E731
        examples.append(("alignment", score.align, (head(query), head(key)), params))
    return examples


def functions_as_of(query, key, mask: Mask, score: Score):
    """What the call's functions compute now, hashable: each one's jaxpr, traced afresh
    on abstract arguments of its signature (a Python number it reads is a literal
    there), and the values of the arrays it closes over. None where one cannot be
    traced so (the call then runs operation by operation)."""
    try:
        closed = [jax.make_jaxpr(lambda a, k, fn=fn: fn(*a, **k))(args, kwargs)
                  for _, fn, args, kwargs in _function_examples(query, key, mask, score)]
        return tuple((str(c.jaxpr), tuple(_value_of(x) for x in c.consts)) for c in closed)
    except Exception:  # noqa: BLE001 (any failure here is the kernel's to report)
        # e.g. a function that closes over a value traced by the caller's grad or vmap
        # (the call's q, k and v known): it runs operation by operation, traced there
        return None


def _value_of(x) -> tuple:
    """An array a function closes over, by value; a typed PRNG key by its key data."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError("a traced value has no value to compare")
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return ("key", str(jax.random.key_impl(x)), _value_of(jax.random.key_data(x)))
    x = np.asarray(x)
    return x.dtype.str, x.shape, x.tobytes()


def map_heads(fn, query, key, value, meta, *, rows_first: tuple[bool, ...]):
    """`fn(q [T, H], k [S, H], v [S, V], *meta)` for every example and query head.

    query `[B, T, N, H]`, key and value `[B, S, K, ·]` (K divides N); `meta` a tuple of
    pytrees laid out `[B|1, N|1, ...]` (a bound Mask, Score, Options), each head getting
    its own slice. Output i comes back as `[B, L, K, G, ...]` when `rows_first[i]` and
    as `[B, K, G, ...]` otherwise (None stays None).
    """
    b, t, n, h = query.shape
    kv_heads = key.shape[2]
    meta = heads.group(tuple(meta), n, kv_heads)
    mapped = heads.over_heads(
        fn, (b, kv_heads, n // kv_heads), ("rows", "kv", "kv") + ("heads",) * len(meta),
        tuple("rows" if first else "heads" for first in rows_first))
    return mapped(query.reshape(b, t, kv_heads, n // kv_heads, h), key, value, *meta)
