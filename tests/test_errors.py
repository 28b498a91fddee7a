"""A user's mistake is a ValueError/TypeError naming the argument and what was wrong,
raised at trace time (also under jit), never an XLA error or a silent NaN."""

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

import attnjax
from tests import draws

B, T, S, N, K, H, V = 2, 5, 7, 6, 3, 4, 11
q, k, v = draws.normals(0, (B, T, N, H), (B, S, K, H), (B, S, K, V))
dpa = attnjax.dot_product_attention
params = attnjax.init_multi_head_attention(jax.random.key(3), 8, 4, out_features=6)
x = draws.normal(4, (B, T, 8))


def _replace(tree, name, leaf, value):
    new = {key: dict(sub) for key, sub in tree.items()}
    new[name][leaf] = value
    return new


# (id, call, exception, regex the message must match: argument name and shapes/values)
MISTAKES = [
    ("head_dims", lambda: dpa(q, k[..., :3], v), ValueError, r"head dim H.*key \[2, 7, 3, 3\]"),
    ("kv_lengths", lambda: dpa(q, k, v[:, :6]), ValueError, r"key length S.*value \[2, 6, 3, 11\]"),
    ("batch", lambda: dpa(q[:1], k, v), ValueError, r"batch size B.*query \[1, 5, 6, 4\]"),
    ("kv_heads", lambda: dpa(q, k, v[:, :, :1]), ValueError, r"key/value heads K.*value \[2, 7, 1, 11\]"),
    ("heads_divide", lambda: dpa(q[:, :, :5], k, v), ValueError, r"K=3 must divide.*N=5"),
    ("float_mask", lambda: dpa(q, k, v, mask=jnp.ones((T, S), jnp.float32)), TypeError,
     r"mask must be boolean.*float32.*bias"),
    ("mask_shape", lambda: dpa(q, k, v, mask=jnp.ones((T, S + 1), bool)), ValueError,
     r"mask must be broadcastable to \[B, N, T, S\] = \[2, 6, 5, 7\]; got \[5, 8\]"),
    ("bias_shape", lambda: dpa(q, k, v, bias=jnp.ones((3, N, T, S), jnp.float32)), ValueError,
     r"bias must be broadcastable.*\[2, 6, 5, 7\]; got \[3, 6, 5, 7\]"),
    ("query_rank", lambda: dpa(q[0, 0], k[0, 0], v[0, 0]), ValueError,
     r"query must have rank 3 or 4.*got shape \[6, 4\]"),
    ("key_rank", lambda: dpa(q, k[0], v), ValueError, r"key must have the rank of query.*\[7, 3, 4\]"),
    ("int_dtype", lambda: dpa(q, k.astype(jnp.int32), v), TypeError, r"key must have a floating dtype; got int32"),
    ("mixed_dtype", lambda: dpa(q, k.astype(jnp.bfloat16), v), TypeError,
     r"query float32, key bfloat16, value float32"),
    ("dropout_rate", lambda: dpa(q, k, v, dropout_rate=1.0, dropout_rng=jax.random.key(0)),
     ValueError, r"dropout_rate must lie in \[0, 1\); got 1.0"),
    ("negative_dropout", lambda: dpa(q, k, v, dropout_rate=-0.1, dropout_rng=jax.random.key(0)),
     ValueError, r"dropout_rate must lie in \[0, 1\); got -0.1"),
    ("dropout_rng", lambda: dpa(q, k, v, dropout_rate=0.1), ValueError, r"dropout_rate=0.1 needs a dropout_rng"),
    ("lengths_shape", lambda: dpa(q, k, v, key_lengths=jnp.array([3, 4, 5], jnp.int32)), ValueError,
     r"key_lengths must have shape \[B\] = \[2\]; got \[3\]"),
    ("lengths_dtype", lambda: dpa(q, k, v, query_lengths=jnp.array([3.0, 4.0], jnp.float32)),
     TypeError, r"query_lengths must have an integer dtype; got float32"),
    ("window", lambda: dpa(q, k, v, window=(2, -3)), ValueError,
     r"window \(left, right\) = \(2, -3\) holds no key.*left \+ right must be >= 0"),
    ("weights_unavailable", lambda: dpa(q, k, v, return_weights=True, implementation="cudnn"),
     ValueError, r"return_weights=True needs implementation='dense'.*'cudnn'"),
    ("implementation", lambda: dpa(q, k, v, implementation="flash"), ValueError,
     r"implementation must be one of .*'dense'.*got 'flash'"),
    ("cudnn_on_cpu", lambda: dpa(q, k, v, implementation="cudnn"), ValueError, r"'cudnn' needs a CUDA GPU.*'cpu'"),
    ("block_sizes", lambda: dpa(q, k, v, implementation="chunked", block_sizes=(0, 8)), ValueError,
     r"block_sizes must be a pair of positive ints.*\(0, 8\)"),
    ("chunked_weights", lambda: dpa(q, k, v, return_weights=True, implementation="chunked"),
     ValueError, r"return_weights=True needs implementation='dense'.*'chunked'"),
    ("scale", lambda: dpa(q, k, v, scale=-1.0), ValueError, r"scale must be positive.*-1.0"),
    ("qkv_features", lambda: attnjax.init_multi_head_attention(jax.random.key(0), 8, 3, qkv_features=8),
     ValueError, r"qkv_features must be divisible by num_heads; got qkv_features=8, num_heads=3"),
    ("kv_heads_param", lambda: attnjax.init_multi_head_attention(jax.random.key(0), 8, 4, num_kv_heads=3),
     ValueError, r"num_kv_heads must divide num_heads; got num_kv_heads=3, num_heads=4"),
    ("params_shape", lambda: attnjax.multi_head_attention(
        _replace(params, "out", "kernel", jnp.ones((4, 3, 6), jnp.float32)), x),
     ValueError, r"params\['out'\]\['kernel'\] must have shape \[N, V, F\] = \[4, 2, 6\]; got \[4, 3, 6\]"),
    ("params_bias", lambda: attnjax.multi_head_attention(
        _replace(params, "query", "bias", jnp.ones((4,), jnp.float32)), x),
     ValueError, r"params\['query'\]\['bias'\] must have shape \[N, H\] = \[4, 2\]; got \[4\]"),
    ("params_inputs", lambda: attnjax.multi_head_attention(params, x[..., :7]), ValueError,
     r"inputs_q has 7 features \(its last axis, D\); these parameters project 8: "
     r"params\['query'\]\['kernel'\] is \[8, 4, 2\]"),
    ("params_tree", lambda: attnjax.multi_head_attention({"query": params["query"]}, x), ValueError,
     r"params must be \{'query', 'key', 'value', 'out'\}.*got \['query'\]"),
    ("core_rank", lambda: attnjax.attention(q[0], k[0], v[0]), ValueError, r"q must have rank 2.*\[5, 6, 4\]"),
    ("core_mask", lambda: attnjax.attention(q[0, :, 0], k[0, :, 0], v[0, :, 0], mask=jnp.ones((T,), jnp.int32)),
     TypeError, r"mask must be boolean.*int32"),
    ("additive_params", lambda: attnjax.additive_score(
        q[0, :, 0], k[0, :, 0], w_q=jnp.ones((H, 3), jnp.float32), w_k=jnp.ones((H + 1, 3), jnp.float32),
        v=jnp.ones((3,), jnp.float32)),
     ValueError, r"w_k must have shape \[Hk, A\] = \[4, 3\]; got \[5, 3\]"),
]


# attnjax's own messages, as a user without runtime type checks sees them
pytestmark = pytest.mark.usefixtures("own_checks_only")


def test_at_least_fifteen_distinct_mistakes_are_covered():
    assert len({m[0] for m in MISTAKES}) >= 15


@pytest.mark.parametrize("call, error, message", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_mistake_raises_a_named_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("name, call", [
    ("head_dims", lambda q, k, v: dpa(q, k[..., :3], v)),
    ("float_mask", lambda q, k, v: dpa(q, k, v, mask=jnp.ones((T, S), jnp.float32))),
    ("lengths_shape", lambda q, k, v: dpa(q, k, v, key_lengths=jnp.ones((3,), jnp.int32))),
])
def test_mistakes_are_caught_at_trace_time_under_jit(name, call):
    with pytest.raises((ValueError, TypeError), match="must"):
        jax.jit(call)(q, k, v)


def test_runtime_type_checks_also_catch_shape_mismatch():
    """With jaxtyping enabled (this suite's default), annotations reject bad shapes too."""
    jaxtyping.config.update("jaxtyping_disable", False)
    with pytest.raises(TypeError):
        attnjax.attention(q[0, :, 0], k[0, :4, 0], v[0, :, 0])


def test_runtime_type_checks_reach_the_modules_the_ring_and_the_trainer():
    """The suite's hook checks attnjax.nnx, attnjax.parallel and attnjax.toy too
    (conftest): a wrong argument type is jaxtyping's error before it is attnjax's own."""
    from flax import nnx

    from attnjax import nnx as anx
    from attnjax.parallel import ring_attention
    from attnjax.toy import tasks

    jaxtyping.config.update("jaxtyping_disable", False)
    with pytest.raises(jaxtyping.TypeCheckError, match="projection_activation"):
        anx.MultiHeadAttention(4, 8, projection_activation="relu", rngs=nnx.Rngs(0))
    with pytest.raises(jaxtyping.TypeCheckError, match="mask"):
        ring_attention(q, k, v, axis_name="seq", mask=jnp.ones((T, S), bool))
    with pytest.raises(jaxtyping.TypeCheckError, match="src_len"):
        tasks.make_batch([[3, 4]], [[4, 3]], src_len="4", tgt_len=4)
    # numpy's ints, as the tasks draw them, are token ids too
    batch = tasks.make_batch([[np.int64(3), 4]], [[4, np.int32(3)]], src_len=4, tgt_len=4)
    np.testing.assert_array_equal(batch.tgt_in[0], [tasks.BOS, 4, 3, tasks.PAD, tasks.PAD])
