"""Meshes and the Megatron layout of the Transformer's parameters.

A mesh always has the axes "data" and "model" (size 1 when unused): batches are split
over "data"; attention and feed-forward parameters over "model" — the query, key and
value kernels and the output kernel by heads, the feed-forward input kernel by output
units and its output kernel by input units — so each device holds 1/M of every large
matrix and XLA's SPMD partitioner inserts the collectives. The optimiser state follows
the parameters it belongs to (its leaves have the same paths).
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "model")

# (module name, parameter name) -> how to split it; everything else is replicated.
_MEGATRON = {
    ("query", "kernel"): PartitionSpec(None, "model", None),    # [D, N, H]
    ("key", "kernel"): PartitionSpec(None, "model", None),      # [D, K, H]
    ("value", "kernel"): PartitionSpec(None, "model", None),    # [D, K, V]
    ("query", "bias"): PartitionSpec("model", None),            # [N, H]
    ("key", "bias"): PartitionSpec("model", None),
    ("value", "bias"): PartitionSpec("model", None),
    ("out", "kernel"): PartitionSpec("model", None, None),      # [N, V, F]
    ("wi", "kernel"): PartitionSpec(None, "model"),             # [D, F_ff]
    ("wi", "bias"): PartitionSpec("model"),                     # [F_ff]
    ("wo", "kernel"): PartitionSpec("model", None),             # [F_ff, D]
}


def parse_mesh(text: str) -> dict[str, int]:
    """"data=2,model=2" -> {"data": 2, "model": 2}."""
    shape = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        name = name.strip()
        if not sep or name not in AXES or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"--mesh expects axis=size pairs over {AXES}, e.g. data=2,model=2; "
                             f"got {text!r}")
        if name in shape:
            raise ValueError(f"--mesh names axis {name!r} twice; got {text!r}")
        shape[name] = int(size)
    return shape


def make_mesh(shape: dict[str, int] | None = None, devices=None) -> Mesh:
    """A ("data", "model") mesh over `devices` (default: all); by default all on "data"."""
    devices = jax.devices() if devices is None else list(devices)
    shape = {"data": len(devices)} if shape is None else dict(shape)
    sizes = tuple(shape.get(axis, 1) for axis in AXES)
    if math.prod(sizes) != len(devices):
        raise ValueError(f"the mesh {shape} needs {math.prod(sizes)} devices; there are "
                         f"{len(devices)}")
    return Mesh(np.asarray(devices).reshape(sizes), AXES)


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def partition_spec(path, leaf) -> PartitionSpec:
    """The Megatron split of one parameter (or optimiser-state leaf) by its path."""
    names = _names(path)
    if len(names) >= 2 and getattr(leaf, "ndim", 0) >= 1:
        return _MEGATRON.get(names[-2:], PartitionSpec())
    return PartitionSpec()


def shardings(tree, mesh: Mesh):
    """NamedShardings for every leaf of a parameter or train-state tree on `mesh`.

    A dimension split over "model" must be divisible by the axis size; otherwise a
    ValueError names the parameter.
    """
    model = mesh.shape["model"]

    def one(path, leaf):
        spec = partition_spec(path, leaf)
        for dim, axis in zip(leaf.shape, spec):
            if axis == "model" and dim % model:
                raise ValueError(f"{'/'.join(_names(path))} {tuple(leaf.shape)} is split over "
                                 f"model={model}, which must divide its size {dim}")
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over "data"."""
    return NamedSharding(mesh, PartitionSpec("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds whole, as a global array with `sharding`
    (each process supplies its own devices' shards)."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
