"""jaxtyping's run-time checks switched off, for the tests of attnjax's own messages; how
many programs a call lowers."""

import contextlib

import jax
import jaxtyping

# jax.monitoring's event for each program lowered (then compiled, or loaded from a cache)
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@contextlib.contextmanager
def own_checks_only():
    """attnjax's own checks and messages, as a user without runtime type checks meets
    them: jaxtyping's checks are off inside."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def lowerings(fn) -> int:
    """How many programs calling fn lowers (compiled, or loaded from a compilation
    cache)."""
    lowered = []

    def listener(event, duration, **kwargs):
        if event == LOWERED:
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(lowered)
