"""projection_activation: q = φ_Q(X_q W^Q + b^Q), k = φ_K(X_k W^K + b^K),
v = φ_V(X_v W^V + b^V), in the pure API and both module APIs, against a float64 NumPy
reference written out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnjax
import attnjax.nnx as anx
from attnjax import nn

B, T, S, D, N, H = 2, 3, 5, 8, 2, 4


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _reference(params, xq, xkv, phis, is_causal=False):
    """Multi-head attention with activated projections, one head at a time."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    xq, xkv = np.asarray(xq, np.float64), np.asarray(xkv, np.float64)
    out = np.zeros((B, T, p["out"]["kernel"].shape[-1]))
    for b in range(B):
        heads = []
        for n in range(N):
            q = phis[0](xq[b] @ p["query"]["kernel"][:, n] + p["query"]["bias"][n])   # [T, H]
            k = phis[1](xkv[b] @ p["key"]["kernel"][:, n] + p["key"]["bias"][n])      # [S, H]
            v = phis[2](xkv[b] @ p["value"]["kernel"][:, n] + p["value"]["bias"][n])  # [S, H]
            logits = q @ k.T / np.sqrt(H)                                              # [T, S]
            if is_causal:
                visible = np.arange(S)[None, :] <= np.arange(T)[:, None] + (S - T)
                logits = np.where(visible, logits, -np.inf)
            weights = np.exp(logits - logits.max(-1, keepdims=True))
            heads.append((weights / weights.sum(-1, keepdims=True)) @ v)              # [T, H]
        # [T, N, H] -> [T, F]
        out[b] = np.einsum("tnh,nhf->tf", np.stack(heads, 1), p["out"]["kernel"])
        out[b] += p["out"]["bias"]
    return out


@pytest.fixture(scope="module")
def case():
    """Parameters of init_multi_head_attention's tree (non-zero biases, so that the
    activation acts on W x + b) and inputs, from NumPy's generator."""
    rng = np.random.default_rng(11)
    shapes = jax.eval_shape(lambda key: attnjax.init_multi_head_attention(key, D, N),
                            jax.random.key(0))
    params = jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(D), jnp.float32), shapes)
    return (params, jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32),
            jnp.asarray(rng.standard_normal((B, S, D)), jnp.float32))


TRIPLE = (jnp.tanh, jax.nn.relu, jax.nn.sigmoid)
NUMPY_TRIPLE = (np.tanh, lambda x: np.maximum(x, 0.0), _sigmoid)


def test_pure_api_against_the_reference(case):
    params, xq, xkv = case
    pure = jax.jit(attnjax.multi_head_attention,
                   static_argnames=("projection_activation", "is_causal"))
    np.testing.assert_allclose(pure(params, xq, xkv, projection_activation=TRIPLE),
                               _reference(params, xq, xkv, NUMPY_TRIPLE), atol=1e-5)
    np.testing.assert_allclose(
        pure(params, xq, xkv, projection_activation=jnp.tanh, is_causal=True),
        _reference(params, xq, xkv, (np.tanh,) * 3, is_causal=True), atol=1e-5)
    # the default is the identity: the plain linear projections
    identity = (lambda x: x,) * 3
    np.testing.assert_allclose(pure(params, xq, xkv), _reference(params, xq, xkv, identity),
                               atol=1e-5)


def test_modules_against_the_reference(case):
    params, xq, xkv = case
    expected = _reference(params, xq, xkv, NUMPY_TRIPLE)
    linen = nn.MultiHeadAttention(num_heads=N, projection_activation=TRIPLE)
    np.testing.assert_allclose(jax.jit(linen.apply)({"params": params}, xq, xkv), expected,
                               atol=1e-5)
    module = anx.MultiHeadAttention(N, D, projection_activation=TRIPLE, decode=False,
                                    rngs=nnx.Rngs(0))
    anx.from_linen_params(module, params)
    np.testing.assert_allclose(nnx.jit(lambda m, a, b: m(a, b))(module, xq, xkv), expected,
                               atol=1e-5)


@pytest.mark.usefixtures("own_checks_only")
def test_bad_projection_activation_is_a_type_error(case):
    params, xq, xkv = case
    message = (r"projection_activation must be None, a callable or a \(phi_q, phi_k, phi_v\) "
               r"triple of callables or None; got \(<PjitFunction of <function tanh")
    with pytest.raises(TypeError, match=message):
        attnjax.multi_head_attention(params, xq, projection_activation=(jnp.tanh, jnp.tanh))
    with pytest.raises(TypeError, match="projection_activation must be"):
        anx.MultiHeadAttention(N, D, projection_activation="relu", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="projection_activation must be"):
        nn.MultiHeadAttention(num_heads=N, projection_activation=3).init(jax.random.key(0), xq)
