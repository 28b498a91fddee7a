"""Meshes and the Megatron layout of the Transformer's parameters.

A mesh always has the axes "data", "model" and "seq" (size 1 when unused): batches are
split over "data"; attention and feed-forward parameters over "model" — the query, key
and value kernels and the output kernel by heads, the feed-forward input kernel by
output units and its output kernel by input units — so each device holds 1/M of every
large matrix and XLA's SPMD partitioner inserts the collectives; sequences over "seq"
(context parallelism, `attnjax.parallel.context`: attention runs as a ring over it,
everything else where its tokens are). The optimiser state follows the parameters it
belongs to (its leaves have the same paths); parameters are whole on every "seq" device.
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from attnjax import _checks

AXES = ("data", "model", "seq")

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
    """"data=2,seq=2" -> {"data": 2, "seq": 2}."""
    shape = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        name = name.strip()
        size = size.strip()
        # isdecimal, not isdigit: '²' is a digit that int() refuses
        if not sep or name not in AXES or not (size.isascii() and size.isdecimal()) \
                or int(size) < 1:
            raise ValueError(f"--mesh expects axis=size pairs over {AXES}, e.g. data=2,model=2 "
                             f"or data=2,seq=2; got {text!r}")
        if name in shape:
            raise ValueError(f"--mesh names axis {name!r} twice; got {text!r}")
        shape[name] = int(size)
    return shape


def _more_devices_hint(count: int) -> str:
    """How to get `count` devices: on a CPU, XLA emulates them."""
    if jax.default_backend() != "cpu":
        return f" ({jax.default_backend()} devices visible to this process)"
    return (f" (on a CPU, emulate them: set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{count} before the program starts)")


def make_mesh(shape: dict[str, int] | None = None, devices=None) -> Mesh:
    """A ("data", "model", "seq") mesh over `devices` (default: all); by default all on
    "data". A mesh smaller than the devices takes the first of them, when its size
    divides their number (in one process: with several, every process takes part)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = {"data": len(devices)} if shape is None else dict(shape)
    for axis, count in shape.items():
        if axis not in AXES:
            raise ValueError(f"make_mesh's axes are {AXES}; got an axis {axis!r} in {shape}")
        if not (_checks.is_int(count) and count >= 1):
            raise ValueError(f"make_mesh's axis sizes must be positive ints; got {axis}="
                             f"{count!r}")
    sizes = tuple(shape.get(axis, 1) for axis in AXES)
    size = math.prod(sizes)
    if size < len(devices) and jax.process_count() > 1:
        raise ValueError(f"the mesh {shape} needs {size} devices; there are {len(devices)} "
                         f"across {jax.process_count()} processes, and with several processes "
                         f"the mesh takes every device")
    if len(devices) % size and size < len(devices):
        divisors = [d for d in range(1, len(devices) + 1) if len(devices) % d == 0]
        raise ValueError(f"the mesh {shape} needs {size} devices; there are {len(devices)}, "
                         f"and a mesh takes a number of them that divides theirs: "
                         f"{', '.join(map(str, divisors[:-1]))} or {divisors[-1]}")
    if len(devices) % size:
        raise ValueError(f"the mesh {shape} needs {size} devices; there are "
                         f"{len(devices)}{_more_devices_hint(size)}")
    return Mesh(np.asarray(devices[:size]).reshape(sizes), AXES)


def _names(path) -> tuple[str, ...]:
    """The names along a tree path; an nnx State's leaf (a Variable's "value") is named
    by the path to its Variable, as the linen tree's is."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
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
    if "model" not in mesh.shape:
        raise ValueError(f"shardings needs a mesh with the axis 'model' (make_mesh's "
                         f"{AXES}); got a mesh of axes {tuple(mesh.axis_names)}")
    model = mesh.shape["model"]

    def one(path, leaf):
        spec = partition_spec(path, leaf)
        for dim, axis in zip(leaf.shape, spec):
            if axis == "model" and dim % model:
                raise ValueError(f"{'/'.join(_names(path))} {tuple(leaf.shape)} is split over "
                                 f"model={model}, which must divide its size {dim}")
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Leading (batch) axis split over "data"; for `[B, L, ...]` arrays (ndim ≥ 2) the
    sequence axis too, over "seq"."""
    return NamedSharding(mesh, PartitionSpec("data", "seq") if ndim >= 2 else
                         PartitionSpec("data"))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds whole, as a global array with `sharding`
    (each process supplies its own devices' shards)."""
    array = np.asarray(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
