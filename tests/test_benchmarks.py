"""The benchmark scripts' command lines: a mistake is one line and exit status 2, found
before any timing starts, and Ctrl-C one line and 130 (not a traceback)."""

import subprocess
import sys

import pytest

from tests.children import environment
from tests.test_faults import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import _timing  # noqa: E402


def _mistake(tmp_path, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=tmp_path,
                          env=environment(None), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script, args, message", [
    # each had run (part of) its timings first, then ended in a traceback, or printed
    # nonsense (0 tokens/s, an empty table) and exit 0
    ("benchmarks/attention.py", ["--sizes", "100"], "argument --sizes: must be a multiple "
                                                    "of 8; got 100"),
    ("benchmarks/ring.py", ["--length", "100"], "argument --length: must be a multiple of 8"),
    ("benchmarks/decode.py", ["--tokens", "0"], "argument --tokens: must be a positive int; "
                                                "got 0"),
    ("benchmarks/train_step.py", ["--max-length", "10"], "argument --max-length: the "
                                                         "shortest shape has T = 64; got 10"),
    ("benchmarks/sweep.py", ["--repeats", "-1"], "argument --repeats: must be a positive "
                                                 "int; got -1"),
    # the full GPU run on a CPU ran for hours
    ("benchmarks/gpu.py", [], "the full run needs a GPU"),
    # found after part (a)'s minutes
    ("experiments/scaling.py", ["--head-dims", "48"], "argument --head-dims: each must "
                                                      "divide --d-model=256; got 48"),
    ("experiments/scaling.py", ["--tasks", "rot13"], "argument --tasks: task.name must be "
                                                     "one of"),
])
def test_a_benchmark_mistake_is_one_line_and_exit_2(tmp_path, script, args, message):
    result = _mistake(tmp_path, script, *args)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr[-3000:]


def test_toy_tasks_refuses_a_workdir_that_holds_a_run(tmp_path):
    """A run directory already there was resumed, or only evaluated, and its time
    reported as a run from scratch: "met" in half the time."""
    (tmp_path / "runs" / "copy").mkdir(parents=True)
    result = _mistake(tmp_path, "benchmarks/toy_tasks.py", "--configs", "copy", "--workdir",
                      str(tmp_path / "runs"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"toy_tasks.py: error: argument --workdir: {tmp_path / 'runs' / 'copy'} exists; the "
        f"figures are of runs from scratch: give a new directory (see --help)"]


def test_ctrl_c_ends_a_benchmark_in_one_line(capsys):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        _timing.run(interrupted)
    assert exit_.value.code == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_median_times_refuses_no_repeats():
    """(statistics.median of nothing: a StatisticsError at the end of a run)"""
    with pytest.raises(ValueError, match=r"repeats >= 1 and warmup >= 0; got 0, 3"):
        _timing.median_times({"f": lambda: None}, (), repeats=0)
