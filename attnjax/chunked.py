"""The chunked implementation: online softmax over key blocks, O(T + S) memory.

One head, like `attnjax.dense`, and vmapped the same way by the batched API. Queries are
taken in blocks of `block_q`; for each, key blocks of `block_k` are folded in with a
running max m, running sum l and a float32 accumulator (FlashAttention). The custom VJP
saves only the output and the log-sum-exp per query and recomputes each block's weights
in the backward pass (FlashAttention-2), so nothing T×S is stored, forward or backward.

Blocks that the structure masks entirely (causal, window, lengths) are never computed:
each query block loops over just the key blocks it can see, and each key block in the
backward pass over just the query blocks that can see it. A full `[T, S]` mask or bias
is accepted but is itself O(T·S) memory.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from attnjax import masks
from attnjax.scores import _logits_dtype

# Chosen on a 2-core CPU with benchmarks/attention.py: large enough that each block's
# matrix products run near the GEMM rate, small enough that a block of logits for all
# heads stays in cache.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static facts of one call: sizes, blocks and the structural visibility rule."""

    t: int
    s: int
    block_q: int
    block_k: int
    is_causal: bool
    window: tuple[int, int] | None
    scale: float
    dropout_rate: float

    @property
    def num_q_blocks(self) -> int:
        return -(-self.t // self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return -(-self.s // self.block_k)

    def key_blocks(self, i, query_length, key_length):
        """[lo, hi): the key blocks query block i can see anything in."""
        offset = self.s - self.t
        first = i * self.block_q + offset  # aligned position of the block's first query
        last = first + self.block_q - 1
        lo, hi = jnp.int32(0), jnp.int32(self.num_k_blocks)
        if self.is_causal:
            hi = jnp.minimum(hi, last // self.block_k + 1)
        if self.window is not None:
            left, right = self.window
            lo = jnp.maximum(lo, (first - left) // self.block_k)
            hi = jnp.minimum(hi, (last + right) // self.block_k + 1)
        if key_length is not None:
            hi = jnp.minimum(hi, -(-key_length // self.block_k))
        if query_length is not None:
            hi = jnp.where(i * self.block_q < query_length, hi, lo)
        return jnp.clip(lo, 0, self.num_k_blocks), jnp.clip(hi, 0, self.num_k_blocks)

    def unmasked_key_blocks(self, i, query_length, key_length):
        """[lo, hi): key blocks every query of block i sees whole (no mask needed)."""
        offset = self.s - self.t
        first = i * self.block_q + offset
        last = first + self.block_q - 1
        lo, hi = jnp.int32(0), jnp.int32(self.s // self.block_k)
        if self.is_causal:
            hi = jnp.minimum(hi, (first + 1) // self.block_k)
        if self.window is not None:
            left, right = self.window
            lo = jnp.maximum(lo, -((left - last) // self.block_k))
            hi = jnp.minimum(hi, (first + right + 1) // self.block_k)
        if key_length is not None:
            hi = jnp.minimum(hi, key_length // self.block_k)
        if query_length is not None:
            hi = jnp.where((i + 1) * self.block_q <= query_length, hi, lo)
        return lo, jnp.maximum(lo, hi)

    def unmasked_query_blocks(self, j, query_length, key_length):
        """[lo, hi): query blocks whose every query sees all of key block j."""
        offset = self.s - self.t
        first = j * self.block_k
        last = first + self.block_k - 1
        lo, hi = jnp.int32(0), jnp.int32(self.num_q_blocks)
        if self.is_causal:
            lo = jnp.maximum(lo, -((offset - last) // self.block_q))
        if self.window is not None:
            left, right = self.window
            lo = jnp.maximum(lo, -((right + offset - last) // self.block_q))
            hi = jnp.minimum(hi, (first + left - offset + 1) // self.block_q)
        if query_length is not None:
            hi = jnp.minimum(hi, query_length // self.block_q)
        limit = self.s if key_length is None else jnp.minimum(key_length, self.s)
        hi = jnp.where(last < limit, hi, lo)
        return lo, jnp.maximum(lo, hi)

    def query_blocks(self, j, query_length, key_length):
        """[lo, hi): the query blocks that can see anything in key block j."""
        offset = self.s - self.t
        first = j * self.block_k  # the block's first key
        last = first + self.block_k - 1
        lo, hi = jnp.int32(0), jnp.int32(self.num_q_blocks)
        if self.is_causal:
            lo = jnp.maximum(lo, (first - offset) // self.block_q)
        if self.window is not None:
            left, right = self.window
            lo = jnp.maximum(lo, (first - right - offset) // self.block_q)
            hi = jnp.minimum(hi, (last + left - offset) // self.block_q + 1)
        if query_length is not None:
            hi = jnp.minimum(hi, -(-query_length // self.block_q))
        if key_length is not None:
            hi = jnp.where(first < key_length, hi, lo)
        return jnp.clip(lo, 0, self.num_q_blocks), jnp.clip(hi, 0, self.num_q_blocks)


def _pad_to(x, size: int, axis: int):
    """Zero-pad axis to `size` (a unit axis of a broadcast mask or bias stays as it is)."""
    if x is None or x.shape[axis] in (1, size):
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _block(x, start, size: int, axis: int):
    """x[start:start+size] along axis; a unit (broadcast) axis is kept whole."""
    if x is None or x.shape[axis] == 1:
        return x
    return lax.dynamic_slice_in_dim(x, start, size, axis)


class _Blocks:
    """Per-block logits, visibility and dropout of one head, shared by both passes."""

    def __init__(self, plan, bias, mask, query_length, key_length, dropout_key):
        self.plan = plan
        self.bias, self.mask = bias, mask
        self.query_length, self.key_length = query_length, key_length
        self.dropout_key = dropout_key

    def logits(self, q_block, k_block, i, j, masked: bool = True):
        """Logits of block (i, j) in float32 `[bq, bk]`, −inf where not visible. With
        masked=False the caller knows every pair of the block is visible."""
        p = self.plan
        # [bq, bk]
        s = jnp.einsum("TH,SH->TS", q_block, k_block,
                       preferred_element_type=_logits_dtype(q_block.dtype))
        q_start, k_start = i * p.block_q, j * p.block_k
        if self.bias is not None:
            bias = _block(_block(self.bias, q_start, p.block_q, 0), k_start, p.block_k, 1)
            s = s + bias.astype(s.dtype)
        if not masked:
            return s
        q_pos = q_start + lax.broadcasted_iota(jnp.int32, (p.block_q, 1), 0)
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, (1, p.block_k), 1)
        visible = masks.visible(
            q_pos, k_pos, num_queries=p.t, num_keys=p.s, is_causal=p.is_causal,
            window=p.window, query_length=self.query_length, key_length=self.key_length,
        )
        if p.s % p.block_k:  # keys of the last block past S are padding
            visible = masks.combine_masks(visible, k_pos < p.s)
        if self.mask is not None:
            visible = masks.combine_masks(
                visible, _block(_block(self.mask, q_start, p.block_q, 0), k_start, p.block_k, 1))
        if visible is not None:
            s = jnp.where(visible, s, -jnp.inf)
        return s

    def unmasked_key_blocks(self, i):
        """Key blocks query block i sees whole; none when a user mask may hide pairs."""
        if self.mask is not None:
            return jnp.int32(0), jnp.int32(0)
        return self.plan.unmasked_key_blocks(i, self.query_length, self.key_length)

    def unmasked_query_blocks(self, j):
        """Query blocks that see key block j whole; none under a user mask."""
        if self.mask is not None:
            return jnp.int32(0), jnp.int32(0)
        return self.plan.unmasked_query_blocks(j, self.query_length, self.key_length)

    def keep_scale(self, i, j):
        """Inverted-dropout multipliers of block (i, j): 0 or 1/(1 − rate), float32."""
        p = self.plan
        key = jax.random.fold_in(self.dropout_key, i * p.num_k_blocks + j)
        keep = jax.random.bernoulli(key, 1.0 - p.dropout_rate, (p.block_q, p.block_k))
        return jnp.where(keep, 1.0 / (1.0 - p.dropout_rate), 0.0).astype(jnp.float32)


def _loop(lo, hi, unmasked, step, init):
    """`step(j, carry, masked)` for j in [lo, hi), unmasked inside the `unmasked` range.

    Blocks that every pair sees whole skip building and applying the mask, which is
    most of them for causal and windowed attention.
    """
    inner_lo = jnp.clip(unmasked[0], lo, hi)
    inner_hi = jnp.clip(unmasked[1], inner_lo, hi)
    carry = lax.fori_loop(lo, inner_lo, functools.partial(step, masked=True), init)
    carry = lax.fori_loop(inner_lo, inner_hi, functools.partial(step, masked=False), carry)
    return lax.fori_loop(inner_hi, hi, functools.partial(step, masked=True), carry)


def _forward(plan, q, k, v, blocks):
    """Padded output `[Tq, V]` and log-sum-exp `[Tq]` (−inf for rows that see no key)."""
    acc_dtype = _logits_dtype(v.dtype)

    def query_block(i):
        q_i = lax.dynamic_slice_in_dim(q, i * plan.block_q, plan.block_q)
        lo, hi = plan.key_blocks(i, blocks.query_length, blocks.key_length)

        def step(j, carry, masked):
            row_max, row_sum, acc = carry
            k_j = lax.dynamic_slice_in_dim(k, j * plan.block_k, plan.block_k)
            v_j = lax.dynamic_slice_in_dim(v, j * plan.block_k, plan.block_k)
            # [bq, bk]
            s = blocks.logits(q_i, k_j, i, j, masked)
            new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))
            # Rows with nothing visible yet keep max −inf: shift by 0 so exp gives 0.
            shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            # [bq, bk]
            p = jnp.exp(s - shift[:, None])
            correction = jnp.exp(row_max - shift)
            row_sum = row_sum * correction + jnp.sum(p, axis=-1)
            if plan.dropout_rate > 0.0:
                p = p * blocks.keep_scale(i, j)
            # [bq, V]
            pv = jnp.einsum("TS,SV->TV", p.astype(v.dtype), v_j, preferred_element_type=acc_dtype)
            return new_max, row_sum, acc * correction[:, None] + pv

        init = (
            jnp.full((plan.block_q,), -jnp.inf, acc_dtype),
            jnp.zeros((plan.block_q,), acc_dtype),
            jnp.zeros((plan.block_q, v.shape[-1]), acc_dtype),
        )
        row_max, row_sum, acc = _loop(lo, hi, blocks.unmasked_key_blocks(i), step, init)
        seen = row_sum > 0
        out = acc / jnp.where(seen, row_sum, 1.0)[:, None]
        lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)
        return out.astype(v.dtype), lse

    # [nq, bq, V], [nq, bq]
    out, lse = lax.map(query_block, jnp.arange(plan.num_q_blocks, dtype=jnp.int32))
    return out.reshape(-1, v.shape[-1]), lse.reshape(-1)


def _backward(plan, q, k, v, blocks, out, lse, d_out):
    """Gradients for the (pre-scaled) q, k, v and the bias, recomputing block weights."""
    acc_dtype = _logits_dtype(v.dtype)
    # [Tq]: rowsum(dO ∘ O) = rowsum(dP ∘ P), also under dropout.
    delta = jnp.sum(d_out.astype(acc_dtype) * out.astype(acc_dtype), axis=-1)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    bias = blocks.bias

    def key_block(carry, j):
        k_j = lax.dynamic_slice_in_dim(k, j * plan.block_k, plan.block_k)
        v_j = lax.dynamic_slice_in_dim(v, j * plan.block_k, plan.block_k)
        lo, hi = plan.query_blocks(j, blocks.query_length, blocks.key_length)

        def step(i, inner, masked):
            d_q, d_bias, d_k, d_v = inner
            rows = i * plan.block_q
            q_i = lax.dynamic_slice_in_dim(q, rows, plan.block_q)
            do_i = lax.dynamic_slice_in_dim(d_out, rows, plan.block_q)
            # [bq, bk]: the forward weights, exactly, from the saved log-sum-exp.
            p = jnp.exp(blocks.logits(q_i, k_j, i, j, masked)
                        - lax.dynamic_slice_in_dim(lse, rows, plan.block_q)[:, None])
            dp = jnp.einsum("TV,SV->TS", do_i, v_j, preferred_element_type=acc_dtype)
            p_used = p
            if plan.dropout_rate > 0.0:
                keep = blocks.keep_scale(i, j)
                p_used, dp = p * keep, dp * keep
            d_v = d_v + jnp.einsum("TS,TV->SV", p_used.astype(v.dtype), do_i,
                                   preferred_element_type=acc_dtype)
            # [bq, bk]
            ds = p * (dp - lax.dynamic_slice_in_dim(delta, rows, plan.block_q)[:, None])
            ds_in = ds.astype(q.dtype)
            d_k = d_k + jnp.einsum("TS,TH->SH", ds_in, q_i, preferred_element_type=acc_dtype)
            d_q_i = lax.dynamic_slice_in_dim(d_q, rows, plan.block_q) + jnp.einsum(
                "TS,SH->TH", ds_in, k_j, preferred_element_type=acc_dtype)
            d_q = lax.dynamic_update_slice_in_dim(d_q, d_q_i, rows, 0)
            if d_bias is not None:
                d_bias = _add_block(d_bias, ds, rows, j * plan.block_k)
            return d_q, d_bias, d_k, d_v

        d_q, d_bias = carry
        init = (d_q, d_bias, jnp.zeros(k_j.shape, acc_dtype), jnp.zeros(v_j.shape, acc_dtype))
        d_q, d_bias, d_k, d_v = _loop(lo, hi, blocks.unmasked_query_blocks(j), step, init)
        return (d_q, d_bias), (d_k, d_v)

    init = (jnp.zeros(q.shape, acc_dtype),
            None if bias is None else jnp.zeros(bias.shape, acc_dtype))
    (d_q, d_bias), (d_k, d_v) = lax.scan(
        key_block, init, jnp.arange(plan.num_k_blocks, dtype=jnp.int32))
    return d_q, d_k.reshape(k.shape), d_v.reshape(v.shape), d_bias


def _add_block(total, block, row, col):
    """total[row:, col:] += block, summing the block over total's unit (broadcast) axes."""
    if total.shape[0] == 1:
        block, row = jnp.sum(block, axis=0, keepdims=True), jnp.int32(0)
    if total.shape[1] == 1:
        block, col = jnp.sum(block, axis=1, keepdims=True), jnp.int32(0)
    current = lax.dynamic_slice(total, (row, col), block.shape)
    return lax.dynamic_update_slice(total, current + block, (row, col))


@functools.lru_cache(maxsize=None)
def _attention_fn(plan: _Plan):
    """The custom-VJP attention for one plan, on block-padded arrays."""

    @jax.custom_vjp
    def attend(q, k, v, bias, mask, query_length, key_length, dropout_key):
        blocks = _Blocks(plan, bias, mask, query_length, key_length, dropout_key)
        return _forward(plan, q, k, v, blocks)[0]

    def forward(q, k, v, bias, mask, query_length, key_length, dropout_key):
        blocks = _Blocks(plan, bias, mask, query_length, key_length, dropout_key)
        out, lse = _forward(plan, q, k, v, blocks)
        return out, (q, k, v, bias, mask, query_length, key_length, dropout_key, out, lse)

    def backward(residuals, d_out):
        q, k, v, bias, mask, query_length, key_length, dropout_key, out, lse = residuals
        blocks = _Blocks(plan, bias, mask, query_length, key_length, dropout_key)
        # q entered pre-scaled: autodiff of that multiply applies the scale to d_q.
        d_q, d_k, d_v, d_bias = _backward(plan, q, k, v, blocks, out, lse, d_out)
        return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype),
                None if bias is None else d_bias.astype(bias.dtype),
                None, None, None, None)

    attend.defvjp(forward, backward)
    return attend


def _scaled_and_padded(plan: _Plan, q, k, v):
    """q scaled (once, rather than every [bq, bk] block of logits), and q, k, v
    zero-padded to whole blocks."""
    tq, sk = plan.num_q_blocks * plan.block_q, plan.num_k_blocks * plan.block_k
    q = _pad_to(q * jnp.asarray(plan.scale, q.dtype), tq, 0)
    return q, _pad_to(k, sk, 0), _pad_to(v, sk, 0)


def block_sizes(t: int, s: int, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """Blocks no larger than the (rounded-up) sequences, for short inputs."""
    def fit(requested, default, length):
        size = default if requested is None else requested
        return min(size, max(8, -(-length // 8) * 8))
    return fit(block_q, DEFAULT_BLOCK_Q, t), fit(block_k, DEFAULT_BLOCK_K, s)


def chunked_attention(
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
    scale: float,
    dropout_rate: float,
    dropout_key: Array | None,
    return_weights: bool,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Float[Array, "T V"], None]:
    """Attention of one head in blocks; the same numbers as `dense_attention`."""
    del return_weights  # refused by the batched API: chunked never forms the weights
    t, s = q.shape[0], k.shape[0]
    block_q, block_k = block_sizes(t, s, block_q, block_k)
    plan = _Plan(t, s, block_q, block_k, is_causal, window, scale, dropout_rate)
    tq, sk = plan.num_q_blocks * block_q, plan.num_k_blocks * block_k
    q, k, v = _scaled_and_padded(plan, q, k, v)
    bias = _pad_to(_pad_to(bias, tq, 0), sk, 1)
    mask = _pad_to(_pad_to(mask, tq, 0), sk, 1)
    if query_length is not None:
        query_length = query_length.astype(jnp.int32)
    if key_length is not None:
        key_length = key_length.astype(jnp.int32)
    out = _attention_fn(plan)(q, k, v, bias, mask, query_length, key_length, dropout_key)
    return out[:t], None


def _plain_plan(q, k, is_causal: bool, scale: float):
    """Plan and blocks of unmasked (or plainly causal) attention, for the ring's blocks."""
    t, s = q.shape[0], k.shape[0]
    block_q, block_k = block_sizes(t, s, None, None)
    plan = _Plan(t, s, block_q, block_k, is_causal, None, scale, 0.0)
    return plan, _Blocks(plan, None, None, None, None, None)


def forward_with_lse(q: Float[Array, "T H"], k: Float[Array, "S H"], v: Float[Array, "S V"], *,
                     is_causal: bool, scale: float) -> tuple[Float[Array, "T V"], Float[Array, "T"]]:
    """Output and float32 log-sum-exp `[T]` (−inf where no key is visible) of one head
    with no mask, bias, lengths or dropout. Not differentiable: its pair
    `backward_with_lse` is, given the output and log-sum-exp of the whole row."""
    plan, blocks = _plain_plan(q, k, is_causal, scale)
    out, lse = _forward(plan, *_scaled_and_padded(plan, q, k, v), blocks)
    return out[: plan.t], lse[: plan.t]


def backward_with_lse(q, k, v, out, lse, d_out, *, is_causal: bool, scale: float):
    """float32 `(d_q, d_k, d_v)` of this block's share of a row's attention.

    out, lse and d_out are of the whole row (every key block together): the block's
    weights are exp(logits − lse), so the blocks' gradients add up to the row's.
    """
    plan, blocks = _plain_plan(q, k, is_causal, scale)
    pad_q = functools.partial(_pad_to, size=plan.num_q_blocks * plan.block_q, axis=0)
    d_q, d_k, d_v, _ = _backward(plan, *_scaled_and_padded(plan, q, k, v), blocks, pad_q(out),
                                 pad_q(lse), pad_q(d_out))
    # q entered pre-scaled: the chain rule applies the scale to d_q
    return d_q[: plan.t] * scale, d_k[: plan.s], d_v[: plan.s]
