"""The plain options of one attention call: everything but q, k, v, the Mask and the
score spec. Written once here; every kernel reads the fields it needs."""

from typing import Any

from attnjax import _pytree


@_pytree.dataclass(data=("dropout_key",), meta=("dropout_rate", "return_weights",
                                                "return_residual", "block_q", "block_k"))
class Options:
    """dropout_rate: inverted dropout on the weights, with one key per head
    (`dropout_key`, laid out `[B|1, N|1]` like the Mask's arrays, a single key inside a
    kernel). return_weights / return_residual: also return the `[T, S]` weights (dense
    only) / the log-sum-exp `[T]`. block_q, block_k: the chunked kernel's blocks (None:
    its defaults)."""

    dropout_rate: float = 0.0
    return_weights: bool = False
    return_residual: bool = False
    block_q: int | None = None
    block_k: int | None = None
    dropout_key: Any = None
