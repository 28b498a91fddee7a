"""Parameter trees for tests: perturbed away from their initial values."""

import jax
import numpy as np

from tests import draws


def _noise(x, generator, scale):
    """x + scale · N(0, 1), on the host: no compiled program for each leaf's shape."""
    x = np.asarray(x)
    return jax.device_put((x + scale * generator.standard_normal(x.shape)).astype(x.dtype))


def perturbed(params, rng, scale=0.1):
    """Non-zero biases and non-default kernels, so nothing passes by being zero."""
    generator = draws.host(rng)
    leaves, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [_noise(x, generator, scale) for x in leaves])
