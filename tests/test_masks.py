"""The attention engine against an independent plain-jnp reference (masks_reference.py):
random compositions of the Mask rules with score mods and sinks, forward, log-sum-exp and
gradients of both kernels; the block classifier's soundness; the & / | algebra; argument
errors; rows that see nothing; jit, vmap and grad."""

import decimal
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import attnjax
from attnjax import masks, scores
from attnjax.core import MASKED
from tests import draws
from tests import masks_reference as ref

# Query and key lengths; 1000 is drawn rarely, and only with one example.
SIZES = (1, 2, 7, 129, 1000)
# (B, N, K): grouped-query attention in two of three.
HEADS = ((2, 3, 1), (1, 4, 2), (2, 4, 4))
HEADS_LONG = ((1, 3, 1),)
H, V = 5, 6
# Chunked blocks (block_q, block_k): none divides 7 or 129, only 8 divides 1000; None
# takes the kernel's defaults (512, capped at the lengths rounded up to 8).
BLOCKS = ((16, 24), (24, 56), (56, 16), (8, 48), None)
# relative_position_bias's buckets: no distance lands on a bucket boundary, where
# float32 and float64 logarithms could round to different buckets.
BUCKETS, MAX_DISTANCE = 10, 20
_SETTINGS = dict(deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------------------
# User functions: a from_fn predicate and a score_mod closing over an array. They are
# elementwise, so the engine calls them on blocks and the reference on the whole grid.


def _stripes(b, n, q_pos, k_pos):
    return (q_pos * 3 + k_pos * 5 + b + 2 * n) % 4 != 0


def _near_or_even(b, n, q_pos, k_pos):
    return (jnp.abs(q_pos - k_pos) <= 2) | ((k_pos + n) % 2 == 0)


PREDICATES = {"stripes": _stripes, "near_or_even": _near_or_even}


def _custom_mod(u, score, b, n, q_pos, k_pos):
    """score + u[(q_pos − k_pos + 2b) mod P, n]: reads every coordinate, closes over u."""
    return score + u[(q_pos - k_pos + 2 * b) % u.shape[0], n].astype(score.dtype)


# --------------------------------------------------------------------------------------
# Random cases. A case is a readable structure (shapes, a rule tree, a score mod, ...)
# and a seed for its arrays. The structure is drawn with NumPy from a seed hypothesis
# draws: with a few dozen examples, every example is then a fresh composition (hypothesis'
# own exploration starts from the simplest cases and mutates them), and a failure is
# printed as the structure itself.

LEAVES = ("causal", "window", "chunked_causal", "prefix", "lengths", "segments", "array",
          "fn", "everything")
BASIC_MODS = (("soft_cap", 2.0), ("alibi",), ("t5", True), ("t5", False), ("custom",))


def _pick(rs, options, weights=None):
    p = None if weights is None else np.asarray(weights, float) / np.sum(weights)
    return options[rs.choice(len(options), p=p)]


def _random_leaf(rs):
    kind = _pick(rs, LEAVES, [3] * 8 + [1])
    if kind == "window":
        return ("window", _pick(rs, (0, 1, 3, 40)), _pick(rs, (0, 2, 9)))
    if kind == "chunked_causal":
        return ("chunked_causal", _pick(rs, (1, 3, 8, 50)))
    if kind == "prefix":
        return ("prefix", bool(rs.rand() < 0.5))  # per example, or one int
    if kind == "lengths":
        return ("lengths", _pick(rs, ("query", "key", "both")))
    if kind == "segments":
        return ("segments", _pick(rs, ("monotone", "arbitrary")), bool(rs.rand() < 0.5))
    if kind == "array":
        return ("array", _pick(rs, ("BNTS", "B1TS", "1NTS", "TS", "111S", "T1")))
    if kind == "fn":
        return ("fn", _pick(rs, sorted(PREDICATES)))
    return (kind,)


def _random_tree(rs, depth):
    """A rule tree of this depth, its parts combined with & and |."""
    if depth == 1:
        return _random_leaf(rs)
    sides = [depth - 1, rs.randint(1, depth)]
    rs.shuffle(sides)
    return (_pick(rs, ("and", "or")), _random_tree(rs, sides[0]), _random_tree(rs, sides[1]))


def _random_mod(rs):
    kind = _pick(rs, ("none", "basic", "chain"), [4, 9, 7])
    if kind == "none":
        return None
    if kind == "basic":
        return _pick(rs, BASIC_MODS)
    return ("chain", _pick(rs, BASIC_MODS), _pick(rs, BASIC_MODS))


def _random_case(seed, sizes=SIZES, blocks=BLOCKS):
    rs = np.random.RandomState(seed)
    # 1000 drawn rarely: one example, three heads
    weights = [1.0 if size < 1000 else 0.35 for size in sizes]
    t, s = _pick(rs, sizes, weights), _pick(rs, sizes, weights)
    b, n, k = _pick(rs, HEADS_LONG if max(t, s) >= 1000 else HEADS)
    return dict(
        shape=(b, t, s, n, k),
        tree=_random_tree(rs, _pick(rs, (1, 2, 3), [5, 8, 7])),
        positions=_pick(rs, ("default", "offset", "shared", "arbitrary")),
        mod=_random_mod(rs),
        sinks=bool(rs.rand() < 0.5),
        blocks=_pick(rs, blocks),
        seed=int(rs.randint(2**31)),
    )


def cases(**options):
    return st.integers(0, 2**32 - 1).map(functools.partial(_random_case, **options))


# --------------------------------------------------------------------------------------
# From a structure to the engine's Mask and the reference's tree, with the same arrays.


def _ids(rs, monotone: bool, b: int, length: int):
    if monotone:
        return np.sort(rs.randint(0, 4, (b, length)), axis=1).astype(np.int32)
    return rs.randint(0, 3, (b, length)).astype(np.int32)


def _build(node, dims, rs):
    """(engine Mask, reference tree) for the structure `node`; dims = (B, N, T, S)."""
    b, n, t, s = dims
    kind = node[0]
    if kind in ("and", "or"):
        (left, left_ref), (right, right_ref) = _build(node[1], dims, rs), _build(node[2], dims, rs)
        return (left & right if kind == "and" else left | right), (kind, left_ref, right_ref)
    if kind == "everything":
        return masks.everything(), ("everything",)
    if kind == "causal":
        return masks.causal(), ("causal",)
    if kind == "window":
        return masks.window(node[1], node[2]), node
    if kind == "chunked_causal":
        return masks.chunked_causal(node[1]), node
    if kind == "prefix":
        if node[1]:
            length = rs.randint(0, s + 2, b).astype(np.int32)
            return masks.prefix(jnp.asarray(length)), ("prefix", length)
        length = int(rs.randint(0, s + 2))
        return masks.prefix(length), ("prefix", length)
    if kind == "lengths":
        query = rs.randint(0, t + 1, b).astype(np.int32) if node[1] != "key" else None
        key = rs.randint(0, s + 1, b).astype(np.int32) if node[1] != "query" else None
        as_jnp = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
        return masks.lengths(as_jnp(query), as_jnp(key)), ("lengths", query, key)
    if kind == "segments":
        monotone, shared = node[1] == "monotone", node[2]
        query = _ids(rs, monotone, b, t)
        if shared and t == s:
            return masks.segments(jnp.asarray(query)), ("segments", query, query)
        key = _ids(rs, monotone, b, s)
        return masks.segments(jnp.asarray(query), jnp.asarray(key)), ("segments", query, key)
    if kind == "array":
        sizes = {"B": b, "N": n, "T": t, "S": s, "1": 1}
        shape = tuple(sizes[c] for c in node[1])
        array = rs.rand(*shape) < rs.choice((0.3, 0.8))
        return masks.from_array(jnp.asarray(array)), ("array", array)
    if kind == "fn":
        return masks.from_fn(PREDICATES[node[1]]), ("fn", PREDICATES[node[1]])
    raise AssertionError(node)


def _positions(mode, b, t, s, rs):
    """(positions= for the engine, [B, T] and [B, S] positions for the reference)."""
    if mode == "default":
        return None, ref.default_positions(b, t, s)
    if mode == "shared":
        q_pos = np.arange(t, dtype=np.int32) + rs.randint(0, s + 1)
        k_pos = np.arange(s, dtype=np.int32) + rs.randint(0, 3)
        given = (jnp.asarray(q_pos), jnp.asarray(k_pos))
        return given, (np.broadcast_to(q_pos, (b, t)), np.broadcast_to(k_pos, (b, s)))
    if mode == "offset":
        q_pos = np.arange(t, dtype=np.int32) + rs.randint(0, s + 1, (b, 1)).astype(np.int32)
        k_pos = np.arange(s, dtype=np.int32) + rs.randint(0, 3, (b, 1)).astype(np.int32)
    else:
        q_pos = rs.randint(0, t + s, (b, t)).astype(np.int32)
        k_pos = rs.randint(0, t + s, (b, s)).astype(np.int32)
    return (jnp.asarray(q_pos), jnp.asarray(k_pos)), (q_pos, k_pos)


def _mod_arrays(spec):
    """Names of the arrays the score mod `spec` closes over."""
    if spec is None:
        return set()
    if spec[0] == "chain":
        return _mod_arrays(spec[1]) | _mod_arrays(spec[2])
    return {"alibi": {"slopes"}, "t5": {"table"}, "custom": {"u"}}.get(spec[0], set())


def _draw_params(names, n, rs):
    draws = {"slopes": lambda: rs.uniform(0.05, 0.6, n), "table": lambda: rs.randn(BUCKETS, n),
             "u": lambda: rs.randn(5, n)}
    return {name: jnp.asarray(draws[name](), jnp.float64) for name in sorted(names)}


def _engine_mod(spec, params):
    if spec is None:
        return None
    kind = spec[0]
    if kind == "soft_cap":
        return scores.soft_cap(spec[1])
    if kind == "alibi":
        return scores.alibi(params["slopes"])
    if kind == "t5":
        return scores.relative_position_bias(params["table"], num_buckets=BUCKETS,
                                             max_distance=MAX_DISTANCE, bidirectional=spec[1])
    if kind == "custom":
        return functools.partial(_custom_mod, params["u"])
    return scores.chain(_engine_mod(spec[1], params), _engine_mod(spec[2], params))


def _reference_mod(spec, params):
    if spec is None:
        return None
    kind = spec[0]
    if kind == "soft_cap":
        return spec
    if kind == "alibi":
        return ("alibi", params["slopes"])
    if kind == "t5":
        return ("t5", params["table"], BUCKETS, MAX_DISTANCE, spec[1])
    if kind == "custom":
        return ("custom", functools.partial(_custom_mod, params["u"]))
    return ("chain", _reference_mod(spec[1], params), _reference_mod(spec[2], params))


def _reference_grid(tree, b, n, t, s, q_pos, k_pos):
    """ref.visible, compiled: one program instead of dozens of small ones."""
    return np.asarray(_compiled(lambda: ref.visible(tree, b, n, t, s, q_pos, k_pos)))


def _normal(rs, shape, dtype=jnp.float64):
    return jnp.asarray(rs.standard_normal(shape), jnp.float64).astype(dtype)


# --------------------------------------------------------------------------------------
# Comparisons.


def _assert_close(name, actual, expected, tol):
    """max |a − e| ≤ tol · max(1, max |e|), and a finite everywhere."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert np.isfinite(actual).all(), f"{name}: not finite"
    scale = max(np.max(np.abs(expected), initial=0.0), 1.0)
    error = np.max(np.abs(actual - expected), initial=0.0) / scale
    assert error <= tol, f"{name}: relative error {error:.3g} > {tol:.3g}"


def _assert_lse_close(name, actual, expected, tol):
    """Rows that see nothing (and no sink) at exactly MASKED in both; the rest close."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_array_equal(actual == MASKED, expected == MASKED, err_msg=name)
    seen = expected != MASKED
    _assert_close(name, np.where(seen, actual, 0.0), np.where(seen, expected, 0.0), tol)


# --------------------------------------------------------------------------------------
# The comparison every case runs: both kernels and the reference, values and gradients.


def _problem(case):
    """Everything one case needs, drawn from its seed."""
    b, t, s, n, k = case["shape"]
    rs = np.random.RandomState(case["seed"])
    mask, tree = _build(case["tree"], (b, n, t, s), rs)
    positions, (q_pos, k_pos) = _positions(case["positions"], b, t, s, rs)
    inputs = dict(q=_normal(rs, (b, t, n, H)), k=_normal(rs, (b, s, k, H)),
                  v=_normal(rs, (b, s, k, V)),
                  sinks=_normal(rs, (n,)) if case["sinks"] else None,
                  params=_draw_params(_mod_arrays(case["mod"]), n, rs))
    cotangents = (_normal(rs, (b, t, n, V)), _normal(rs, (b, t, n)))
    return mask, positions, (q_pos, k_pos), tree, inputs, cotangents


def _compiled(fn, *args):
    """fn(*args) as one compiled program (fn a fresh closure: compiled once, here)."""
    return jax.jit(fn)(*args)


def _values_and_grads(run, inputs, cotangents):
    """(out, lse) and the gradients of Σ out·d_out + Σ lse·d_lse w.r.t. q, k, v, sinks
    and the score_mod's arrays."""
    d_out, d_lse = cotangents

    def loss(x):
        out, lse = run(x["q"], x["k"], x["v"], x["sinks"], x["params"])
        return jnp.sum(out * d_out) + jnp.sum(lse * d_lse), (out, lse)

    grads, values = jax.grad(loss, has_aux=True)(inputs)
    return values, grads


def _compare(case, tol=1e-9):
    """Dense and chunked (float64) equal the reference: output, log-sum-exp and every
    gradient."""
    mask, positions, (q_pos, k_pos), tree, inputs, cotangents = _problem(case)
    b, t, s, n, _ = case["shape"]
    spec = case["mod"]

    def engine(implementation, mask, positions):
        def run(q, k, v, sinks, params):
            return attnjax.dot_product_attention(
                q, k, v, mask=mask, positions=positions, score_mod=_engine_mod(spec, params),
                sinks=sinks, return_residual=True, implementation=implementation,
                block_sizes=case["blocks"] if implementation == "chunked" else None)
        return run

    def reference(see):
        def run(q, k, v, sinks, params):
            return ref.attention(q, k, v, see, score_mod=_reference_mod(spec, params),
                                 sinks=sinks, q_pos=q_pos, k_pos=k_pos, empty=MASKED)
        return run

    def engines(inputs, mask, positions):
        return [_values_and_grads(engine(name, mask, positions), inputs, cotangents)
                for name in ("dense", "chunked")]

    def everything(inputs, mask, positions):
        see = ref.visible(tree, b, n, t, s, q_pos, k_pos)
        return see, _values_and_grads(reference(see), inputs, cotangents), engines(
            inputs, mask, positions)

    # the reference grid, the reference and both kernels: one program
    see, (expected, expected_grads), kernels = _compiled(everything, inputs, mask, positions)
    for name, (values, grads) in zip(("dense", "chunked"), kernels):
        _assert_close(f"{name} output", values[0], expected[0], tol)
        _assert_lse_close(f"{name} log-sum-exp", values[1], expected[1], tol)
        for path, got in jax.tree_util.tree_leaves_with_path(grads):
            want = functools.reduce(lambda tree, key: tree[key.key], path, expected_grads)
            _assert_close(f"{name} gradient {jax.tree_util.keystr(path)}", got, want, tol)
        # Rows that see nothing are exact zeros.
        dead = ~np.asarray(see).any(axis=-1).transpose(0, 2, 1)  # [B, T, N]
        assert not np.asarray(values[0])[dead].any(), name


@settings(max_examples=16, **_SETTINGS)
@given(cases())
def test_dense_and_chunked_equal_the_reference_on_random_compositions(case):
    note(f"case: {case}")
    _compare(case)


@pytest.mark.parametrize("t, s, tree", [
    (1, 23, ("or", ("causal",), ("window", 1, 0))),
    (19, 1, ("and", ("prefix", True), ("segments", "arbitrary", False))),
    (1, 1, ("or", ("chunked_causal", 3), ("lengths", "key"))),
])
def test_a_single_query_or_key_on_chunked_equals_dense_and_the_reference(t, s, tree):
    """A decoding step (T = 1) and a single key (S = 1), with positions offset, a score
    mod and sinks."""
    case = dict(shape=(2, t, s, 4, 2), tree=tree, positions="offset",
                mod=("chain", ("alibi",), ("soft_cap", 2.0)), sinks=True, blocks=None, seed=t + s)
    _compare(case)


def test_the_reference_rules_by_hand():
    """The reference itself, on grids small enough to write out: T = 3 queries at
    positions 2, 3, 4 (bottom-right over S = 5 keys)."""
    def grid(tree, **kw):
        return np.asarray(ref.visible(tree, 1, 1, 3, 5, **kw))[0, 0].astype(int).tolist()

    assert grid(("causal",)) == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert grid(("window", 1, 0)) == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert grid(("chunked_causal", 2)) == [[0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    assert grid(("or", ("window", 0, 0), ("prefix", 2))) == [
        [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 1]]
    assert grid(("lengths", np.array([2]), np.array([4]))) == [
        [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]
    segments = ("segments", np.array([[0, 1, 1]]), np.array([[0, 0, 1, 2, 1]]))
    assert grid(segments) == [[1, 1, 0, 0, 0], [0, 0, 1, 0, 1], [0, 0, 1, 0, 1]]
    positions = (np.array([[10, 11, 12]]), np.array([[8, 9, 10, 11, 12]]))
    assert grid(("chunked_causal", 4), q_pos=positions[0], k_pos=positions[1]) == [
        [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]]
    # T5 buckets, bidirectional over 10 buckets: 0 to 4 for keys at or before the query,
    # 5 to 9 after; distances 0, 1 exact, then logarithmic up to 20, then the last.
    distances = np.array([0, 1, 2, 5, 19, 20, 500])
    np.testing.assert_array_equal(ref.t5_bucket(-distances, 10, 20, True), [0, 1, 2, 3, 4, 4, 4])
    np.testing.assert_array_equal(ref.t5_bucket(distances, 10, 20, True), [0, 6, 7, 8, 9, 9, 9])
    np.testing.assert_array_equal(ref.t5_bucket(-distances, 10, 20, False), [0, 1, 2, 5, 9, 9, 9])
    np.testing.assert_array_equal(ref.t5_bucket(distances, 10, 20, False), [0] * 7)


def test_float32_dense_equals_chunked():
    b, t, s, n, k = 2, 129, 129, 4, 2
    rs = np.random.RandomState(7)
    ids = np.sort(rs.randint(0, 3, (b, t)), axis=1).astype(np.int32)
    mask = (masks.causal() & masks.segments(jnp.asarray(ids))) | masks.prefix(5)
    slopes = jnp.asarray(rs.uniform(0.05, 0.5, n), jnp.float32)
    x = [_normal(rs, shape, jnp.float32) for shape in ((b, t, n, H), (b, s, k, H), (b, s, k, V),
                                                       (n,), (b, t, n, V))]

    def run(implementation):
        def loss(q, k, v, sinks, slopes):
            out = attnjax.dot_product_attention(
                q, k, v, mask=mask, score_mod=scores.chain(scores.alibi(slopes),
                                                           scores.soft_cap(4.0)),
                sinks=sinks, implementation=implementation,
                block_sizes=(24, 40) if implementation == "chunked" else None)
            return jnp.sum(out * x[4]), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*x[:4], slopes)

    (grads, out), (dense_grads, dense_out) = run("chunked"), run("dense")
    chex.assert_type([out, *grads], jnp.float32)
    _assert_close("output", out, dense_out, 2e-5)
    for name, got, want in zip(("q", "k", "v", "sinks", "slopes"), grads, dense_grads):
        _assert_close(name, got, want, 2e-5)


# --------------------------------------------------------------------------------------
# Rows that see nothing, in low precision, with NaN and inf in the padding.


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_rows_that_see_nothing_give_zeros_and_zero_finite_gradients(implementation, dtype,
                                                                    with_sinks):
    """Padded queries, a row every key is hidden from, an example with no keys at all:
    zeros out, zero gradients in, nothing NaN; NaN and inf in padded keys and values
    reach no output and no gradient."""
    b, t, s, n, k = 2, 7, 13, 3, 1
    rs = np.random.RandomState(11)
    q_len, k_len = np.array([4, 7], np.int32), np.array([9, 0], np.int32)
    hidden_row = np.ones((t, s), bool)
    hidden_row[2] = False
    mask = (masks.lengths(jnp.asarray(q_len), jnp.asarray(k_len)) & masks.causal()
            & masks.from_array(jnp.asarray(hidden_row)))
    tree = ("and", ("and", ("lengths", q_len, k_len), ("causal",)), ("array", hidden_row))
    see = _reference_grid(tree, b, n, t, s, None, None)
    dead = ~see.any(axis=-1).transpose(0, 2, 1)  # [B, T, N]
    assert dead.any() and not dead.all()
    padding = np.arange(s)[None, :, None, None] >= k_len[:, None, None, None]  # [B, S, 1, 1]
    q, key, value, d_out = (_normal(rs, shape) for shape in (
        (b, t, n, H), (b, s, k, H), (b, s, k, V), (b, t, n, V)))
    sinks = _normal(rs, (n,)) if with_sinks else None
    poison = jnp.where(jnp.asarray(rs.rand(b, s, k, 1) < 0.5), jnp.nan, jnp.inf)
    poisoned = [jnp.where(padding, poison, x).astype(dtype) for x in (key, value)]

    def loss(q, k, v, sinks):
        out = attnjax.dot_product_attention(q, k, v, mask=mask, sinks=sinks,
                                            implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q.astype(dtype), *poisoned, None if sinks is None else sinks.astype(dtype))
    chex.assert_type(out, dtype)
    chex.assert_tree_all_finite((out, grads))
    out, (d_q, d_k, d_v, _) = np.asarray(out, np.float64), [
        None if g is None else np.asarray(g, np.float64) for g in grads]
    assert not out[dead].any() and not d_q[dead].any()
    assert not d_k[np.broadcast_to(padding, d_k.shape)].any()
    assert not d_v[np.broadcast_to(padding, d_v.shape)].any()
    expected, _ = _compiled(functools.partial(ref.attention, sinks=sinks), q, key, value,
                                    see)
    _assert_close("output", out, expected, 2e-6 if dtype == jnp.float32 else 3e-2)


# --------------------------------------------------------------------------------------
# The rules themselves: the elementwise answer and the block classes.


@functools.partial(jax.jit, static_argnames=("t", "s", "blocks"))
def _visible_and_classes(bound, *, t, s, blocks):
    """Mask.visible `[B, N, T, S]` and the block classes `[B, N, nq, nk]` of every
    (example, head) of each bound mask, padded to whole blocks as the chunked kernel pads
    it. Compiled once per structure and shape."""
    grid = masks.Grid(t, s, *blocks)

    def one_head(head):
        padded = head.padded(grid.padded_t, grid.padded_s)
        return head.visible(head.coords(0, t, 0, s)), padded.classify(padded.blocks(grid))

    return [jax.vmap(jax.vmap(one_head))(mask) for mask in bound]


def _per_head(mask_list, b, n, t, s, positions=None, blocks=(8, 8)):
    """`_visible_and_classes` of each mask of the list, as NumPy arrays."""
    def bind(mask):
        bound = mask.bind(masks.Shape(b, t, s, n), positions)
        # [B, N, ...]: every head's own slice of each array
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (b, n) + x.shape[2:]), bound)

    out = _visible_and_classes([bind(m) for m in mask_list], t=t, s=s, blocks=blocks)
    return [(np.asarray(visible), np.asarray(table)) for visible, table in out]


def _check_classes(table, truth, block_q, block_k, *, exact=False):
    """SKIP blocks hold no visible pair and FULL blocks nothing hidden, over the real
    (unpadded) queries and keys; with exact=True, conversely too. table `[..., nq, nk]`,
    truth `[..., T, S]`."""
    t, s = truth.shape[-2:]
    nq, nk = -(-t // block_q), -(-s // block_k)
    assert table.shape == truth.shape[:-2] + (nq, nk)
    pad = [(0, 0)] * (truth.ndim - 2) + [(0, nq * block_q - t), (0, nk * block_k - s)]
    blocked = truth.shape[:-2] + (nq, block_q, nk, block_k)
    # [..., nq, nk]: some pair of the block visible / every real pair visible
    some = np.pad(truth, pad, constant_values=False).reshape(blocked).any(axis=(-3, -1))
    every = np.pad(truth, pad, constant_values=True).reshape(blocked).all(axis=(-3, -1))
    for claim, wrong in (("SKIP with a visible pair", (table == masks.SKIP) & some),
                         ("FULL with a hidden pair", (table == masks.FULL) & ~every)):
        assert not wrong.any(), f"{claim} at block {np.argwhere(wrong)[0]}"
    if exact:
        for claim, wrong in (("visible but SKIP", some != (table != masks.SKIP)),
                             ("whole but not FULL", every != (table == masks.FULL))):
            assert not wrong.any(), f"{claim} at block {np.argwhere(wrong)[0]}"


@settings(max_examples=30, **_SETTINGS)
@given(cases(sizes=SIZES[:4] + (40,), blocks=((1, 1), (3, 5), (8, 16), (16, 8), (24, 7))))
def test_visible_and_block_classes_agree_with_the_reference(case):
    """Mask.visible equals the reference grid on every head, and the block classifier
    is sound on random compositions: SKIP ⇒ nothing visible, FULL ⇒ everything."""
    note(f"case: {case}")
    b, t, s, n, _ = case["shape"]
    rs = np.random.RandomState(case["seed"])
    mask, tree = _build(case["tree"], (b, n, t, s), rs)
    positions, (q_pos, k_pos) = _positions(case["positions"], b, t, s, rs)
    truth = _reference_grid(tree, b, n, t, s, q_pos, k_pos)
    [(visible, table)] = _per_head([mask], b, n, t, s, positions, case["blocks"])
    np.testing.assert_array_equal(visible, truth)
    _check_classes(table, truth, *case["blocks"])


@settings(max_examples=30, **_SETTINGS)
@given(rule=st.sampled_from(("causal", "window", "chunked_causal", "prefix", "lengths")),
       t=st.sampled_from((1, 7, 40, 129)), s=st.sampled_from((2, 7, 33, 129)),
       block_q=st.sampled_from((1, 4, 8, 24)), block_k=st.sampled_from((1, 5, 16, 32)),
       sizes=st.tuples(st.integers(0, 12), st.integers(0, 12)),
       offsets=st.tuples(st.integers(0, 150), st.integers(0, 150)))
def test_block_classes_of_one_position_rule_are_exact(rule, t, s, block_q, block_k, sizes,
                                                       offsets):
    """With increasing positions (offset per example), one rule's classes are exact:
    every block with a visible pair is visited and every wholly visible one unmasked."""
    left, right = sizes
    node, mask = {
        "causal": (("causal",), masks.causal()),
        "window": (("window", left, right), masks.window(left, right)),
        "chunked_causal": (("chunked_causal", left + 1), masks.chunked_causal(left + 1)),
        "prefix": (("prefix", left * 10), masks.prefix(left * 10)),
        "lengths": (("lengths", np.array([left * 10, right]), np.array([right * 10, left])),
                    masks.lengths(jnp.array([left * 10, right], jnp.int32),
                                  jnp.array([right * 10, left], jnp.int32))),
    }[rule]
    q_pos = np.arange(t, dtype=np.int32) + np.array([[offsets[0]], [0]], np.int32)
    k_pos = np.arange(s, dtype=np.int32) + np.array([[offsets[1]], [3]], np.int32)
    truth = _reference_grid(node, 2, 1, t, s, q_pos, k_pos)
    positions = (jnp.asarray(q_pos), jnp.asarray(k_pos))
    [(_, table)] = _per_head([mask], 2, 1, t, s, positions, (block_q, block_k))
    _check_classes(table, truth, block_q, block_k, exact=True)


@pytest.mark.parametrize("tree", [("window", 2, -1),
                                  ("and", ("window", -1, 3), ("lengths", "key")),
                                  ("or", ("window", 4, -3), ("causal",))])
def test_a_window_with_a_negative_side_equals_the_reference(tree):
    """A window off the query's own position, as jax.nn takes it ((2, -1): the two keys
    before it; both had been refused): dense and chunked (blocks of 4 by 5, so that
    whole blocks are skipped and whole ones unmasked) equal the reference, and one such
    window's block classes are exact."""
    case = dict(shape=(2, 13, 17, 2, 1), tree=tree, positions="offset", mod=None,
                sinks=False, blocks=(4, 5), seed=len(str(tree)))
    _compare(case)
    node = tree if tree[0] == "window" else tree[1]
    q_pos = np.arange(13, dtype=np.int32) + np.array([[7], [0]], np.int32)
    k_pos = np.arange(17, dtype=np.int32) + np.array([[0], [3]], np.int32)
    truth = _reference_grid(node, 2, 1, 13, 17, q_pos, k_pos)
    [(_, table)] = _per_head([masks.window(*node[1:])], 2, 1, 13, 17,
                             (jnp.asarray(q_pos), jnp.asarray(k_pos)), (4, 5))
    _check_classes(table, truth, 4, 5, exact=True)


# --------------------------------------------------------------------------------------
# The algebra of & and |.


def _grids(*mask_list):
    """[B, N, T, S] = [2, 3, 9, 11] from Mask.visible, for each mask."""
    return [visible for visible, _ in _per_head(mask_list, 2, 3, 9, 11)]


def test_prefix_lm_is_causal_or_prefix():
    prefix = jnp.array([6, 0], jnp.int32)
    [got] = _grids(masks.causal() | masks.prefix(prefix))
    i = np.arange(9)[:, None] + 2  # bottom-right: S − T = 2
    j = np.arange(11)[None, :]
    for e, n in enumerate((6, 0)):
        expected = (j <= i) | (j < n)
        np.testing.assert_array_equal(got[e], np.broadcast_to(expected, got[e].shape))
    assert got[0].sum() > got[1].sum()  # the prefix adds keys for the first example


def _papers_alibi_slopes(n):
    """The ALiBi paper's reference code (ofirpress/attention_with_linear_biases), as it
    is written there."""
    def get_slopes_power_of_2(n):
        start = (2 ** (-2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (get_slopes_power_of_2(closest_power_of_2)
            + _papers_alibi_slopes(2 * closest_power_of_2)[0::2][:n - closest_power_of_2])


def test_alibi_slopes_are_the_papers_for_every_head_count():
    """(for N not a power of two they were 2^(−8(n+1)/N), not the paper's: N = 12 up to
    0.69 off, a model trained with ALiBi read with other slopes)"""
    for n in range(1, 130):
        np.testing.assert_allclose(scores.alibi_slopes(n), _papers_alibi_slopes(n),
                                   rtol=1e-7, err_msg=f"N = {n}")


def _t5_bucket_in_60_digits(relative_position, num_buckets, max_distance, bidirectional):
    """T5's bucket as transformers' T5Attention._relative_position_bucket writes it, with
    logarithms of 60 decimal digits: a quotient within 1e-40 of an integer is that
    integer (as at distance 10 for 3 buckets a direction and max_distance 100, where
    log(10)/log(100)·2 is 1)."""
    decimal.getcontext().prec = 60
    out = []
    for relative in relative_position.tolist():
        bucket, n, buckets = 0, -relative, num_buckets
        if bidirectional:
            buckets //= 2
            bucket += buckets if n < 0 else 0
            n = abs(n)
        else:
            n = max(n, 0)
        exact = buckets // 2
        if n < exact:
            out.append(bucket + n)
            continue
        x = ((decimal.Decimal(n) / exact).ln() / (decimal.Decimal(max_distance) / exact).ln()
             * (buckets - exact))
        whole = x.to_integral_value()
        k = int(whole) if abs(x - whole) < decimal.Decimal("1e-40") else math.floor(x)
        out.append(bucket + min(exact + k, buckets - 1))
    return np.asarray(out)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_are_exact_where_the_logarithm_is_a_whole_number(bidirectional):
    """(float32 logarithms put such distances a bucket short: 6 buckets, max_distance 100,
    bidirectional, ±10 in buckets 1 and 4 for T5's 2 and 5; 128 causal, −80 in 95 for
    96)"""
    relative = np.arange(-1100, 1101, dtype=np.int32)
    for num_buckets, max_distance in ((6, 100), (128, 100), (32, 128), (8, 16), (10, 20),
                                      (64, 1000), (16, 9), (4, 3)):
        got = scores.relative_position_bucket(relative, num_buckets=num_buckets,
                                              max_distance=max_distance,
                                              bidirectional=bidirectional)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(
            got, _t5_bucket_in_60_digits(relative, num_buckets, max_distance, bidirectional),
            err_msg=f"num_buckets={num_buckets}, max_distance={max_distance}")
    # narrower positions, max_distance beyond their range (a bucket's start had wrapped
    # around to a negative number: int8, -127 in bucket 15 for 14)
    for dtype, max_distance in ((np.int8, 300), (np.int16, 40000)):
        relative = np.arange(np.iinfo(dtype).min + 1, np.iinfo(dtype).max + 1, dtype=dtype)
        got = scores.relative_position_bucket(relative, num_buckets=32,
                                              max_distance=max_distance,
                                              bidirectional=bidirectional)
        assert got.dtype == dtype
        np.testing.assert_array_equal(
            got, _t5_bucket_in_60_digits(relative, 32, max_distance, bidirectional),
            err_msg=f"{np.dtype(dtype).name} positions, max_distance={max_distance}")


def test_and_or_algebra():
    """& and | are the elementwise and / or of the grids, with everything() their
    identity / absorbing element; idempotent, commutative, associative, distributive."""
    rs = np.random.RandomState(3)
    ids = jnp.asarray(np.sort(rs.randint(0, 3, (2, 9)), axis=1).astype(np.int32))
    k_ids = jnp.asarray(np.sort(rs.randint(0, 3, (2, 11)), axis=1).astype(np.int32))
    a = masks.causal()
    b = masks.window(2, 1) | masks.segments(ids, k_ids)
    c = masks.from_array(jnp.asarray(rs.rand(2, 3, 9, 11) < 0.5))
    everything = masks.everything()
    ga, gb, gc, g_everything = _grids(a, b, c, everything)
    assert g_everything.all()
    for g in (ga, gb, gc):  # not vacuous: each hides some pairs, and they differ
        assert g.any() and not g.all()
    assert (ga != gb).any() and (gb != gc).any() and (ga != gc).any()
    equalities = [  # (left, right, expected grid)
        (a & b, b & a, ga & gb), (a | c, c | a, ga | gc),
        (everything & b, b, gb), (c & everything, c, gc),
        (everything | a, b | everything, g_everything),
        (c & c, c | c, gc),
        ((a & b) & c, a & (b & c), ga & gb & gc),
        ((a | b) | c, a | (b | c), ga | gb | gc),
        (a & (b | c), (a & b) | (a & c), ga & (gb | gc)),
        (a | (b & c), (a | b) & (a | c), ga | (gb & gc)),
        (a | (a & c), a & (a | c), ga),
    ]
    grids = _grids(*[m for left, right, _ in equalities for m in (left, right)])
    for k, (_, _, expected) in enumerate(equalities):
        np.testing.assert_array_equal(grids[2 * k], expected, err_msg=f"equality {k}, left")
        np.testing.assert_array_equal(grids[2 * k + 1], expected, err_msg=f"equality {k}, right")


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_windows_at_the_int32_limit_are_unbounded(implementation):
    """A side of 2**31 - 1 or more sees every key on that side, T > S included (the
    queries' positions negative): q_pos ± a side had wrapped around in int32 and hidden
    keys, and 2**31 raised an OverflowError naming no argument."""
    rs = np.random.RandomState(8)
    q, k, v = (_normal(rs, shape) for shape in ((2, 9, 2, H), (2, 6, 2, H), (2, 6, 2, V)))
    blocks = {"block_sizes": (8, 8)} if implementation == "chunked" else {}
    call = functools.partial(attnjax.dot_product_attention, q, k, v,
                             implementation=implementation, **blocks)
    for wide in (2**31 - 1, 2**31, 2**40):
        np.testing.assert_array_equal(call(window=wide), call())
        np.testing.assert_array_equal(call(window=(wide, 0)), call(is_causal=True))
        np.testing.assert_array_equal(call(mask=masks.window(0, wide)),
                                      call(mask=masks.from_fn(lambda b, n, i, j: j >= i)))


def test_keywords_are_the_same_rules():
    """is_causal, window and the lengths keywords build the rules a Mask states."""
    rs = np.random.RandomState(5)
    q, k, v = (_normal(rs, shape) for shape in ((2, 9, 3, H), (2, 11, 1, H), (2, 11, 1, V)))
    lengths = jnp.array([4, 9], jnp.int32), jnp.array([11, 6], jnp.int32)

    @jax.jit
    def both(q, k, v, lengths):
        by_keywords = attnjax.dot_product_attention(
            q, k, v, is_causal=True, window=(3, 1), query_lengths=lengths[0],
            key_lengths=lengths[1], implementation="dense")
        by_mask = attnjax.dot_product_attention(
            q, k, v, mask=masks.causal() & masks.window(3, 1) & masks.lengths(*lengths),
            implementation="dense")
        return by_keywords, by_mask

    by_keywords, by_mask = both(q, k, v, lengths)
    np.testing.assert_array_equal(by_keywords, by_mask)
    assert not np.asarray(by_keywords)[0, 4:].any() and np.asarray(by_keywords)[0, :4].all()


# --------------------------------------------------------------------------------------
# Errors name the argument.

_Q = jnp.ones((2, 9, 3, H), jnp.float32)
_K = jnp.ones((2, 11, 1, H), jnp.float32)
_V = jnp.ones((2, 11, 1, V), jnp.float32)


def _plain(fn):
    """fn without the suite's runtime type checks (conftest.py), which would catch a
    wrong dtype first: the library's own checks are what every user meets."""
    return getattr(fn, "__wrapped__", fn)


def _attend(**options):
    return _plain(attnjax.dot_product_attention)(_Q, _K, _V, **options)


_IDS = jnp.zeros((2, 9), jnp.int32)
_KEY_IDS = jnp.zeros((2, 11), jnp.int32)

# (id, call, exception, regex: the argument's name and what was wrong)
MISTAKES = [
    ("segment_shape", lambda: _attend(mask=masks.segments(jnp.zeros((2, 10), jnp.int32),
                                                          _KEY_IDS)),
     ValueError, (r"segment ids \(query\) must have shape \[B, T\] = \[9\] or \[2, 9\]; "
                  r"got \[2, 10\]")),
    ("key_segment_shape", lambda: _attend(mask=masks.segments(_IDS, jnp.zeros((2, 12), jnp.int32))),
     ValueError, (r"segment ids \(key\) must have shape \[B, S\] = \[11\] or \[2, 11\]; "
                  r"got \[2, 12\]")),
    ("float_segments", lambda: _attend(mask=_plain(masks.segments)(
        jnp.zeros((2, 9), jnp.float32), _KEY_IDS)),
     TypeError, r"segment ids \(query\) must have an integer dtype; got float32"),
    ("segments_cross", lambda: _attend(mask=masks.segments(_IDS)),
     ValueError, r"segments\(query_ids\) alone needs T = S.*T=9, S=11"),
    ("from_fn_not_bool", lambda: _attend(mask=masks.from_fn(lambda b, n, q, k: q - k)),
     TypeError, r"from_fn's function must return booleans; got dtype int32"),
    ("from_fn_not_callable", lambda: _plain(masks.from_fn)(3), TypeError,
     r"from_fn needs a callable fn\(b, n, q_pos, k_pos\); got int"),
    ("mask_and_array", lambda: masks.causal() & jnp.ones((9, 11), bool), TypeError,
     r"a Mask combines with & only with another Mask; got .*Array.*from_array"),
    ("mask_or_array", lambda: masks.causal() | np.ones((9, 11), bool), TypeError,
     r"a Mask combines with \| only with another Mask; got ndarray"),
    ("chunked_causal_zero", lambda: masks.chunked_causal(0), ValueError,
     r"chunked_causal size must be a positive int; got 0"),
    ("prefix_string", lambda: _plain(masks.prefix)("a"), TypeError,
     r"prefix length must be an int or an int array \[B\]; got 'a'"),
    ("prefix_shape", lambda: _attend(mask=masks.prefix(jnp.array([1, 2, 3], jnp.int32))),
     ValueError, r"prefix length must have shape \[B\] = \[\] or \[2\]; got \[3\]"),
    ("lengths_neither", lambda: masks.lengths(), ValueError, r"lengths needs query= or key="),
    ("lengths_float", lambda: _attend(mask=_plain(masks.lengths)(
        key=jnp.array([1.0, 2.0], jnp.float32))),
     TypeError, r"key lengths must have an integer dtype; got float32"),
    ("window_empty", lambda: masks.window(-1, 0), ValueError,
     r"window \(left, right\) = \(-1, 0\) holds no key: query i sees keys i - left .. "
     r"i \+ right, so left \+ right must be >= 0"),
    ("array_float", lambda: _attend(mask=_plain(masks.from_array)(jnp.ones((9, 11), jnp.float32))),
     TypeError, r"mask must be boolean .*float32"),
    ("array_shape", lambda: _attend(mask=masks.from_array(jnp.ones((9, 12), bool))), ValueError,
     r"mask must be broadcastable to \[B, N, T, S\] = \[2, 3, 9, 11\]; got \[9, 12\]"),
    ("positions_shape", lambda: _attend(positions=(jnp.zeros((2, 8), jnp.int32),
                                                   jnp.zeros((2, 11), jnp.int32))),
     ValueError, r"query positions must have shape \[B, T\] = \[9\] or \[2, 9\]; got \[2, 8\]"),
    ("positions_float", lambda: _attend(positions=(jnp.zeros((9,), jnp.int32),
                                                   jnp.zeros((11,), jnp.float32))),
     TypeError, r"key positions must have an integer dtype; got float32"),
    # a mask written as a score_mod: scores of 0 and 1, silently, before
    ("score_mod_bool", lambda: _attend(score_mod=lambda score, b, n, q, k: k <= q), TypeError,
     r"score_mod must return floating scores \(the score's dtype float\d+\); got bool: a "
     r"rule of which keys a query sees is a mask \(masks.from_fn\)"),
    ("score_mod_int_chunked", lambda: _attend(
        score_mod=lambda score, b, n, q, k: (score > 0).astype(jnp.int32),
        implementation="chunked"),
     TypeError, r"score_mod must return floating scores \(the score's dtype float\d+\); "
                r"got int32"),
    ("lengths_ragged", lambda: _plain(masks.lengths)(key=[[1], [2, 3]]), TypeError,
     r"lengths key must be an array, or a list of numbers of one shape; got list"),
    ("score_mod_shape", lambda: _attend(score_mod=lambda score, b, n, q, k: score[0]),
     ValueError, r"score_mod must return the score's shape \[9, 11\]; got \[11\]"),
    # the chunked kernel calls score_mod on blocks (here one of 16 × 16), and once on the
    # call's whole grid, whose shape the error names as the dense kernel's does; before,
    # it broadcast the row silently, every query getting the first one's scores
    ("score_mod_shape_chunked", lambda: _attend(score_mod=lambda score, b, n, q, k: score[0],
                                                implementation="chunked"),
     ValueError, r"score_mod must return the score's shape \[9, 11\]; got \[11\]"),
    # a square block's transposed scores have the block's shape: silently wrong before
    ("score_mod_transposed_chunked", lambda: _attend(
        score_mod=lambda score, b, n, q, k: score.T, implementation="chunked"),
     ValueError, r"score_mod must return the score's shape \[9, 11\]; got \[11, 9\]"),
    ("from_fn_transposed_chunked", lambda: _attend(
        mask=masks.from_fn(lambda b, n, q, k: (k <= q).T), implementation="chunked"),
     ValueError, r"from_fn's function must return one boolean per query and key: a shape "
                 r"that broadcasts with q_pos \[9, 1\] and k_pos \[1, 11\] to \[9, 11\]; "
                 r"got \[11, 9\]"),
    # (an AttributeError of jax's literal types before)
    ("score_mod_number_chunked", lambda: _attend(score_mod=lambda score, b, n, q, k: 0.5,
                                                 implementation="chunked"),
     TypeError, r"score_mod must return an array of scores, the score's shape \[9, 11\]; "
                r"got float"),
    ("soft_cap_zero", lambda: scores.soft_cap(0.0), ValueError,
     r"soft_cap needs a positive finite cap; got 0.0"),
    # 1/cap flushed to 0 (every logit squashed to 0), or the cap's gradients NaN
    ("soft_cap_huge", lambda: scores.soft_cap(1e38), ValueError,
     r"soft_cap's cap must lie in \[1.18e-38, 1e\+30\].*got 1e\+38"),
    ("soft_cap_subnormal", lambda: scores.soft_cap(1e-40), ValueError,
     r"soft_cap's cap must lie in \[1.18e-38, 1e\+30\].*got 1e-40"),
    # no exact bucket a direction: was a ZeroDivisionError in the first call
    ("buckets_too_few", lambda: scores.relative_position_bias(jnp.ones((2, 3), jnp.float32),
                                                              num_buckets=2),
     ValueError, r"num_buckets must be an int ≥ 4 \(2 a direction\) with bidirectional=True; "
                 r"got 2"),
    ("bucket_too_few", lambda: scores.relative_position_bucket(
        jnp.arange(3), num_buckets=3, max_distance=8, bidirectional=True),
     ValueError, r"num_buckets must be an int ≥ 4"),
    # a negative prefix, refused when made (it was when called)
    ("prefix_negative", lambda: masks.prefix(-1), ValueError,
     r"prefix length must be non-negative \(a number of positions\); got -1"),
    ("prefix_negative_array", lambda: masks.prefix(np.array([2, -3])), ValueError,
     r"prefix length must be non-negative \(a number of positions\); got -3"),
    ("bucket_of_floats", lambda: scores.relative_position_bucket(
        jnp.arange(3.0), num_buckets=8, max_distance=16, bidirectional=True),
     TypeError, r"relative_position must be an integer array \(k_pos − q_pos\); got float"),
    ("alibi_rank", lambda: _plain(scores.alibi)(jnp.ones((2, 3), jnp.float32)), ValueError,
     r"alibi slopes must be a float array \[N\]; got float32 \[2, 3\]"),
    # known NaN or +inf values: every output of their heads NaN, silently, before
    ("alibi_nan", lambda: scores.alibi(jnp.array([0.5, jnp.nan], jnp.float32)), ValueError,
     r"alibi slopes must be finite; got nan at index \[1\]"),
    ("alibi_minus_inf", lambda: scores.alibi(np.array([-np.inf, 0.5], np.float32)),
     ValueError, r"alibi slopes must be finite; got -inf at index \[0\]"),
    ("table_inf", lambda: scores.relative_position_bias(
        jnp.ones((32, 3), jnp.bfloat16).at[4, 2].set(jnp.inf)), ValueError,
     r"relative_position_bias table must be finite or -inf \(those buckets masked\); got "
     r"inf at index \[4, 2\]"),
    ("table_shape", lambda: scores.relative_position_bias(jnp.ones((8, 3), jnp.float32)),
     ValueError, r"relative_position_bias table must be .*num_buckets=32.*\[8, 3\]"),
    ("chain_not_callable", lambda: _plain(scores.chain)(scores.soft_cap(1.0), 2), TypeError,
     r"chain's argument 1 must be a score_mod; got int"),
    ("sinks_shape", lambda: _attend(sinks=jnp.ones((4,), jnp.float32)), ValueError,
     r"sinks must have shape \[N\] = \[3\]; got \[4\]"),
    ("sinks_nan", lambda: _attend(sinks=jnp.array([0.5, jnp.nan, 1.0], jnp.float32)),
     ValueError, r"sinks must be finite or -inf \(no sink\); got nan at index \[1\]"),
    ("sinks_inf", lambda: _attend(sinks=jnp.array([jnp.inf, 0.0, 1.0], jnp.float32)),
     ValueError, r"sinks must be finite or -inf \(no sink\); got inf at index \[0\]"),
]


@pytest.mark.parametrize("call, error, message", [m[1:] for m in MISTAKES],
                         ids=[m[0] for m in MISTAKES])
def test_a_bad_rule_argument_is_a_named_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_lengths_and_prefix_take_lists_as_the_lengths_keywords_do(rng):
    """masks.lengths(key=[3, 11]) as key_lengths=[3, 11] (jax.nn takes lists), and
    masks.prefix([1, 4]) as its array; both were a TypeError."""
    q, k, v = (draws.normal(jax.random.fold_in(rng, i), x.shape) for i, x in
               enumerate((_Q, _K, _V)))
    attend = _plain(attnjax.dot_product_attention)
    np.testing.assert_array_equal(
        attend(q, k, v, mask=_plain(masks.lengths)(query=[9, 5], key=[3, 11])),
        attend(q, k, v, query_lengths=jnp.array([9, 5]), key_lengths=jnp.array([3, 11])))
    np.testing.assert_array_equal(
        attend(q, k, v, mask=masks.causal() | _plain(masks.prefix)([1, 4])),
        attend(q, k, v, mask=masks.causal() | masks.prefix(jnp.array([1, 4], jnp.int32))))


def test_rule_errors_are_raised_at_trace_time_under_jit():
    def attend(ids):
        return attnjax.dot_product_attention(_Q, _K, _V, mask=masks.segments(ids))

    with pytest.raises(ValueError, match=r"segments\(query_ids\) alone needs T = S"):
        jax.jit(attend)(_IDS)


# --------------------------------------------------------------------------------------
# Transformations: jit, vmap, grad.


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_vmap_and_jit_over_an_extra_axis_with_traced_segment_ids(implementation):
    """A Mask holding traced segment ids, prefix and key lengths, mapped over an extra
    leading axis E: each slice equals its own call and the reference, values and
    gradients."""
    e, b, t, n, k = 3, 2, 19, 4, 2
    rs = np.random.RandomState(13)
    q, key, value, d_out = (_normal(rs, (e,) + shape) for shape in (
        (b, t, n, H), (b, t, k, H), (b, t, k, V), (b, t, n, V)))
    ids = jnp.asarray(np.sort(rs.randint(0, 4, (e, b, t)), axis=-1).astype(np.int32))
    prefix = jnp.asarray(rs.randint(0, 6, (e, b)).astype(np.int32))
    k_len = jnp.asarray(rs.randint(10, t + 1, (e, b)).astype(np.int32))

    def attend(q, key, value, ids, prefix, k_len):
        mask = (masks.causal() | masks.prefix(prefix)) & masks.segments(ids) & masks.lengths(
            key=k_len)
        return attnjax.dot_product_attention(
            q, key, value, mask=mask, implementation=implementation,
            block_sizes=(8, 8) if implementation == "chunked" else None)

    def loss(q, key, value, ids, prefix, k_len):
        out = attend(q, key, value, ids, prefix, k_len)
        return jnp.sum(out * d_out[0]), out

    args = (q, key, value, ids, prefix, k_len)
    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    grads, out = jax.jit(jax.vmap(grad))(*args)
    chex.assert_shape(out, (e, b, t, n, V))
    alone = jax.jit(grad)
    for i in range(e):
        args_i = [x[i] for x in args]
        tree = ("and", ("and", ("or", ("causal",), ("prefix", np.asarray(prefix[i]))),
                        ("segments", np.asarray(ids[i]), np.asarray(ids[i]))),
                ("lengths", None, np.asarray(k_len[i])))
        expected, _ = _compiled(ref.attention, *args_i[:3], ref.visible(tree, b, n, t, t))
        grads_i, out_i = alone(*args_i)
        _assert_close(f"slice {i}", out[i], expected, 1e-12)
        _assert_close(f"slice {i} alone", out_i, expected, 1e-12)
        for g, want in zip(grads, grads_i):
            _assert_close(f"slice {i} gradient", g[i], want, 1e-12)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_a_sink_of_minus_infinity_is_no_sink(implementation):
    """sinks=-inf for a head is that head without a sink: the same output, log-sum-exp
    and gradients as no sinks (the chunked kernel started its running max at -inf, and
    gave another output and a log-sum-exp of MASKED)."""
    rs = np.random.RandomState(23)
    q, key, value = (_normal(rs, shape, jnp.float32)
                     for shape in ((2, 5, 2, 8), (2, 7, 2, 8), (2, 7, 2, 8)))
    d_out = _normal(rs, (2, 5, 2, 8), jnp.float32)

    def run(q, key, value, sinks):
        out, lse = attnjax.dot_product_attention(
            q, key, value, sinks=sinks, is_causal=True, return_residual=True,
            implementation=implementation)
        return jnp.sum(out * d_out) + jnp.sum(jnp.sin(lse)), (out, lse)

    grad = jax.jit(jax.grad(run, argnums=(0, 1, 2), has_aux=True))
    (grads, (out, lse)) = grad(q, key, value, jnp.full((2,), -jnp.inf, jnp.float32))
    (want_grads, (want_out, want_lse)) = grad(q, key, value, None)
    chex.assert_tree_all_finite((grads, out, lse))
    chex.assert_trees_all_close((out, lse, grads), (want_out, want_lse, want_grads),
                                rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_a_sink_of_plus_infinity_under_jit_takes_every_weight(implementation):
    """Under jit a +inf sink cannot be refused: its head's output is zeros with zero
    gradients, the other head is as it was, and nothing is NaN (the chunked kernel gave
    NaN, from inf - inf; dense a NaN sink gradient)."""
    rs = np.random.RandomState(29)
    q, key, value, d_out = (_normal(rs, shape, jnp.float32) for shape in (
        (2, 5, 2, 8), (2, 7, 2, 8), (2, 7, 2, 8), (2, 5, 2, 8)))
    finite = _normal(rs, (2,), jnp.float32)

    def run(q, key, value, sinks):
        out = attnjax.dot_product_attention(q, key, value, sinks=sinks, is_causal=True,
                                            implementation=implementation)
        return jnp.sum(out * d_out), out

    grad = jax.jit(jax.grad(run, argnums=(0, 1, 2, 3), has_aux=True))
    grads, out = grad(q, key, value, finite.at[0].set(jnp.inf))
    want_grads, want_out = grad(q, key, value, finite)
    chex.assert_tree_all_finite((grads, out))
    np.testing.assert_array_equal(out[:, :, 0], 0)
    np.testing.assert_allclose(out[:, :, 1], want_out[:, :, 1], rtol=1e-6, atol=1e-6)
    for g, want in zip(grads[:3], want_grads[:3]):
        # head 0's query rows and its keys and values (K = N: one per head) get nothing
        np.testing.assert_array_equal(g[:, :, 0], 0)
        np.testing.assert_allclose(g[:, :, 1], want[:, :, 1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(grads[3][0], 0)
    np.testing.assert_allclose(grads[3][1], want_grads[3][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_a_minus_infinity_bias_stays_a_mask_under_a_score_mod(implementation):
    """−inf in the bias is a mask also with a score_mod: a soft cap made −cap of it,
    and the hidden keys took weight (max error 0.23 against the masked call)."""
    rs = np.random.RandomState(31)
    b, t, s, n = 2, 5, 8, 2
    q, key, value, d_out = (_normal(rs, shape, jnp.float32) for shape in (
        (b, t, n, 4), (b, s, n, 4), (b, s, n, 4), (b, t, n, 4)))
    hidden = jnp.asarray(rs.uniform(size=(b, 1, t, s)) < 0.4).at[:, :, :, 0].set(False)
    noise = _normal(rs, (b, 1, t, s), jnp.float32)
    mod = scores.soft_cap(2.0)

    def loss(q, key, value, **kwargs):
        out = attnjax.dot_product_attention(q, key, value, score_mod=mod,
                                            implementation=implementation, **kwargs)
        return jnp.sum(out * d_out)

    grad = jax.jit(jax.value_and_grad(
        lambda q, k, v, bias: loss(q, k, v, bias=bias), argnums=(0, 1, 2, 3)))
    got = grad(q, key, value, jnp.where(hidden, -jnp.inf, noise))
    want = jax.jit(jax.value_and_grad(
        lambda q, k, v, bias: loss(q, k, v, bias=bias, mask=~hidden),
        argnums=(0, 1, 2, 3)))(q, key, value, noise)
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_nan_in_hidden_keys_and_queries_stays_out_of_score_mod_gradients(implementation):
    """A NaN in a key past its example's length, or in a query of a padded row, reaches
    no output or gradient through a score_mod (the dense kernel handed score_mod the
    NaN logits of hidden entries, and tanh'(NaN) · 0 made the queries' gradient NaN)."""
    rs = np.random.RandomState(29)
    b, t, s, n = 2, 6, 7, 2
    q, key, value = (_normal(rs, shape, jnp.float32)
                     for shape in ((b, t, n, 4), (b, s, n, 4), (b, s, n, 4)))
    k_len, q_len = jnp.array([3, 7]), jnp.array([6, 4])
    poisoned_k = key.at[0, 3:].set(jnp.nan)
    poisoned_q = q.at[1, 4:].set(jnp.nan)
    mod = scores.chain(scores.soft_cap(5.0), scores.alibi(jnp.array([0.25, 0.5])))

    def loss(q, key, value):
        out = attnjax.dot_product_attention(
            q, key, value, mask=masks.lengths(query=q_len, key=k_len), score_mod=mod,
            implementation=implementation)
        seen = (jnp.arange(t)[None, :] < q_len[:, None])[..., None, None]
        return jnp.sum(jnp.where(seen, out, 0) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    want = grad(q, key, value)
    got = grad(poisoned_q, poisoned_k, value)
    chex.assert_tree_all_finite(got)
    # the hidden rows' and keys' own gradients are zero either way
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_check_grads_with_a_score_mod_and_sinks(implementation):
    """Finite differences agree with the gradients w.r.t. q, k, v, sinks and the arrays
    the score_mod closes over (ALiBi slopes, a custom table)."""
    b, t, s, n, k = 1, 6, 9, 2, 1
    rs = np.random.RandomState(17)
    q, key, value = (_normal(rs, shape) for shape in ((b, t, n, 3), (b, s, k, 3), (b, s, k, 4)))
    sinks, slopes, u = _normal(rs, (n,)), jnp.asarray(rs.uniform(0.1, 0.5, n)), _normal(rs, (5, n))
    mask = masks.causal() & masks.window(4, 0) | masks.prefix(1)

    def fn(q, key, value, sinks, slopes, u):
        mod = scores.chain(scores.alibi(slopes), functools.partial(_custom_mod, u),
                           scores.soft_cap(3.0))
        return attnjax.dot_product_attention(
            q, key, value, mask=mask, score_mod=mod, sinks=sinks, implementation=implementation,
            block_sizes=(4, 4) if implementation == "chunked" else None)

    jax.test_util.check_grads(jax.jit(fn), (q, key, value, sinks, slopes, u), order=1,
                              modes=("rev",))


def test_masks_holding_arrays_compare_by_their_values():
    """(== of two masks holding arrays was numpy's "truth value of an array ... is
    ambiguous" error, whether the arrays were equal or not)"""
    generator = np.random.default_rng()
    ids = generator.integers(0, 3, (2, 9))
    same = masks.segments(ids) & masks.causal() | masks.prefix(np.array([2, 3]))
    assert same == (masks.segments(ids.copy()) & masks.causal()
                    | masks.prefix(np.array([2, 3])))
    other = ids.copy()
    other[1, 4] += 1
    assert same != (masks.segments(other) & masks.causal() | masks.prefix(np.array([2, 3])))
    assert masks.segments(ids) != masks.segments(ids.astype(np.int64)[:, :8])
    assert masks.lengths(np.array([3, 5]), np.array([4, 6])) != masks.lengths(
        np.array([3, 5]), np.array([4, 7]))
    assert masks.window(2, 0) == masks.window(2, 0) != masks.window(3, 0)


def test_masks_of_different_rules_have_different_tree_structures():
    """jit finds its compiled program by the arguments' tree structure: a partial hash,
    then equality. With jax's register_dataclass, Causal() and Everything() (and a & b,
    a | b) had equal structures, and a suite run once got causal attention from a call
    without a mask. Every pair of distinct rules, and the score specs and options, must
    differ; equal rules must not."""
    lengths, ids = jnp.array([3, 5]), jnp.zeros((2, 6), jnp.int32)
    rules = {
        "everything": masks.everything(), "causal": masks.causal(),
        "window": masks.window(2, 0), "chunked": masks.chunked_causal(2),
        "prefix": masks.prefix(lengths), "lengths": masks.lengths(lengths, lengths),
        "segments": masks.segments(ids, ids),
        "from_array": masks.from_array(jnp.ones((6, 6), bool)),
        "and": masks.causal() & masks.window(2, 0),
        "or": masks.causal() | masks.window(2, 0),
    }
    structures = {name: jax.tree.structure(m) for name, m in rules.items()}
    for a, sa in structures.items():
        for b, sb in structures.items():
            assert (sa == sb) == (a == b), (a, b, sa, sb)
    assert jax.tree.structure(masks.causal()) == jax.tree.structure(masks.causal())
    # a call without a mask, then a causal one, on one compiled function: each its own
    q, k, v = draws.normals(7, (1, 5, 2, 4), (1, 5, 2, 4), (1, 5, 2, 4))
    run = jax.jit(lambda mask: attnjax.dot_product_attention(q, k, v, mask=mask))
    plain, causal = run(masks.everything()), run(masks.causal())
    np.testing.assert_allclose(plain, attnjax.dot_product_attention(q, k, v), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(causal, attnjax.dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(plain, causal, rtol=1e-2)
