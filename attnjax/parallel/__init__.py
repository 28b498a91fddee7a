"""Beyond one device (layer 8): meshes, sharded training, ring attention.

  mesh      make_mesh ("data", "model", "seq"), the Megatron parameter layout, global
            batches
  ring      ring_attention (inside shard_map) on the same Mask as every kernel,
            ring_self_attention on a mesh (segment ids, positions), zigzag
  context   context parallelism: a batch laid out once in the zig-zag layout over
            "seq" (lay_out), and ring_engine, a model's attention as the ring
"""

from attnjax.parallel.ring import ring_attention, ring_self_attention, unzigzag, zigzag

__all__ = ["ring_attention", "ring_self_attention", "unzigzag", "zigzag"]
