"""jaxtyping's run-time checks switched off, for the tests of attnjax's own messages."""

import contextlib

import jaxtyping


@contextlib.contextmanager
def own_checks_only():
    """attnjax's own checks and messages, as a user without runtime type checks meets
    them: jaxtyping's checks are off inside."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
