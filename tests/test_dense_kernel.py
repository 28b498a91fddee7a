"""The dense kernel's own derivative and its parts of the batch on a CPU.

Plain scaled-dot attention (with or without a bias) differentiates through a written-out
derivative (`dense._plain`); everything else through autodiff of the same forward pass.
`return_weights=True` takes the autodiff path for the same numbers, so the two can be
compared call for call.
"""

import functools
import importlib
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax import dense
from tests import draws

# the module (attnjax.attention is also the name of the one-head function)
attention_module = importlib.import_module("attnjax.attention")

B, T, S, N, K, H, V = 3, 6, 9, 4, 2, 4, 5


def _inputs(seed, dtype, bias_shape, t=T, s=S):
    generator = draws.host(seed)
    q, k, v = draws.normals(generator, (B, t, N, H), (B, s, K, H), (B, s, K, V), dtype=dtype)
    bias = None if bias_shape is None else draws.normal(generator, bias_shape, dtype)
    # random visibility, one row of example 0 seeing nothing, one key nobody sees
    visible = generator.random((B, 1, t, s)) < 0.7
    visible[0, 0, 1] = visible[1, 0, :, 2] = False
    mask = jax.device_put(visible)
    lse_weights = draws.normal(generator, (B, t, N), dtype)
    return q, k, v, bias, mask, lse_weights


def _loss(autodiff: bool, mask, lse_weights, **kwargs):
    """A scalar of the output and the log-sum-exp; autodiff=True goes through the
    autodiff path (asking for the weights) for the same numbers."""
    def loss(q, k, v, bias):
        result = attnjax.dot_product_attention(
            q, k, v, bias=bias, mask=mask, return_residual=True, return_weights=autodiff,
            implementation="dense", **kwargs)
        out, lse = result[0], result[-1]
        seen = lse > -1e29  # a row that sees nothing has lse MASKED
        acc = jnp.float64 if out.dtype == jnp.float64 else jnp.float32
        return jnp.sum(out.astype(acc) ** 2) + jnp.sum(
            jnp.where(seen, lse * lse_weights.astype(lse.dtype), 0).astype(acc))
    return loss


@pytest.mark.parametrize("bias_shape", [None, (B, N, T, S), (1, 1, 1, S), (B, 1, T, 1)])
def test_written_derivative_equals_autodiff_float64(bias_shape):
    q, k, v, bias, mask, lse_weights = _inputs(0, jnp.float64, bias_shape)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    written, autodiff = (
        jax.jit(jax.value_and_grad(_loss(a, mask, lse_weights), argnums))(q, k, v, bias)
        for a in (False, True))
    chex.assert_trees_all_close(written, autodiff, rtol=1e-12, atol=1e-12)
    # the key no query sees, and the row that sees nothing, get zero gradients
    grads = written[1]
    assert jnp.all(grads[1][1, 2] == 0) and jnp.all(grads[2][1, 2] == 0)
    assert jnp.all(grads[0][0, 1] == 0)
    assert jnp.any(grads[0][0, 0] != 0)


def test_the_derivative_in_one_input_at_a_time_equals_autodiff_eagerly():
    """Differentiated in q, k, v or the bias alone, the written derivative takes no
    product of the others' zero tangents: eagerly, grad in q of a call whose V differs
    from H had given XLA's CPU backend a product of a zero tangent with a transposed
    layout, whose dot emitter aborted the process. Forward mode in one input alike."""
    generator = draws.host(np.random.default_rng().integers(1 << 30))
    q, k, v = draws.normals(generator, (1, 3, 2, 4), (1, 4, 2, 4), (1, 4, 2, 3))
    bias = draws.normal(generator, (1, 2, 3, 4))
    weights = draws.normal(generator, (1, 3, 2, 3))
    inputs = (q, k, v, bias)

    def loss(autodiff):
        def value(q, k, v, bias):
            out = attnjax.dot_product_attention(q, k, v, bias=bias, return_weights=autodiff,
                                                implementation="dense")
            return jnp.sum((out[0] if autodiff else out) * weights)
        return value

    for argnum in range(4):
        written, autodiff = (jax.grad(loss(a), argnum)(*inputs) for a in (False, True))
        np.testing.assert_allclose(written, autodiff, rtol=1e-5, atol=1e-6, err_msg=argnum)
        tangents = [jnp.zeros_like(x) for x in inputs]
        tangents[argnum] = draws.normal(generator, inputs[argnum].shape)
        written, autodiff = (jax.jvp(loss(a), inputs, tuple(tangents))[1] for a in (False, True))
        np.testing.assert_allclose(written, autodiff, rtol=1e-5, atol=1e-6, err_msg=argnum)


@pytest.mark.parametrize("t, s", [(70, 66), (130, 129)])
def test_written_derivative_equals_autodiff_float64_on_larger_grids(t, s):
    """The derivative's product of the weights and dv is written two ways by the size
    of the grid (dense._MIX_EINSUM_GRIDS); the small grid above takes one, these the
    einsum (70 x 66) and the other form again (130 x 129)."""
    assert (dense._MIX_EINSUM_GRIDS[0] < 70 * 66 <= dense._MIX_EINSUM_GRIDS[1] < 130 * 129
            and T * S <= dense._MIX_EINSUM_GRIDS[0])
    q, k, v, bias, mask, lse_weights = _inputs(5, jnp.float64, (B, N, t, s), t, s)
    written, autodiff = (
        jax.jit(jax.value_and_grad(_loss(a, mask, lse_weights), (0, 1, 2, 3)))(q, k, v, bias)
        for a in (False, True))
    chex.assert_trees_all_close(written, autodiff, rtol=1e-12, atol=1e-12)
    chex.assert_tree_all_finite(written)


def _causal_gradient(seed: int, shape):
    """The compiled gradient's HLO text of a causal dense call's loss Σ out · g on fresh
    q, k, v and g of `shape`, the loss, and (q, k, v, g)."""
    q, k, v, g = draws.normals(seed, shape, shape, shape, shape)

    def loss(q, k, v):
        out = attnjax.dot_product_attention(q, k, v, is_causal=True, implementation="dense")
        return jnp.sum(out * g)

    program = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile().as_text()
    return program, loss, (q, k, v, g)


def test_a_small_grids_gradient_takes_no_product_over_a_leading_axis():
    """On a small grid (the copy model's 16 x 16) dv's cotangent Pᵀ dO is taken with
    dO copied transposed: no product in the compiled gradient contracts an axis of its
    left operand other than the last, which XLA's CPU backend runs several times slower
    (one such product took 0.9 ms of a 5.5 ms training step at (128, 16, 64, 4))."""
    program = _causal_gradient(13, (8, 16, 2, 16))[0]
    ranks = {name: len(dims.split(",")) if dims else 0
             for name, dims in re.findall(r"(%[\w.\-]+) = \w+\[([\d,]*)\]", program)}
    products = re.findall(r" dot\((%[\w.\-]+), .*?lhs_contracting_dims=\{(\d+)\}", program)
    assert len(products) >= 5  # q kᵀ, P v and three in the backward pass
    for lhs, contracted in products:
        assert int(contracted) == ranks[lhs] - 1, (lhs, contracted)


def test_forward_mode_and_second_derivatives_equal_autodiff_float64():
    q, k, v, bias, mask, lse_weights = _inputs(1, jnp.float64, (B, N, T, S))
    generator = draws.host(10)
    tangents = tuple(draws.normal(generator, x.shape, jnp.float64) for x in (q, k, v, bias))

    @jax.jit
    def jvp_and_hessian(q, k, v, bias):
        return [(jax.jvp(_loss(a, mask, lse_weights), (q, k, v, bias), tangents),
                 jax.hessian(lambda q, a=a: _loss(a, mask, lse_weights)(q, k, v, bias))(q))
                for a in (False, True)]

    (jvp_written, hessian_written), (jvp_autodiff, hessian_autodiff) = jvp_and_hessian(
        q, k, v, bias)
    chex.assert_trees_all_close(jvp_written, jvp_autodiff, rtol=1e-12, atol=1e-12)
    chex.assert_trees_all_close(hessian_written, hessian_autodiff, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_written_derivative_close_to_float64(dtype):
    q, k, v, bias, mask, lse_weights = _inputs(2, dtype, (1, N, T, S))
    grads = jax.jit(jax.grad(_loss(False, mask, lse_weights), (0, 1, 2, 3)))(q, k, v, bias)
    exact = jax.jit(jax.grad(_loss(True, mask, lse_weights.astype(jnp.float64)), (0, 1, 2, 3)))(
        *(x.astype(jnp.float64) for x in (q, k, v, bias)))
    for got, want in zip(grads, exact):
        assert got.dtype == dtype
        scale = float(jnp.max(jnp.abs(want)))
        tol = 1e-5 if dtype == jnp.float32 else 5e-2
        assert float(jnp.max(jnp.abs(got.astype(jnp.float64) - want))) <= tol * scale


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_half_precision_bias_gradient_of_a_row_that_sees_one_key_is_zero(implementation):
    """Causal, the first query sees key 0 alone: its weight is 1 whatever the bias, so
    the bias gradient there is exactly 0 (jax's own nn_test checks it, in bfloat16).
    The dense kernel had rounded dP = dO vᵀ to bfloat16, which rowsum(dO ∘ O) did not
    cancel: −0.029 at (2, 128, 4, 32). As jax's test takes it, eagerly (under one jit,
    XLA may drop the rounding as excess precision)."""
    q, k, v, bias, d_out = draws.normals(
        4, (2, 128, 4, 32), (2, 128, 4, 32), (2, 128, 4, 32), (1, 4, 128, 128),
        (2, 128, 4, 32), dtype=jnp.bfloat16)
    _, pullback = jax.vjp(lambda bias: attnjax.dot_product_attention(
        q, k, v, bias, is_causal=True, implementation=implementation), bias)
    (d_bias,) = pullback(d_out)
    # float32's residue of summing the same terms in another order, at most
    assert float(jnp.max(jnp.abs(d_bias[:, :, 0, 0].astype(jnp.float32)))) <= 1e-5


@pytest.mark.parametrize("option", ["sinks", "score_mod", "dropout"])
def test_float16_autodiff_gradients_where_do_v_passes_65504(option):
    """The options autodiff differentiates, in float16, with values of ±2000 over V = 256:
    dO·vᵀ ≈ 2.6e5, past float16's range, while every input, output and gradient fits.
    The gradients are float32's, rounded (the weights' cotangent had been a float16
    product: inf, then NaN in d_q and d_k)."""
    generator = draws.host(13)
    q, k = draws.normals(generator, (1, 2, 1, 4), (1, 2, 1, 4))
    sign = np.sign(generator.standard_normal((1, 2, 1, 1)))
    v = jnp.asarray(2000.0 * np.repeat(sign, 256, axis=-1), jnp.float32)
    q, k = (x.astype(jnp.float16).astype(jnp.float32) for x in (q * 0.1, k * 1e-2))
    key = jax.random.key(int(generator.integers(1 << 30)))

    def grads(dtype):
        options = {"sinks": {"sinks": jnp.asarray([0.5], dtype)},
                   "score_mod": {"score_mod": lambda s, b, n, i, j: s * 0.75},
                   "dropout": {"dropout_rate": 0.25, "dropout_rng": key}}[option]

        def loss(q, k, v):
            out = attnjax.dot_product_attention(
                *(x.astype(dtype) for x in (q, k, v)), implementation="dense", **options)
            return jnp.sum(out.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    half, wide = grads(jnp.float16), grads(jnp.float32)
    chex.assert_tree_all_finite(half)
    for g, w in zip(half, wide):
        assert g.dtype == jnp.float32   # the loss's inputs, before the casts
        assert float(jnp.max(jnp.abs(g - w))) <= 2e-3 * float(jnp.max(jnp.abs(w)))


def test_nan_in_hidden_rows_and_columns_reaches_no_gradient():
    q, k, v, _, mask, lse_weights = _inputs(3, jnp.float32, None)
    q_lengths, k_lengths = jnp.array([T, 4, 5]), jnp.array([S, 6, 7])
    poison = lambda x, lengths: jnp.where(  # noqa: E731
        (jnp.arange(x.shape[1])[None, :] >= lengths[:, None])[..., None, None], jnp.nan, x)
    loss = _loss(False, mask, lse_weights, query_lengths=q_lengths, key_lengths=k_lengths)
    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    clean = grad(q, k, v, None)
    dirty = grad(poison(q, q_lengths), poison(k, k_lengths), poison(v, k_lengths), None)
    chex.assert_tree_all_finite(dirty)
    chex.assert_trees_all_close(dirty, clean, rtol=1e-6, atol=1e-6)


def test_a_decoding_step_sums_the_seen_values_in_one_pass():
    """For one query the output is Σ over the seen keys of weight · value, one pass over
    v with the select inside the sum: no product reads v or a masked copy of it. NaN
    and inf in hidden values reach neither the output nor a gradient; the numbers equal
    the path that zeroes v first (return_weights=True), in float32 and bfloat16."""
    q, k, v = draws.normals(11, (B, 1, N, H), (B, S, K, H), (B, S, K, V))
    lengths = jnp.array([S, 3, 6])
    hidden = (jnp.arange(S)[None, :] >= lengths[:, None])[..., None, None]
    poison = jnp.array([jnp.nan, jnp.inf, -jnp.inf], v.dtype)[:, None, None, None]
    poisoned = jnp.where(hidden, poison, v)

    def run(q, k, v, weights=False):
        out = attnjax.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                            implementation="dense", return_weights=weights)
        return out[0] if weights else out

    eqns = list(_equations(jax.make_jaxpr(run)(q, k, v).jaxpr))
    reads_v = lambda eqn: any(V in x.aval.shape for x in eqn.invars)  # noqa: E731
    assert not [eqn for eqn in eqns if eqn.primitive.name == "dot_general" and reads_v(eqn)]
    # the weighted values are summed over S by one reduction
    sums = [eqn for eqn in eqns if eqn.primitive.name in ("reduce", "reduce_sum")
            and reads_v(eqn)]
    assert len(sums) == 1 and S in sums[0].invars[0].aval.shape
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
        q_, k_, v_, dirty = (x.astype(dtype) for x in (q, k, v, poisoned))
        want = jax.jit(functools.partial(run, weights=True))(q_, k_, v_)
        got = jax.jit(run)(q_, k_, dirty)
        chex.assert_tree_all_finite(got)
        chex.assert_trees_all_close(got.astype(jnp.float32), want.astype(jnp.float32),
                                    rtol=tol, atol=tol)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(run(q, k, v) ** 2), (0, 1, 2)))
    clean, dirty = grad(q, k, v), grad(q, k, poisoned)
    chex.assert_tree_all_finite(dirty)
    chex.assert_trees_all_close(dirty, clean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("group", [1, 4])
def test_a_decoding_step_of_a_query_group_reads_v_once_for_the_group(group):
    """One query against more keys than core.ONE_PASS_TERMS, with key lengths: a head
    that reads k and v alone sums its weighted values as v is read (no product reads
    v), while the query heads of a group that share k and v (grouped-query attention)
    take one product, which reads v once for the group rather than once per head. NaN
    and inf in hidden values reach no output either way, and the numbers equal the
    return_weights path's."""
    b, s, kv_heads, h = 3, attnjax.core.ONE_PASS_TERMS + 7, 2, 7
    q, k, v = draws.normals(21, (b, 1, kv_heads * group, h), (b, s, kv_heads, h),
                            (b, s, kv_heads, V))
    lengths = jnp.array([s, 3, 20])
    hidden = (jnp.arange(s)[None, :] >= lengths[:, None])[..., None, None]
    poison = jnp.array([jnp.nan, jnp.inf, -jnp.inf], v.dtype)[:, None, None, None]

    def run(q, k, v, weights=False):
        out = attnjax.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                            implementation="dense", return_weights=weights)
        return out[0] if weights else out

    eqns = list(_equations(jax.make_jaxpr(run)(q, k, v).jaxpr))
    products = [eqn for eqn in eqns if eqn.primitive.name == "dot_general"
                and any(V in x.aval.shape for x in eqn.invars)]
    assert len(products) == (0 if group == 1 else 1)
    got = jax.jit(run)(q, k, jnp.where(hidden, poison, v))
    chex.assert_tree_all_finite(got)
    want = jax.jit(functools.partial(run, weights=True))(q, k, v)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 29, 4, 16), (48, 32, 2, 32)])
def test_a_decoding_step_reads_k_and_v_where_they_lie(shape):
    """One query against a cache in flax's layout `[B, S, K, H]`, on a CPU: each logit is
    summed as k is read and the weighted values as v is read, so XLA's compiled
    temporaries stay under half of k's size (before, the query's products with the keys ran
    on a transposed copy of k, and the weights' products with the values were written out
    whole, each as large as k). The numbers, with a bias, equal the autodiff path's."""
    b, s, kv_heads, h = shape
    generator = draws.host(14)
    q, k, v = draws.normals(generator, (b, 1, 2 * kv_heads, h), (b, s, kv_heads, h),
                            (b, s, kv_heads, h))
    bias = draws.normal(generator, (b, 2 * kv_heads, 1, s))
    lengths = jax.device_put(generator.integers(1, s + 1, b))

    def run(q, k, v, bias, weights=False):
        out = attnjax.dot_product_attention(q, k, v, bias, key_value_seq_lengths=lengths,
                                            implementation="dense", return_weights=weights)
        return out[0] if weights else out

    program = jax.jit(run).lower(q, k, v, bias).compile()
    assert program.memory_analysis().temp_size_in_bytes < k.nbytes / 2
    want = jax.jit(functools.partial(run, weights=True))(q, k, v, bias)
    chex.assert_trees_all_close(program(q, k, v, bias), want, rtol=1e-5, atol=1e-6)


def test_a_masked_gradient_reads_q_and_k_once_each():
    """The logits and their derivatives read the same q and k, each with its hidden rows
    or columns selected away: the compiled gradient of a masked call copies each of q
    and k once (before, the logits read them as they are, a second copy of each)."""
    program, loss, (q, k, v, g) = _causal_gradient(12, (1, 64, 2, 16))
    entry = program[program.index("ENTRY"):]
    for number in (0, 1):  # q, k
        name = re.search(rf"(%[\w.]+) = \S+ parameter\({number}\)", entry).group(1)
        readers = [line for line in entry.splitlines()
                   if re.search(rf"\({name}[,)]|, {name}[,)]", line) and " bitcast(" not in line]
        assert len(readers) == 1, readers
    grads = jax.grad(loss, (0, 1, 2))(q, k, v)
    chex.assert_tree_all_finite(grads)
    want = jax.grad(lambda q, k, v: jnp.sum(attnjax.dot_product_attention(
        q, k, v, is_causal=True, implementation="dense", return_weights=True)[0] * g),
        (0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-5)


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _equations(sub)


def _dots(fn, *args) -> int:
    return _count("dot_general", fn, *args)


def _count(operation: str, fn, *args) -> int:
    """How many times `fn`'s program names the StableHLO `operation`."""
    return jax.jit(fn).lower(*args).as_text().count(f"stablehlo.{operation} ")


def test_in_parts_a_score_mod_and_a_mask_may_close_over_traced_arrays(monkeypatch):
    """The batch's parts are a custom JVP, which cannot close over a traced array: the
    arrays a score_mod or a from_fn mask closes over (a T5 bias table being trained, a
    mask's segment ids, traced by jit) are handed to it as arguments. The gradients,
    the table's included, equal the chunked kernel's (before: UnexpectedTracerError)."""
    b = 5
    generator = draws.host(6)
    q, k, v = draws.normals(generator, (b, T, N, H), (b, S, K, H), (b, S, K, V))
    table = draws.normal(generator, (32, N))    # T5's 32 buckets
    ids = jax.device_put(np.sort(generator.integers(0, 2, (b, S), np.int32), axis=-1))
    monkeypatch.setattr(attention_module, "DENSE_PART_MIN_GRID", T * S)
    monkeypatch.setattr(attention_module, "DENSE_PART_BYTES", b * N * T * S * 4 // 3)

    def loss(implementation):
        def run(q, k, v, table, ids):
            mask = attnjax.masks.causal() & attnjax.masks.from_fn(
                lambda e, n, q_pos, k_pos: ids[e][q_pos] == ids[e][k_pos])
            out = attnjax.dot_product_attention(
                q, k, v, mask=mask, score_mod=attnjax.scores.relative_position_bias(table),
                implementation=implementation)
            return jnp.sum(out ** 2)
        return run

    assert _dots(jax.grad(loss("dense")), q, k, v, table, ids) == 3 * _dots(
        jax.grad(loss("dense")), q[:1], k[:1], v[:1], table, ids[:1])
    grads = [jax.jit(jax.grad(loss(name), (0, 1, 2, 3)))(q, k, v, table, ids)
             for name in ("dense", "chunked")]
    chex.assert_tree_all_finite(grads)
    chex.assert_trees_all_close(*grads, rtol=1e-5, atol=1e-5)


def test_a_batch_of_small_heads_differentiates_in_two_halves_with_the_same_numbers(
        monkeypatch):
    """Heads of fewer than DENSE_PART_MIN_GRID logits run their derivatives in two
    halves of the batch once its logits reach half a part (one half per core), the
    forward pass whole, a decoding step (T = 1) whole; the numbers are the whole batch's."""
    b = 7   # halves of 4 and 3
    generator = draws.host(5)
    q, k, v = draws.normals(generator, (b, T, N, H), (b, S, K, H), (b, S, K, V))
    cotangent = draws.normal(generator, (b, T, N, V))
    lengths = draws.randint(generator, (b,), 1, S + 1)

    def run(q, k, v):
        return attnjax.dot_product_attention(q, k, v, is_causal=True, key_lengths=lengths,
                                             implementation="dense")

    def backward():   # a new function at each count: jax reuses a function's trace
        return jax.grad(lambda *a: jnp.sum(run(*a) * cotangent), (0, 1, 2))

    logits_bytes = b * N * T * S * 4
    assert T * S < attention_module.DENSE_PART_MIN_GRID
    assert logits_bytes < attention_module.DENSE_PART_BYTES // 2   # too little: whole
    whole_backward = _dots(backward(), q, k, v)
    whole = jax.jit(backward())(q, k, v)
    monkeypatch.setattr(attention_module, "DENSE_PART_BYTES", 2 * logits_bytes)
    assert attention_module._dense_parts(b, T, S, N) == 2
    assert attention_module._dense_parts(1, T, S, N) == 1     # one example: nothing to halve
    assert attention_module._dense_parts(b, 1, S, N * T) == 1  # a decoding step
    assert _dots(backward(), q, k, v) == 2 * whole_backward
    assert _dots(lambda *a: run(*a), q, k, v) == 2             # the forward pass, whole
    chex.assert_trees_all_close(jax.jit(backward())(q, k, v), whole, rtol=1e-6, atol=1e-6)


def test_on_a_cpu_the_batch_runs_in_parts_with_the_same_numbers(monkeypatch):
    """Parts of the batch (here 3 of B=5, unequal) give the numbers of one part: every
    per-example array (segment ids, lengths, bias, dropout keys) follows its example."""
    b = 5
    generator = draws.host(4)
    q, k, v, bias = draws.normals(generator, (b, T, N, H), (b, S, K, H), (b, S, K, V),
                                  (b, N, T, S))
    segments = jax.device_put(np.sort(generator.integers(0, 2, (b, S), np.int32), axis=-1))
    mask = attnjax.masks.segments(segments[:, :T], segments)
    k_lengths = draws.randint(generator, (b,), 1, S + 1)
    tangents = draws.normals(generator, q.shape, k.shape, v.shape, bias.shape)
    dropout_key = jax.random.key(4)

    def run(q, k, v, bias, dropout=0.0):
        # (out, lse); dropout takes the autodiff path, no dropout the written derivative
        return attnjax.dot_product_attention(
            q, k, v, bias=bias, mask=mask, key_lengths=k_lengths, implementation="dense",
            return_residual=True, dropout_rate=dropout,
            dropout_rng=dropout_key if dropout > 0 else None)

    def results():  # one program for the call, with and without dropout, gradients,
        # forward mode and second derivatives (a Hessian-vector product)
        grads = jax.grad(lambda *a: jnp.sum(run(*a)[0] ** 2), (0, 1, 2, 3))
        hvp = lambda *a: jax.jvp(lambda q: grads(q, *a[1:]), (a[0],), tangents[:1])[1]  # noqa: E731
        forward = lambda *a: jax.jvp(run, a, tangents)[1]  # noqa: E731
        return jax.jit(lambda *a: (run(*a), run(*a, dropout=0.3), grads(*a), hvp(*a),
                                   forward(*a)))(q, k, v, bias)

    # new functions at each count: jax would reuse a function's trace from before a patch
    forward = lambda: lambda *a: run(*a)[0]  # noqa: E731
    backward = lambda: jax.grad(lambda *a: jnp.sum(run(*a)[0] ** 2), (0, 1, 2, 3))  # noqa: E731
    whole = results()
    # heads this small (T·S = 54 logits) run whole
    assert _dots(forward(), q, k, v, bias) == 2
    whole_backward = _dots(backward(), q, k, v, bias)
    half = [x.astype(jnp.bfloat16) for x in (q, k, v, bias)]
    whole_half_pads = _count("pad", backward(), *half)
    whole_half_grads = jax.jit(backward())(*half)
    monkeypatch.setattr(attention_module, "DENSE_PART_MIN_GRID", T * S)
    logits_bytes = b * N * T * S * 4
    monkeypatch.setattr(attention_module, "DENSE_PART_BYTES", logits_bytes // 3)
    # the derivatives in 3 parts; a forward pass alone, faster whole, stays whole
    assert _dots(backward(), q, k, v, bias) == 3 * whole_backward
    # half-precision gradients of the parts are joined by one concatenation each, not
    # added up from a padded copy of every part (through float32 at each addition)
    assert _count("pad", backward(), *half) == whole_half_pads
    chex.assert_trees_all_close(jax.jit(backward())(*half), whole_half_grads, rtol=2e-2,
                                atol=2e-2)
    assert _dots(forward(), q, k, v, bias) == 2
    chex.assert_trees_all_close(results(), whole, rtol=1e-6, atol=1e-6)
    # only a CPU runs in parts
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert _dots(backward(), q, k, v, bias) == whole_backward
    assert attention_module._dense_parts(b, T, S, N) == 1
