"""Mapping a function of one head over the batch and the heads.

Queries are grouped as `[B, T, K, G, H]`: N = K·G query heads over K key/value heads.
Each argument of a mapped function has one of three layouts:

  "rows"   `[B, L, K, G, ...]`   queries, outputs: a length axis before the heads
  "kv"     `[B, L, K, ...]`      keys and values, shared by the G heads of a group
  "heads"  `[B|1, K|1, G|1, ...]` per-call arrays (a bound Mask's, a Score's, Options'),
                                 heads first; a unit axis is shared by every head

`group` lays `[B|1, N|1, ...]` arrays out as "heads"; `over_heads` maps a one-head
function over B, K and G so that each head gets its own slice of every argument;
`in_parts` runs a mapped function on consecutive parts of the batch.

Where the batch or the heads are sharded in their types (a mesh of Explicit axes),
`explicit_spec`, `sharding`, `reshard` and `take_rows` keep the shardings jax asks for
(the kernels', the projections', the models' lookups and the KV cache's).
"""

import jax
import jax.numpy as jnp
from jax import lax

# layout -> the axis holding B, K and G, each after the ones before it are removed
_AXES = {"rows": (0, 1, 1), "kv": (0, 1, None), "heads": (0, 0, 0)}


def group(tree, num_heads: int, num_kv_heads: int):
    """Every leaf `[B|1, N|1, ...]` of `tree` as `[B|1, K|1, G|1, ...]` (N = K·G)."""
    def one(x):
        heads = ((num_kv_heads, num_heads // num_kv_heads)
                 if x.shape[1] == num_heads and num_heads > 1 else (1, 1))
        return x.reshape(x.shape[:1] + heads + x.shape[2:])
    return jax.tree.map(one, tree)


def over_heads(fn, sizes: tuple[int, int, int], in_layouts: tuple, out_layouts: tuple):
    """`fn(*args)` of one head, mapped over (B, K, G) = `sizes`.

    in_layouts names each argument's layout (None: not mapped); fn returns a tuple laid
    out as out_layouts ("rows" or "heads"; a None output stays None). A unit axis is
    indexed away and re-inserted instead of vmapped, which keeps unit dims out of every
    intermediate (XLA otherwise copies whole blocks of logits to move them).
    """
    mapped = fn
    for level in (2, 1, 0):  # G innermost, then K, then B
        mapped = _map_level(mapped, sizes[level],
                            [None if lay is None else _AXES[lay][level] for lay in in_layouts],
                            [_AXES[lay][level] for lay in out_layouts])
    return mapped


def _map_level(fn, size: int, in_axes: list, out_axes: list):
    def mapped(*args):
        leaf_axes, squeezed = [], []
        for arg, axis in zip(args, in_axes):
            if axis is None:
                leaf_axes.append(None)
                squeezed.append(arg)
                continue
            # Mapped where the leaf has this axis whole; a unit axis is shared.
            whole = lambda x, axis=axis: size > 1 and x.shape[axis] == size  # noqa: E731
            leaf_axes.append(jax.tree.map(lambda x, w=whole, a=axis: a if w(x) else None, arg))
            squeezed.append(jax.tree.map(
                lambda x, w=whole, a=axis: x if w(x) else lax.squeeze(x, (a,)), arg))
        if size > 1:
            squeezed = _sharded_alike(squeezed, leaf_axes)
            return jax.vmap(fn, in_axes=tuple(leaf_axes), out_axes=tuple(out_axes))(*squeezed)
        outs = fn(*squeezed)
        return tuple(jax.tree.map(lambda x, a=axis: jnp.expand_dims(x, a), out)
                     for out, axis in zip(outs, out_axes))

    return mapped


def is_explicit(sharding) -> bool:
    """Whether a sharding is on a mesh with Explicit axes (jax.sharding.AxisType, the
    default of jax.make_mesh under jax.set_mesh), where shardings are part of types."""
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return jax.sharding.AxisType.Explicit in types


def explicit_spec(x):
    """x's PartitionSpec where a mesh with Explicit axes shards it in its type; else
    None."""
    sharding = jax.typeof(x).sharding
    return sharding.spec if is_explicit(sharding) else None


def sharding(entries, like):
    """PartitionSpec(*entries) on the mesh of `like`'s type: a sharding, not the bare
    spec, which only jax.set_mesh resolves (arrays put on a mesh of Explicit axes
    outside it run too, as jax.nn's do)."""
    if isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer):
        mesh = like.sharding.mesh       # a concrete array's devices (an eager call)
    else:
        mesh = jax.typeof(like).sharding.mesh
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*entries))


def reshard(x, entries, like=None):
    """x resharded to PartitionSpec(*entries) on the mesh of `like` (default x)."""
    return jax.sharding.reshard(x, sharding(entries, x if like is None else like))


def on_mesh_of(x, ref):
    """x, made without a mesh in its type, replicated on ref's mesh of Explicit axes
    (where ref is on one): an operation of both then has one mesh to shard its result
    on."""
    if explicit_spec(x) is not None or explicit_spec(ref) is None:
        return x
    return reshard(x, (None,) * x.ndim, ref)


def batch_sharded_as(like, tree):
    """`(like, tree)` with every leaf of tree `[B, ...]` sharded on its batch axis as
    like `[B, ...]` is, where either is sharded in its type (a mesh of Explicit axes):
    the arrays of one call mapped or carried together over the batch need one sharding
    of it (jax's vmap, the chunked kernel's loops). like, made without the mesh in its
    type beside leaves on it, joins the mesh replicated. Leaves of another leading size
    (a unit axis, shared) are left as they are."""
    spec = explicit_spec(like)
    if spec is None:
        ref = next((x for x in jax.tree.leaves(tree) if explicit_spec(x) is not None), None)
        if ref is None:
            return like, tree
        like, spec = on_mesh_of(like, ref), ()
    want = tuple(spec)[0] if spec else None
    batch = like.shape[0]

    def one(x):
        if getattr(x, "ndim", 0) == 0 or x.shape[0] != batch:
            return x
        own = explicit_spec(x)
        entries = list(own or ()) + [None] * (x.ndim - len(own or ()))
        if own is not None and entries[0] == want:
            return x
        entries[0] = want
        return reshard(x, entries, like)

    return like, jax.tree.map(one, tree)


def past_heads_whole(tree):
    """Every leaf of tree laid out as "heads", `[B|1, N|1, ...]`, whole past its first
    two axes where it is split there in its type (a mesh of Explicit axes): a bound
    Mask's, a Score's arrays, read per query and key (segment ids split along the
    sequence: their comparison of queries with keys would be split twice on one axis)."""
    def one(x):
        spec = explicit_spec(x) if getattr(x, "ndim", 0) > 2 else None
        if spec is None or not any(tuple(spec)[2:]):
            return x
        return reshard(x, tuple(spec)[:2] + (None,) * (x.ndim - min(2, len(spec))))

    return jax.tree.map(one, tree)


def take_rows(table, ids, mode=None):
    """`jnp.take(table, ids, axis=0, mode=mode)`: rows of table `[V, ...]` for int ids
    `[...]`. Where ids are sharded in their type (a mesh of Explicit axes), the rows go
    sharded as the ids (jax cannot tell how else: a ShardingTypeError)."""
    spec = explicit_spec(ids)
    if spec is None:
        return jnp.take(table, ids, axis=0, mode=mode)
    entries = tuple(spec) + (None,) * (ids.ndim - len(spec) + table.ndim - 1)
    return table.at[ids].get(mode=mode, out_sharding=sharding(entries, ids))


def _sharded_alike(args, leaf_axes):
    """args with every mapped axis sharded as that of the first mapped leaf whose type
    holds a mesh of Explicit axes: vmap needs it where shardings are part of the types
    (a per-example length or index made without a sharding, beside a query whose batch
    axis is sharded, is resharded to match)."""
    pairs = []   # (leaf, its mapped axis), matched by structure (a field of None is no leaf)
    for arg, axes in zip(args, leaf_axes):
        if axes is not None:
            jax.tree.map(lambda leaf, axis: axis is None or pairs.append((leaf, axis)), arg, axes)
    on_mesh = [(leaf, tuple(spec)[axis] if axis < len(spec) else None)
               for (leaf, axis), spec in zip(pairs, (explicit_spec(leaf) for leaf, _ in pairs))
               if spec is not None]
    if not on_mesh:
        return args
    ref, want = on_mesh[0]

    def align(x, axis):
        if axis is None:
            return x
        # an array without the mesh in its type (made before jax.set_mesh, a constant)
        # is replicated: it may be resharded all the same
        spec = explicit_spec(x) or ()
        entries = list(spec) + [None] * (x.ndim - len(spec))
        if entries[axis] == want:
            return x
        entries[axis] = want
        return reshard(x, entries, ref)

    return [arg if axes is None else jax.tree.map(align, arg, axes)
            for arg, axes in zip(args, leaf_axes)]


def in_parts(mapped, batch: int, parts: int):
    """`mapped(size)(*args)`, a function mapped over a batch of `size` whose outputs are
    laid out batch first, run on `parts` consecutive slices of the batch, one after
    another in the program, and concatenated.

    Each argument leaf whose leading axis is the batch is sliced; a unit (shared)
    leading axis is passed whole. The parts are independent computations, which XLA's
    CPU runtime runs side by side, each on intermediates `parts` times smaller.
    """
    if parts <= 1:
        return mapped(batch)
    bounds = [batch * i // parts for i in range(parts + 1)]

    def cut(x):
        """Leaf x cut into the parts of the batch (x itself, for each part, where its
        leading axis is not the batch but a shared unit axis)."""
        if x.shape[0] != batch:
            return [x] * parts
        # The derivative of slices adds up a padded copy of each part's cotangent, which
        # XLA fuses with what follows; a split's is one concatenation. In half precision
        # each of those additions rounds through float32, so these leaves are split: a
        # bfloat16 training step of the dense kernel at (B, T, N, H) = (8, 100, 8, 64), 4
        # parts, 2.1-2.7x as fast. In float32 the slices are faster: one attention layer's
        # training step at (32, 64, 4, 32) (benchmarks/train_step.py's smallest) 1.21-1.23x
        # flax's speed with them, 1.10-1.14x split (2-core CPU).
        if x.dtype in (jnp.float16, jnp.bfloat16):
            return jnp.split(x, bounds[1:-1])
        return [x[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]

    def run(*args):
        leaves, tree = jax.tree.flatten(args)
        cuts = [cut(x) for x in leaves]
        outs = [mapped(hi - lo)(*jax.tree.unflatten(tree, [parts_of[i] for parts_of in cuts]))
                for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return tuple(None if first is None else jnp.concatenate([o[i] for o in outs])
                     for i, first in enumerate(outs[0]))

    return run
