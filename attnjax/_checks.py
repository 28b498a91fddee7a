"""Argument checks shared by every layer.

Each raises `ValueError` (wrong shape or value) or `TypeError` (wrong dtype or kind) at
trace time, naming the argument, what was expected and what was given.
"""

import inspect
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_concrete_shape(name: str, x) -> None:
    """Symbolic dimensions (jax.export's shape polymorphism) refused by name: the
    kernels choose themselves, their blocks and their parts of the batch from the
    sizes (jax's own error had been "inconclusive" comparisons)."""
    if not all(isinstance(d, (int, np.integer)) for d in x.shape):
        raise ValueError(
            f"{name} must have concrete dimensions; got {shape_str(x.shape)}, symbolic "
            f"(jax.export's shape polymorphism): attnjax plans its kernels from the "
            f"sizes, so export a program for each shape")


def check_rank(name: str, x, ranks: Sequence[int], layout: str) -> None:
    if x.ndim not in ranks:
        raise ValueError(
            f"{name} must have rank {' or '.join(map(str, ranks))} ({layout}); "
            f"got shape {shape_str(x.shape)} (rank {x.ndim})"
        )


def check_arguments(name: str, fn, signature: str, count: int) -> None:
    """A TypeError naming fn unless it takes `count` positional arguments (where Python
    can tell: a callable without a signature to read passes)."""
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError as e:
        raise TypeError(f"{name} must take {count} positional arguments, {signature}; "
                        f"got {getattr(fn, '__name__', type(fn).__name__)}"
                        f"{inspect.signature(fn)} ({e})") from None
    except ValueError:   # no signature to read (a builtin)
        pass


def check_floating(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype; got {x.dtype}")


def check_same_dtype(**arrays) -> None:
    dtypes = {name: x.dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"{', '.join(dtypes)} must share one dtype; got {listed}")


def check_same_last_dim(name_a: str, a, name_b: str, b) -> None:
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(
            f"{name_a} and {name_b} must have the same head dim H (last axis); got "
            f"{name_a} {shape_str(a.shape)} and {name_b} {shape_str(b.shape)}"
        )


def check_param_shape(name: str, x, expected: Sequence[int], layout: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
            f"{name} must have shape {layout} = {shape_str(expected)}; "
            f"got {shape_str(x.shape)}"
        )


# The scales a call may use. Above MAX_SCALE the softmax of ordinary logits is already a
# hard argmax, and the scaled float16 queries (or float32 logits, further up) overflow to
# inf; below MIN_SCALE the scale rounds to 0 in float32 and every logit with it.
MAX_SCALE = 1e4
MIN_SCALE = float(np.finfo(np.float32).tiny)


def check_flag(name: str, value) -> None:
    """A switch of the call: a bool known when the call is traced (`is_causal="false"`
    would be true, and a traced one cannot choose the program)."""
    if not isinstance(value, (bool, np.bool_)):
        got = ("a traced value: under jax.jit, make it a static argument"
               if isinstance(value, jax.core.Tracer) else repr(value))
        raise TypeError(f"{name} must be a bool (True or False); got {got}")


def check_flags(**flags) -> None:
    """`check_flag` for each name=value that is not None (None: off)."""
    for name, value in flags.items():
        if value is not None:
            check_flag(name, value)


def check_sinks_init(use_sinks: bool, sinks_init, sinks_metadata=None) -> None:
    """The modules' sinks_init (and nnx's sinks_metadata): not callable, or given
    without use_sinks=True (where no sinks are made), is a mistake."""
    if sinks_init is not None and not callable(sinks_init):
        raise TypeError(f"sinks_init must be an initialiser, called as init(key, shape, "
                        f"dtype); got {sinks_init!r}")
    for name, value in (("sinks_init", sinks_init), ("sinks_metadata", sinks_metadata)):
        if value and not use_sinks:
            raise ValueError(f"{name} is for the sinks of use_sinks=True; got {name}="
                             f"{value!r} with use_sinks=False")


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool (what jax takes for a size)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def positive_int(name: str, value) -> int:
    """value, a Python or NumPy integer >= 1, as an int."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return int(value)


def outside(values, low, high):
    """The first of `values` (numpy, known) outside [low, high] — the lowest if any is
    below, else the highest — or None when all are inside (or there are none)."""
    if values.size == 0:
        return None
    lowest, highest = values.min(), values.max()
    if lowest < low:
        return lowest
    return highest if highest > high else None


def is_real_scalar(x) -> bool:
    """A 0-d array (jax, NumPy) of an integer or floating dtype, or such a number."""
    dtype = getattr(x, "dtype", None)
    return (dtype is not None and np.ndim(x) == 0 and dtype != bool
            and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)))


def _what(x) -> str:
    shape = getattr(x, "shape", None)
    return type(x).__name__ + ("" if shape is None else f" of shape {shape_str(shape)} "
                               f"and dtype {x.dtype}")


def resolve_scale(scale, head_dim: int) -> float:
    if scale is None:
        if head_dim == 0:
            raise ValueError("the head dim H must be positive to scale by 1/√H; got H=0")
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer):
        raise TypeError("scale must be a number known when the call is traced; got a traced "
                        "value (dot_product_attention takes one)")
    if is_real_scalar(scale) and not isinstance(scale, (int, float, np.number)):
        scale = scale.item()   # a 0-d jax or NumPy array: its number
    if not isinstance(scale, (int, float, np.floating, np.integer)) or isinstance(
            scale, (bool, np.bool_)):
        raise TypeError(f"scale must be a real number or a 0-d array of one; got "
                        f"{_what(scale)}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be positive and finite; got {scale}")
    if not MIN_SCALE <= scale <= MAX_SCALE:
        raise ValueError(f"scale must lie in [{MIN_SCALE:.3g}, {MAX_SCALE:g}] (beyond, the "
                         f"logits round to 0 or overflow); got {scale:g}")
    return float(scale)


def check_mask(name: str, mask, target: Sequence[int], layout: str) -> None:
    """A boolean mask broadcastable to `target` (True = may attend)."""
    if not hasattr(mask, "dtype"):
        raise TypeError(f"{name} must be a boolean array; got {type(mask).__name__}")
    if mask.dtype != jnp.bool_:
        # A float mask is most often flax's 0/1 (make_attention_mask): as bias it would
        # add 0 or 1 to the logits and hide nothing.
        hint = (" (a 0/1 mask such as flax's make_attention_mask is mask != 0; additive "
                "float values belong in bias=)") if jnp.issubdtype(mask.dtype, jnp.floating) else ""
        raise TypeError(
            f"{name} must be boolean (True = may attend); got dtype {mask.dtype}{hint}"
        )
    check_broadcastable(name, mask, target, layout)


def nonzero_attends(name: str, mask):
    """A flax-style mask as bool: nonzero attends (0/1, as flax's make_attention_mask
    gives). Known negative values are a ValueError: an additive mask (0 attends, −inf
    or −1e9 hides) would attend where it hides."""
    if mask.dtype == jnp.bool_:
        return mask
    negative = None if isinstance(mask, jax.core.Tracer) else outside(
        np.asarray(mask), 0, np.inf)
    if negative is not None:
        raise ValueError(f"{name} is flax's: bool, or float/int where nonzero attends (0/1, "
                         f"as nn.make_attention_mask gives); got {negative}: an additive "
                         f"mask goes in bias= instead")
    return mask != 0


def check_bias(name: str, bias, target: Sequence[int], layout: str) -> None:
    """A floating array broadcastable to `target`. Known values (outside jit) must be
    finite or -inf (masked): NaN or +inf would make every weight of their row NaN."""
    if not hasattr(bias, "dtype") or not jnp.issubdtype(bias.dtype, jnp.floating):
        got = getattr(bias, "dtype", type(bias).__name__)
        hint = {"b": ": a bool array is a mask (mask=)",
                "i": f": cast it ({name}.astype(jnp.float32))",
                "u": f": cast it ({name}.astype(jnp.float32))"}.get(
                    getattr(getattr(bias, "dtype", None), "kind", None), "")
        raise TypeError(f"{name} must be a floating array (additive logits); got {got}{hint}")
    check_broadcastable(name, bias, target, layout)
    check_finite_or_minus_inf(name, bias, "masked")


def check_finite_or_minus_inf(name: str, x, minus_inf: str | None) -> None:
    """Known values (outside jit) of a float array are finite or -inf (which means
    `minus_inf`; None: finite only): NaN or +inf would make every weight of their row
    NaN. Values held by other processes are not read."""
    if not isinstance(x, jax.core.Tracer) and getattr(x, "is_fully_addressable", True):
        # float32 on the host: numpy has no bfloat16 comparisons of its own
        values = np.asarray(x, np.float32 if x.dtype.itemsize < 4 else x.dtype)
        bad = np.isnan(values) | (values == np.inf)
        if minus_inf is None:
            bad |= values == -np.inf
        if bad.any():
            allowed = "finite" if minus_inf is None else f"finite or -inf ({minus_inf})"
            raise ValueError(f"{name} must be {allowed}; got {values[bad].flat[0]} at "
                             f"index {np.argwhere(bad)[0].tolist()}")


def check_broadcastable(name: str, x, target: Sequence[int], layout: str) -> None:
    ok = x.ndim <= len(target) and all(
        d in (1, t) for d, t in zip(x.shape[::-1], target[::-1])
    )
    if not ok:
        raise ValueError(
            f"{name} must be broadcastable to {layout} = {shape_str(target)}; "
            f"got {shape_str(x.shape)}"
        )


def check_lengths(name: str, lengths, expected_shape: Sequence[int], layout: str) -> None:
    if not hasattr(lengths, "dtype"):
        raise TypeError(f"{name} must be an integer array {layout}; got {type(lengths).__name__}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype; got {lengths.dtype}")
    if tuple(lengths.shape) != tuple(expected_shape):
        raise ValueError(
            f"{name} must have shape {layout} = {shape_str(expected_shape)}; "
            f"got {shape_str(lengths.shape)}"
        )


# A window side this wide or wider is unbounded: positions are int32, and a wider size
# would overflow their arithmetic (or not fit an int32 at all).
WINDOW_UNBOUNDED = 2**31 - 1


def _window_side(w) -> int | None:
    """An int, a NumPy integer, or a concrete integer array of one element (jnp.array(2),
    as jax.nn takes) as an int; None for anything else."""
    if isinstance(w, bool) or isinstance(w, jax.core.Tracer):
        return None
    if isinstance(w, (int, np.integer)):
        return int(w)
    if (isinstance(w, (np.ndarray, jax.Array)) and w.shape == ()
            and np.issubdtype(w.dtype, np.integer)):
        return int(w)
    return None


def resolve_window(window) -> tuple[int, int] | None:
    """`window` as (left, right), each at most WINDOW_UNBOUNDED (a wider side is as
    unbounded); an int w means (w, w). A side may be negative (left + right >= 0)."""
    if window is None:
        return None
    if _window_side(window) is not None:
        window = (window, window)
    sides = (tuple(map(_window_side, window)) if isinstance(window, (tuple, list))
             and len(window) == 2 else None)
    if sides is None or None in sides:
        if any(isinstance(w, jax.core.Tracer) for w in
               (window if isinstance(window, (tuple, list)) else (window,))):
            raise TypeError(f"window sizes must be known when the call is traced (ints, "
                            f"which decide the kernel's blocks); got {window!r}")
        raise TypeError(f"window must be an int or a pair of ints (left, right); got {window!r}")
    left, right = sides
    # a negative side is a window off the query's own position, as in jax.nn: (2, -1) is
    # the two keys before it; a window of no width sees nothing
    if left + right < 0:
        raise ValueError(f"window (left, right) = ({left}, {right}) holds no key: query i sees "
                         f"keys i - left .. i + right, so left + right must be >= 0")
    return (max(min(left, WINDOW_UNBOUNDED), -WINDOW_UNBOUNDED),
            max(min(right, WINDOW_UNBOUNDED), -WINDOW_UNBOUNDED))


def check_dropout_rate(rate, *, module: bool = False) -> float:
    """A dropout rate in [0, 1); a module's may be 1 (flax's modules take it), as long
    as the module runs deterministic (`check_module_dropout`)."""
    if not isinstance(rate, (int, float, np.floating, np.integer)) or isinstance(rate, bool):
        raise TypeError(f"dropout_rate must be a Python number; got {type(rate).__name__}")
    if not (0.0 <= rate <= 1.0 if module else 0.0 <= rate < 1.0):
        raise ValueError(f"dropout_rate must lie in {'[0, 1]' if module else '[0, 1)'}; "
                         f"got {rate}")
    return float(rate)


def check_module_dropout(rate: float) -> float:
    """The rate of a module about to drop weights (not deterministic)."""
    if rate == 1.0:
        raise ValueError("dropout_rate=1.0 drops every attention weight: a module with it "
                         "runs only with deterministic=True")
    return rate


def check_dropout(rate, rng) -> float:
    rate = check_dropout_rate(rate)
    if rate > 0.0 and rng is None:
        raise ValueError(f"dropout_rate={rate} needs a dropout_rng (a jax.random key); got None")
    if rate > 0.0:
        check_key("dropout_rng", rng)
    return float(rate)


def check_key(name: str, key) -> None:
    """A TypeError unless key is one jax.random key: a typed key of shape (), or raw
    key data, uint32 of rank 1 (`jax.random.PRNGKey`'s)."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    if typed and shape == ():
        return
    if not typed and dtype == np.uint32 and shape is not None and len(shape) == 1:
        return
    got = (f"{type(key).__name__} {key!r}" if dtype is None
           else f"{'keys' if typed else dtype} of shape {shape_str(shape)}")
    raise TypeError(f"{name} must be one jax.random key (jax.random.key(seed), or "
                    f"jax.random.PRNGKey(seed)'s uint32 data); got {got}")


def resolve_block_sizes(block_sizes) -> tuple[int, int]:
    ok = (
        isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2
        and all(is_int(b) and b > 0 for b in block_sizes)
    )
    if not ok:
        raise ValueError(f"block_sizes must be a pair of positive ints (block_q, block_k); "
                         f"got {block_sizes!r}")
    return int(block_sizes[0]), int(block_sizes[1])


def as_array(name: str, x, required: bool = False):
    """A list, tuple (of numbers or jax values, traced too) or Python number (a bool
    too: `mask=True`) as an array; anything else as given (its checks name what is
    wrong). required: x (query, key or value) must become an array, whatever it is."""
    if required or isinstance(x, (list, tuple, int, float)):
        try:
            return jnp.asarray(x)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be an array, or a list of numbers of one shape; "
                            f"got {type(x).__name__} {str(x)[:60]}") from None
    return x
