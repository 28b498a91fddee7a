"""Where the test suite's time goes: `pytest --suite-profile [--suite-profile-top 25]`.

For each test (its setup and teardown included): its wall time; the CPU time of its
process and of the processes it started (the command-line runs; counted as they end, so
a module fixture's runs count in the test that waits for them); the wall time jax spent
in its process tracing (jaxpr_trace), lowering (jaxpr to MLIR) and compiling (XLA's
backend compile), from jax.monitoring's events, and the number of programs it lowered.
Then the same per file, and the suite's totals. Under xdist (the suite's default) each
worker measures its own tests and hands them to the controller, which prints the tables
after the last test.

What is not jax's, in a test's own process, is running the programs, the test's own
Python and the rest. The `--durations` line counts wall time only, and a test that waits
for a child process or a timeout shows there as one that works."""

import collections
import resource
import time

import jax
import pytest

from tests.checks import LOWERED

# jax.monitoring's duration events, by the column they are added to
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    LOWERED: "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
JAX_COLUMNS = (*EVENTS.values(), "programs")


def pytest_addoption(parser):
    parser.addoption("--suite-profile", action="store_true",
                     help="print where the suite's time goes: CPU of each test's process and "
                          "of the processes it starts, jax's tracing, lowering and compiling")
    parser.addoption("--suite-profile-top", type=int, default=25,
                     help="--suite-profile: how many of the most expensive tests to list")


class _Profile:
    def __init__(self):
        self.totals = collections.Counter()   # event column -> seconds, this process
        self.tests: dict[str, dict] = {}       # nodeid -> column -> value
        self._start = {}
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def close(self):
        jax.monitoring.unregister_event_duration_listener(self._listen)

    def _listen(self, event, duration, **kwargs):
        column = EVENTS.get(event)
        if column is not None:
            self.totals[column] += duration
            if column == "lower":
                self.totals["programs"] += 1

    def _snapshot(self):
        own, children = (resource.getrusage(who) for who in
                         (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        return (time.perf_counter(), own.ru_utime + own.ru_stime,
                children.ru_utime + children.ru_stime, dict(self.totals))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid, location):
        self._start[nodeid] = self._snapshot()

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logfinish(self, nodeid, location):
        (wall0, cpu0, child0, jax0), (wall1, cpu1, child1, jax1) = (
            self._start.pop(nodeid), self._snapshot())
        row = {"wall": wall1 - wall0, "cpu": cpu1 - cpu0, "children": child1 - child0}
        row.update({column: jax1.get(column, 0) - jax0.get(column, 0)
                    for column in JAX_COLUMNS})
        self.tests[nodeid] = row

    def pytest_unconfigure(self, config):
        self.close()

    # xdist: a worker hands its rows to the controller ...
    def pytest_sessionfinish(self, session):
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput["suite_profile"] = self.tests

    # ... which receives them as the worker goes down.
    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        self.tests.update(getattr(node, "workeroutput", {}).get("suite_profile", {}))

    def pytest_terminal_summary(self, terminalreporter, config):
        if getattr(config, "workeroutput", None) is not None or not self.tests:
            return
        write = terminalreporter.write_line
        header = (f"{'wall s':>8} {'cpu s':>8} {'children':>8} {'trace':>7} {'lower':>7} "
                  f"{'compile':>7} {'programs':>8}")

        def line(row, name):
            return (f"{row['wall']:8.1f} {row['cpu']:8.1f} {row['children']:8.1f} "
                    f"{row['trace']:7.1f} {row['lower']:7.1f} {row['compile']:7.1f} "
                    f"{int(row['programs']):8d}  {name}")

        def cost(row):
            return row["cpu"] + row["children"]

        files = collections.defaultdict(collections.Counter)
        for nodeid, row in self.tests.items():
            files[nodeid.split("::")[0]].update(row)
        total = collections.Counter()
        for row in files.values():
            total.update(row)
        terminalreporter.section("suite_profile: where the time goes (seconds)")
        write("cpu: CPU seconds of the test's own process; children: of the processes it "
              "started; trace, lower, compile: jax's, in wall seconds; programs: how many "
              "it lowered")
        write(header + "  file")
        for name, row in sorted(files.items(), key=lambda item: -cost(item[1])):
            write(line(row, name))
        write(line(total, f"all {len(self.tests)} tests"))
        wall = total["wall"]
        if wall > 0:
            write(f"of the tests' {wall:.0f} s: jax tracing {total['trace'] / wall:.0%}, "
                  f"lowering {total['lower'] / wall:.0%}, compiling "
                  f"{total['compile'] / wall:.0%}; CPU: {total['cpu']:.0f} s in the tests' "
                  f"processes, {total['children']:.0f} s in the processes they started")
        top = config.getoption("--suite-profile-top")
        write("")
        write(header + f"  the {top} most expensive tests (cpu + children)")
        for nodeid, row in sorted(self.tests.items(), key=lambda item: -cost(item[1]))[:top]:
            write(line(row, nodeid))


def pytest_configure(config):
    if config.getoption("--suite-profile"):
        config.pluginmanager.register(_Profile(), "suite_profile_recorder")
