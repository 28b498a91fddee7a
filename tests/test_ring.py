"""Ring attention on 4 emulated devices equals dense attention, outputs and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import attnjax
from attnjax.parallel import ring

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest "
                                "sets --xla_force_host_platform_device_count=4)")


def _mesh():
    return Mesh(np.asarray(jax.devices()[:4]), ("seq",))


def _inputs(rng, t, s, n, k, h, v):
    kq, kk, kv, kd = jax.random.split(rng, 4)
    return (jax.random.normal(kq, (2, t, n, h), jnp.float32),
            jax.random.normal(kk, (2, s, k, h), jnp.float32),
            jax.random.normal(kv, (2, s, k, v), jnp.float32),
            jax.random.normal(kd, (2, t, n, v), jnp.float32))


def _close(actual, expected, tol=2e-5):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    error = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1.0)
    assert error <= tol, error


def _check_against_dense(attend, q, k, v, d_out, is_causal):
    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * d_out)

    def dense(q, k, v):
        return attnjax.dot_product_attention(q, k, v, is_causal=is_causal,
                                             implementation="dense")

    _close(jax.jit(attend)(q, k, v), dense(q, k, v))
    ring_grads = jax.jit(jax.grad(functools.partial(loss, attend), argnums=(0, 1, 2)))(q, k, v)
    dense_grads = jax.grad(functools.partial(loss, dense), argnums=(0, 1, 2))(q, k, v)
    for actual, expected in zip(ring_grads, dense_grads):
        _close(actual, expected)


@pytest.mark.parametrize("is_causal", [False, True])
def test_ring_self_attention_equals_dense(rng, is_causal):
    q, k, v, d_out = _inputs(rng, 40, 40, 6, 2, 8, 5)   # GQA, V != H, T = 4·2·5
    attend = functools.partial(ring.ring_self_attention, mesh=_mesh(), is_causal=is_causal)
    _check_against_dense(attend, q, k, v, d_out, is_causal)


@pytest.mark.parametrize("is_causal, t, s", [(True, 24, 24), (False, 12, 20)])
def test_contiguous_layout_and_cross_attention(rng, is_causal, t, s):
    q, k, v, d_out = _inputs(rng, t, s, 4, 4, 8, 8)
    spec = PartitionSpec(None, "seq", None, None)
    attend = jax.shard_map(
        functools.partial(ring.ring_attention, axis_name="seq", is_causal=is_causal),
        mesh=_mesh(), in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
    _check_against_dense(attend, q, k, v, d_out, is_causal)


def test_zigzag_balances_causal_work():
    p = 4

    def work(layout):
        per_device = []
        for me in range(p):
            blocks = 0
            for step in range(p):
                for a in ring._chunk_ids(me, p, layout):
                    for b in ring._chunk_ids((me - step) % p, p, layout):
                        blocks += int(ring._case(a, b, True) != ring._SKIP)
            per_device.append(blocks)
        return per_device

    # in units of one chunk pair (a contiguous pair is 4 zig-zag pairs)
    assert [4 * w for w in work("contiguous")] == [4, 8, 12, 16]
    assert work("zigzag") == [9, 9, 9, 9]   # the 36 visible pairs of 8 chunks, shared evenly


def test_zigzag_round_trip(rng):
    x = jax.random.normal(rng, (2, 16, 3), jnp.float32)
    np.testing.assert_array_equal(ring.unzigzag(ring.zigzag(x, 4), 4), x)
    order = np.asarray(ring.zigzag(jnp.arange(16)[None], 4))[0]
    np.testing.assert_array_equal(order.reshape(4, 4),
                                  [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]])


@pytest.mark.parametrize("kwargs, message", [
    (dict(layout="striped"), "layout must be one of"),
    (dict(is_causal=True, s=8), "is_causal needs query and key shards of the same positions"),
    (dict(k=3), "key heads K=3 must divide query heads N=4"),
])
def test_ring_errors(kwargs, message):
    s, k = kwargs.pop("s", 4), kwargs.pop("k", 2)
    q = jnp.ones((1, 4, 4, 8), jnp.float32)
    key = jnp.ones((1, s, k, 8), jnp.float32)
    with pytest.raises(ValueError, match=message):
        ring.ring_attention(q, key, key, axis_name="seq", **kwargs)
