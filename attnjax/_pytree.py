"""Frozen dataclasses registered as pytrees: arrays are children, the rest is static."""

import dataclasses

import jax
import numpy as np


def dataclass(*, data: tuple[str, ...] = (), meta: tuple[str, ...] = ()):
    """`@dataclass(data=(...), meta=(...))`: a frozen dataclass whose `data` fields are
    pytree children (arrays, or None) and whose `meta` fields are static (hashable).

    Registered as a custom node whose static part holds the class itself. (jax's
    `register_dataclass` makes treedefs that compare equal across classes of the same
    fields: `Causal()` and `Everything()`, `a & b` and `a | b`. jit's cache, which
    finds an entry by a partial hash and then by equality, could then run the program
    of one mask for another: a call without a mask once returned causal attention.)
    """
    def register(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        fields = {field.name for field in dataclasses.fields(cls)}
        if fields != set(data + meta):
            raise TypeError(f"{cls.__name__}: data and meta must name its fields "
                            f"{sorted(fields)}; got {sorted(data + meta)}")
        keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

        def flatten_with_keys(x):
            return (tuple(zip(keys, (getattr(x, name) for name in data))),
                    (cls, *(getattr(x, name) for name in meta)))

        def flatten(x):
            return (tuple(getattr(x, name) for name in data),
                    (cls, *(getattr(x, name) for name in meta)))

        def unflatten(static, children):
            # as jax rebuilds a dataclass: the fields set, __init__ not run (children
            # may be placeholders)
            x = object.__new__(cls)
            for name, value in zip(data + meta, (*children, *static[1:])):
                object.__setattr__(x, name, value)
            return x

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)

        def equal(x, y):
            # as the dataclass's, but arrays compare as wholes (`==` compared them
            # elementwise, and Python then asked numpy for one truth value: an error)
            if type(y) is not cls:
                return NotImplemented
            return (all(getattr(x, name) == getattr(y, name) for name in meta)
                    and _same_data([getattr(x, name) for name in data],
                                   [getattr(y, name) for name in data]))

        cls.__eq__ = equal   # (the dataclass's __hash__ stays: arrays are unhashable)
        return cls
    return register


def _same_data(x, y) -> bool:
    """The same tree, each leaf the same object or an array of the same shape, dtype and
    values (a traced one only as the same object)."""
    x_leaves, x_tree = jax.tree.flatten(x)
    y_leaves, y_tree = jax.tree.flatten(y)
    return x_tree == y_tree and all(_same_leaf(a, b) for a, b in zip(x_leaves, y_leaves))


def _same_leaf(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return False
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
