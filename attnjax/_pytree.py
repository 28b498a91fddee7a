"""Frozen dataclasses registered as pytrees: arrays are children, the rest is static."""

import dataclasses

import jax


def dataclass(*, data: tuple[str, ...] = (), meta: tuple[str, ...] = ()):
    """`@dataclass(data=(...), meta=(...))`: a frozen dataclass whose `data` fields are
    pytree children (arrays, or None) and whose `meta` fields are static (hashable)."""
    def register(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        return jax.tree_util.register_dataclass(cls, data_fields=list(data),
                                                meta_fields=list(meta))
    return register
