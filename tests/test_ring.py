"""Ring attention on 4 emulated devices equals dense attention, outputs and gradients."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec

import attnjax
from attnjax import masks
from attnjax.parallel import ring
from tests import draws

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest "
                                "sets --xla_force_host_platform_device_count=4)")

P = 4


def _mesh():
    return Mesh(np.asarray(jax.devices()[:P]), ("seq",))


def _inputs(rng, t, s, n, k, h, v):
    """q, k, v and an output cotangent, float32; drawn with numpy, which compiles
    nothing (the tests' time goes to the ring)."""
    draw = np.random.default_rng(np.asarray(jax.random.key_data(rng))).standard_normal
    return tuple(jnp.asarray(draw(shape), jnp.float32)
                 for shape in ((2, t, n, h), (2, s, k, h), (2, s, k, v), (2, t, n, v)))


def _close(actual, expected, tol=2e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual))
    error = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1.0)
    assert error <= tol, error


def _check_against_dense(attend, dense, q, k, v, d_out):
    """attend (jitted, on 4 devices) == dense, the output and the gradients of q, k, v
    of sum(output · d_out); returns attend's."""
    def output_and_grads(fn, q, k, v):
        out, pullback = jax.vjp(fn, q, k, v)
        return out, pullback(d_out)

    # one compilation of the ring, forward and backward together
    out, grads = jax.jit(functools.partial(output_and_grads, attend))(q, k, v)
    expected_out, expected_grads = output_and_grads(dense, q, k, v)
    for actual, expected in zip((out, *grads), (expected_out, *expected_grads)):
        _close(actual, expected)
    return out, grads


def _dense(**kwargs):
    return functools.partial(attnjax.dot_product_attention, implementation="dense", **kwargs)


def _in_shard_map(fn, *row_arrays):
    """fn(q, k, v, *row_arrays) inside shard_map, everything sharded along axis 1."""
    spec = PartitionSpec(None, "seq", None, None)
    rows = tuple(PartitionSpec(None, "seq") for _ in row_arrays)
    sharded = jax.shard_map(fn, mesh=_mesh(), in_specs=(spec, spec, spec) + rows,
                            out_specs=spec, check_vma=False)
    return lambda q, k, v: sharded(q, k, v, *row_arrays)


def test_ring_self_attention_on_a_mesh_of_explicit_axes(rng):
    """On jax.make_mesh's default mesh (Explicit axes, shardings in the types), inputs
    unsplit or split along the sequence: the zigzag reordering and shard_map had been
    jax's errors (a take along a split axis; in_specs that do not match the types).
    Values and gradients equal dense; the output is split along the sequence."""
    q, k, v, d_out = _inputs(rng, 16, 16, 4, 2, 8, 4)
    ids = jnp.asarray(np.sort(np.random.default_rng().integers(0, 3, (2, 16)), axis=1),
                      jnp.int32)
    mesh = jax.make_mesh((P,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,))
    attend = functools.partial(ring.ring_self_attention, mesh=mesh, is_causal=True,
                               segment_ids=ids)
    dense = _dense(is_causal=True, mask=masks.segments(ids))
    with jax.set_mesh(mesh):
        _check_against_dense(attend, dense, q, k, v, d_out)
        split = jax.sharding.NamedSharding(mesh, PartitionSpec(None, "seq"))
        out = jax.jit(attend)(*jax.device_put((q, k, v), split))
    _close(out, dense(q, k, v))
    assert out.sharding.spec[:2] == (None, "seq")


@pytest.mark.parametrize("is_causal", [False, True])
def test_ring_self_attention_equals_dense(rng, is_causal):
    q, k, v, d_out = _inputs(rng, 40, 40, 6, 2, 8, 5)   # GQA, V != H, T = 4·2·5
    attend = functools.partial(ring.ring_self_attention, mesh=_mesh(), is_causal=is_causal)
    _check_against_dense(attend, _dense(is_causal=is_causal), q, k, v, d_out)


@pytest.mark.parametrize("is_causal, t, s", [(True, 24, 24), (False, 12, 20), (True, 12, 20)])
def test_contiguous_layout_and_cross_attention(rng, is_causal, t, s):
    # causal with T < S: the default positions align the last query with the last key
    q, k, v, d_out = _inputs(rng, t, s, 4, 4, 8, 8)
    attend = _in_shard_map(functools.partial(ring.ring_attention, axis_name="seq",
                                             is_causal=is_causal))
    _check_against_dense(attend, _dense(is_causal=is_causal), q, k, v, d_out)


def _packed_ids(lengths_per_example, t):
    """int32 `[B, T]` monotone segment ids from each example's segment lengths."""
    ids = [np.repeat(np.arange(len(lengths)), lengths) for lengths in lengths_per_example]
    assert all(len(x) == t for x in ids)
    return jnp.asarray(np.stack(ids), jnp.int32)


@pytest.mark.parametrize("is_causal", [False, True])
def test_packed_segments_equal_dense(rng, is_causal):
    q, k, v, d_out = _inputs(rng, 40, 40, 6, 2, 8, 5)
    # shards of 10 (zig-zag chunks of 5): segments cross their boundaries
    ids = _packed_ids([[7, 13, 4, 16], [23, 17]], 40)
    attend = functools.partial(ring.ring_self_attention, mesh=_mesh(), is_causal=is_causal,
                               segment_ids=ids)
    _check_against_dense(attend, _dense(is_causal=is_causal, mask=masks.segments(ids)),
                         q, k, v, d_out)


# [B, T]: positions starting at 3 and at 11
_OFFSETS = jnp.asarray(np.asarray([[3], [11]]) + np.arange(24), jnp.int32)


@pytest.mark.parametrize("ring_kwargs, dense_kwargs", [
    (dict(mask=masks.window(3, 2)), dict(window=(3, 2))),
    (dict(mask=masks.window(7, -2)), dict(window=(7, -2))),      # keys 7..2 back only
    (dict(mask=masks.causal() | masks.prefix(7)),                 # prefix-LM, zig-zag
     dict(mask=masks.causal() | masks.prefix(7))),
    (dict(mask=masks.chunked_causal(5), positions=_OFFSETS),      # chunks follow the offset
     dict(mask=masks.chunked_causal(5), positions=(_OFFSETS, _OFFSETS))),
    (dict(is_causal=True, mask=masks.from_fn(lambda b, n, qp, kp: (qp + kp) % 3 != 1),
          positions=_OFFSETS),
     dict(is_causal=True, mask=masks.from_fn(lambda b, n, qp, kp: (qp + kp) % 3 != 1),
          positions=(_OFFSETS, _OFFSETS))),
], ids=["window", "window_behind", "prefix_lm", "chunked_causal_offset",
        "causal_from_fn_offset"])
def test_position_rules_equal_dense(rng, ring_kwargs, dense_kwargs):
    q, k, v, d_out = _inputs(rng, 24, 24, 3, 1, 4, 6)
    attend = functools.partial(ring.ring_self_attention, mesh=_mesh(), **ring_kwargs)
    _check_against_dense(attend, _dense(**dense_kwargs), q, k, v, d_out)


def test_rows_that_see_nothing_give_zeros_and_zero_gradients(rng):
    t, s = 16, 28
    q, k, v, d_out = _inputs(rng, t, s, 2, 2, 8, 3)
    # Padding by segment ids: query id −1 and key id −2 are carried by nothing else.
    q_ids = jnp.asarray([[0] * 5 + [1] * 7 + [-1] * 4, [-1] * 3 + [0] * 13], jnp.int32)
    k_ids = jnp.asarray([[0] * 9 + [1] * 15 + [-2] * 4, [0] * 20 + [-2] * 8], jnp.int32)

    def local(q, k, v, q_ids, k_ids):
        return ring.ring_attention(q, k, v, axis_name="seq", is_causal=True,
                                   mask=masks.segments(q_ids, k_ids))

    attend = _in_shard_map(local, q_ids, k_ids)
    dense = _dense(is_causal=True, mask=masks.segments(q_ids, k_ids))
    out, (d_q, d_k, d_v) = _check_against_dense(attend, dense, q, k, v, d_out)
    padded_rows = np.asarray(q_ids == -1)
    padded_keys = np.asarray(k_ids == -2)
    assert np.all(np.asarray(out)[padded_rows] == 0)
    assert np.all(np.asarray(d_q)[padded_rows] == 0)
    assert np.all(np.asarray(d_k)[padded_keys] == 0)
    assert np.all(np.asarray(d_v)[padded_keys] == 0)


def test_invisible_steps_are_skipped(rng, monkeypatch):
    """Contiguous causal: device i sees the shards of devices 0..i only, so it runs
    the kernel on i + 1 of the P steps."""
    q, k, v, _ = _inputs(rng, 16, 16, 2, 1, 4, 4)
    runs = collections.Counter()
    attend_shard = ring._attend_shard

    def counted(query, key, value, mask, score):
        jax.debug.callback(lambda device: runs.update([int(device)]), lax.axis_index("seq"))
        return attend_shard(query, key, value, mask, score)

    monkeypatch.setattr(ring, "_attend_shard", counted)
    attend = _in_shard_map(functools.partial(ring.ring_attention, axis_name="seq",
                                             is_causal=True))
    jax.block_until_ready(jax.jit(attend)(q, k, v))
    jax.effects_barrier()
    assert [runs[device] for device in range(P)] == [1, 2, 3, 4]


def _ppermutes(jaxpr, in_loop: bool = False) -> collections.Counter:
    """The ppermutes of a jaxpr and of the jaxprs nested in it, counted by whether a
    loop (a scan or a while: an XLA while loop) holds them."""
    found = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            found[in_loop] += 1
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += _ppermutes(inner, in_loop or eqn.primitive.name in ("while", "scan"))
    return found


def test_on_cpus_the_ring_steps_are_written_out(rng, monkeypatch):
    """XLA's CPU runtime runs a loop as one operation, whose collective-permutes can run
    alongside the program's collectives outside it, in whichever order each device
    reaches them: the copy model on --mesh seq=4 in one process waited forever in 4 of 5
    runs from jax's compilation cache, two processes whenever one came late. On CPUs no
    loop holds the ring's ppermutes, forward or backward, in one process as in several;
    elsewhere the P steps are one loop body (one copy of the kernel to compile)."""
    q, k, v, d_out = _inputs(rng, 16, 16, 2, 1, 4, 4)

    def grads(q, k, v):
        attend = functools.partial(ring.ring_self_attention, mesh=_mesh(), is_causal=True)
        _, pullback = jax.vjp(attend, q, k, v)
        return pullback(d_out)

    one_process = _ppermutes(jax.make_jaxpr(grads)(q, k, v).jaxpr)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    jax.clear_caches()   # traced again, not taken from the cache
    several = _ppermutes(jax.make_jaxpr(grads)(q, k, v).jaxpr)
    assert one_process[True] == several[True] == 0
    assert one_process[False] == several[False] > 0
    # elsewhere, one loop body
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    steps = jax.make_jaxpr(lambda c: ring._ring_steps(P, lambda i, c: c + i, c))(0)
    assert [e.primitive.name for e in steps.eqns] in (["scan"], ["while"])


def test_zigzag_balances_causal_work():
    """Non-skipped blocks of half a shard (the zig-zag chunks), per device, by the
    classifier the ring and the kernel use."""
    length = 8   # per shard

    def work(layout):
        per_device = []
        for me in range(P):
            blocks = 0
            for step in range(P):
                positions = (ring._shard_positions(me, P, length, layout),
                             ring._shard_positions((me - step) % P, P, length, layout))
                bound = masks.causal().bind(masks.Shape(1, length, length, 1), positions)
                head = jax.tree.map(lambda x: x[0, 0], bound)
                grid = masks.Grid(length, length, length // 2, length // 2)
                table = head.classify(head.blocks(grid))
                blocks += int(np.sum(np.asarray(table) != masks.SKIP))
            per_device.append(blocks)
        return per_device

    assert work("contiguous") == [3, 7, 11, 15]
    assert work("zigzag") == [9, 9, 9, 9]   # the 36 visible pairs of 8 chunks, shared evenly


def test_zigzag_round_trip(rng):
    x = draws.normal(rng, (2, 16, 3))
    np.testing.assert_array_equal(ring.unzigzag(ring.zigzag(x, 4), 4), x)
    order = np.asarray(ring.zigzag(jnp.arange(16)[None], 4))[0]
    np.testing.assert_array_equal(order.reshape(4, 4),
                                  [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])


@pytest.mark.usefixtures("own_checks_only")
@pytest.mark.parametrize("kwargs, error, message", [
    (dict(layout="striped"), ValueError, "layout must be one of"),
    (dict(k=3), ValueError, "key heads K=3 must divide query heads N=4"),
    (dict(mask=masks.lengths(key=jnp.asarray([3], jnp.int32))), ValueError,
     "cannot use a mask with lengths.*segment ids"),
    (dict(mask=masks.from_array(jnp.ones((4, 4), bool))), ValueError,
     "cannot use a mask with from_array.*segment ids"),
    (dict(mask=jnp.ones((4, 4), bool)), TypeError, "mask must be an attnjax.Mask"),
])
def test_ring_attention_errors(kwargs, error, message):
    k = kwargs.pop("k", 2)
    q = jnp.ones((1, 4, 4, 8), jnp.float32)
    key = jnp.ones((1, 4, k, 8), jnp.float32)
    with pytest.raises(error, match=message):
        ring.ring_attention(q, key, key, axis_name="seq", **kwargs)


@pytest.mark.usefixtures("own_checks_only")
@pytest.mark.parametrize("kwargs, message", [
    (dict(mask=masks.segments(jnp.zeros((2, 24), jnp.int32))), "segment_ids="),
    (dict(segment_ids=jnp.zeros((2, 20), jnp.int32)), r"segment_ids must have shape \[B, T\]"),
    (dict(positions=jnp.zeros((24,), jnp.int32)), r"positions must have shape \[B, T\]"),
])
def test_ring_self_attention_errors(kwargs, message):
    q = jnp.ones((2, 24, 2, 4), jnp.float32)
    with pytest.raises(ValueError, match=message):
        ring.ring_self_attention(q, q, q, _mesh(), **kwargs)


@pytest.mark.usefixtures("own_checks_only")
def test_ring_self_attention_s_shape_errors_name_the_callers_shapes():
    """Not the shards' (T / P) that ring_attention sees inside shard_map."""
    q = jnp.ones((2, 32, 4, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"key heads K=3 must divide query heads N=4; got "
                                         r"query \[2, 32, 4, 8\] \[B, T, N, H\], key "
                                         r"\[2, 32, 3, 8\]"):
        ring.ring_self_attention(q, q[:, :, :3], q[:, :, :3], _mesh())
    with pytest.raises(ValueError, match=r"query and key must agree on B and H; got query "
                                         r"\[2, 32, 4, 8\]"):
        ring.ring_self_attention(q, q[..., :4], q, _mesh())


def _grid_mesh():
    return Mesh(np.asarray(jax.devices()[:P]).reshape(2, 2), ("data", "seq"))


@pytest.mark.usefixtures("own_checks_only")
@pytest.mark.parametrize("shape, kwargs, error, message", [
    # from_fn reads global example and head indices, which sharding makes local (it had
    # silently read the local ones)
    ((2, 8, 2, 4), dict(mask=masks.from_fn(lambda b, n, i, j: (j <= i) | (b == 1)),
                        batch_axis="data"), ValueError,
     r"from_fn reads the example and head indices, which are local once the batch or the "
     r"heads are sharded"),
    ((1, 8, 2, 4), dict(batch_axis="data"), ValueError,
     r"batch_axis='data' splits B over its 2 devices, which needs B divisible by 2; got B=1"),
    ((2, 8, 2, 4), dict(batch_axis="seq"), ValueError,
     r"axis, batch_axis and head_axis must be different mesh axes"),
    ((2, 8, 2, 4), dict(scale=jnp.full((2,), 0.3)), TypeError,
     r"scale must be a real number or a 0-d array of one; got ArrayImpl of shape \[2\]"),
])
def test_ring_self_attention_sharding_errors(shape, kwargs, error, message):
    q = jnp.ones(shape, jnp.float32)
    with pytest.raises(error, match=message):
        ring.ring_self_attention(q, q, q, _grid_mesh(), **kwargs)


def test_ring_self_attention_masks_read_the_state_of_the_moment(rng):
    """A from_fn mask over a number that changes between eager calls, and over an array
    traced by the caller's jit and grad, and prefix(a jax number): each equals the dense
    kernel (the program compiled for the first call had been reused, a traced closure
    failed inside jax, and a jax number was an unhashable static argument)."""
    q, k, v, d_out = _inputs(rng, 16, 16, 2, 2, 8, 8)
    reach = np.array(2, np.int32)
    mask = masks.from_fn(lambda b, n, i, j: jnp.abs(i - j) <= reach)
    for reach[...] in (2, 2, 5):
        _close(ring.ring_self_attention(q, k, v, _mesh(), mask=mask),
               _dense(mask=masks.from_fn(lambda b, n, i, j, r=int(reach): jnp.abs(i - j) <= r))(
                   q, k, v))
    _close(ring.ring_self_attention(q, k, v, _mesh(), mask=masks.causal() | masks.prefix(
        jnp.int32(4))), _dense(mask=masks.causal() | masks.prefix(4))(q, k, v))

    def loss(attend, q, width):
        near = masks.from_fn(lambda b, n, i, j: jnp.abs(i - j) <= width)
        return jnp.sum(attend(q, k, v, mask=near) * d_out)

    ring_grad = jax.jit(jax.grad(functools.partial(
        loss, functools.partial(ring.ring_self_attention, mesh=_mesh()))))(q, jnp.int32(3))
    _close(ring_grad, jax.grad(functools.partial(loss, _dense()))(q, jnp.int32(3)))


@pytest.mark.parametrize("entry", ["ring_attention", "ring_self_attention"])
def test_from_fn_over_values_a_jit_traces_differentiates_from_outside_the_jit(rng, entry):
    """grad(jit(f)), f's from_fn closing over a number and an array that the jit traces
    (the caller's arguments): the gradients of q, k and v equal dense's. The ring's own
    custom VJP had held tracers of the jit's trace ("No constant handler")."""
    q, k, v, d_out = _inputs(rng, 16, 16, 2, 2, 8, 8)

    def loss(attend, q, k, v, width, shift):
        rule = masks.from_fn(lambda b, n, i, j: (jnp.abs(i - j) <= width)
                             | ((i + shift[b]) % 3 == 0))
        return jnp.sum(attend(q, k, v, mask=rule) * d_out)

    if entry == "ring_attention":
        def attend(q, k, v, mask):
            return _in_shard_map(functools.partial(ring.ring_attention, axis_name="seq",
                                                   is_causal=True, mask=mask))(q, k, v)
    else:
        attend = functools.partial(ring.ring_self_attention, mesh=_mesh(), is_causal=True)
    args = (q, k, v, jnp.int32(2), jnp.asarray([1, 2], jnp.int32))
    grads = jax.grad(jax.jit(functools.partial(loss, attend)), argnums=(0, 1, 2))(*args)
    expected = jax.grad(functools.partial(loss, _dense(is_causal=True)),
                        argnums=(0, 1, 2))(*args)
    for actual, want in zip(grads, expected):
        _close(actual, want)
