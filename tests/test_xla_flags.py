"""The suite's XLA flags (tests/xla_flags.py): a flag the installed XLA does not know is
left out, where it would end every process of the run before its first test."""

from tests import xla_flags

KNOWN = "--xla_backend_optimization_level=0"
UNKNOWN = "--xla_attnjax_no_such_flag=1"


def test_xla_ends_a_process_given_a_flag_it_does_not_know():
    run = xla_flags.start_backend([UNKNOWN], timeout=120)
    assert run.returncode != 0
    assert "Unknown flag in XLA_FLAGS" in run.stderr


def test_a_flag_xla_does_not_know_is_left_out_and_the_others_kept():
    assert xla_flags.known([KNOWN, UNKNOWN]) == [KNOWN]
    assert xla_flags.known([KNOWN]) == [KNOWN]
