"""Parameters between the linen and nnx modules of attnjax.

The nnx modules hold their submodules under the names of the linen modules' scopes, so
a model's parameters are one tree in either API; these two functions move it across.
"""

from flax import nnx


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
    shape that differs a ValueError naming the parameter and both shapes."""
    state = nnx.state(model, nnx.Param)
    expected = {path: leaf for path, leaf in _flat(nnx.to_pure_dict(state))}
    given = dict(_flat(params))
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or extra:
        raise ValueError("params must have the parameters of the nnx model; "
                         f"missing {['/'.join(p) for p in missing]}, "
                         f"unexpected {['/'.join(p) for p in extra]}")
    for path, leaf in expected.items():
        if tuple(given[path].shape) != tuple(leaf.shape):
            raise ValueError(f"params[{'/'.join(path)}] must have shape {tuple(leaf.shape)}; "
                             f"got {tuple(given[path].shape)}")
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def _flat(tree, prefix=()):
    for name, sub in tree.items():
        if hasattr(sub, "items"):
            yield from _flat(sub, prefix + (str(name),))
        else:
            yield prefix + (str(name),), sub
