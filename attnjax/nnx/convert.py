"""Parameters between the linen and nnx modules of attnjax.

The nnx modules hold their submodules under the names of the linen modules' scopes, so
a model's parameters are one tree in either API; these two functions move it across.
"""

from flax import nnx
from flax.core import meta


def to_linen_params(model: nnx.Module) -> dict:
    """The parameters of an `attnjax.nnx` module as the `params` collection of its
    `attnjax.nn` (linen) counterpart: a nested dict of arrays, e.g.
    `{"encoder": {"layer_0": {"self": {"query": {"kernel": ...}}}}}`, ready for
    `linen_model.apply({"params": ...}, ...)` or a checkpoint. Caches, rng streams and
    intermediates are not parameters and are left out."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def from_linen_params(model: nnx.Module, params) -> nnx.Module:
    """Load the `params` of an `attnjax.nn` (linen) module — `variables["params"]` —
    into its `attnjax.nnx` counterpart, in place, and return it. The trees must match
    exactly (same config): a missing or extra parameter is a ValueError naming it, a
    shape or dtype that differs a ValueError naming the parameter and both, a leaf that
    is not an array a TypeError. Boxed parameters (`flax.linen.with_partitioning`'s
    `Partitioned`) are unboxed."""
    params = meta.unbox(params)
    state = nnx.state(model, nnx.Param)
    expected = {path: leaf for path, leaf in _flat(nnx.to_pure_dict(state))}
    given = dict(_flat(params))
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or extra:
        raise ValueError("params must have the parameters of the nnx model; "
                         f"missing {['/'.join(p) for p in missing]}, "
                         f"unexpected {['/'.join(p) for p in extra]}")
    for path, leaf in expected.items():
        name, value = "/".join(path), given[path]
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise TypeError(f"params[{name}] must be an array; got {type(value).__name__}")
        if tuple(value.shape) != tuple(leaf.shape):
            raise ValueError(f"params[{name}] must have shape {tuple(leaf.shape)}; "
                             f"got {tuple(value.shape)}")
        if value.dtype != leaf.dtype:
            raise ValueError(f"params[{name}] must have dtype {leaf.dtype} (the model's "
                             f"param_dtype); got {value.dtype}")
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def _flat(tree, prefix=()):
    for name, sub in tree.items():
        if hasattr(sub, "items"):
            yield from _flat(sub, prefix + (str(name),))
        else:
            yield prefix + (str(name),), sub
