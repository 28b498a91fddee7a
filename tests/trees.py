"""Parameter trees for tests: perturbed away from their initial values."""

import functools

import jax


@functools.partial(jax.jit, static_argnums=2)
def _noise(x, key, scale):
    """x + scale · N(0, 1), compiled once per shape (run eagerly, the draw is a dozen
    programs of its own for every leaf)."""
    return x + scale * jax.random.normal(key, x.shape, x.dtype)


def perturbed(params, rng, scale=0.1):
    """Non-zero biases and non-default kernels, so nothing passes by being zero."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(rng, len(leaves))
    return jax.tree.unflatten(tree, [_noise(x, k, scale) for x, k in zip(leaves, keys)])
