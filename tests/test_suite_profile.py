"""The suite's profiler (`pytest --suite-profile`, tests/suite_profile.py) counts what a
test compiles and what its child processes spend, and its xdist workers' rows reach the
controller."""

import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

from tests.suite_profile import _Profile


def test_a_test_that_compiles_and_starts_a_process_is_counted(rng, request):
    profile = _Profile()
    request.addfinalizer(profile.close)
    # a program no other test compiles: a shape drawn at random
    size = int(jax.random.randint(rng, (), 1000, 100_000))
    profile.pytest_runtest_logstart("t::compiles", None)
    out = jax.jit(lambda x: jnp.sin(x) * 3.0 + x.sum())(np.ones(size, np.float32))
    subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], check=True)
    profile.pytest_runtest_logfinish("t::compiles", None)
    profile.pytest_runtest_logstart("t::idle", None)
    profile.pytest_runtest_logfinish("t::idle", None)
    assert out.shape == (size,)
    compiles, idle = profile.tests["t::compiles"], profile.tests["t::idle"]
    assert compiles["programs"] >= 1 and compiles["trace"] > 0 and compiles["compile"] > 0
    assert compiles["children"] > 0.01 and compiles["wall"] >= compiles["compile"]
    assert idle["programs"] == 0 and idle["compile"] == 0 and idle["children"] == 0


def test_worker_rows_reach_the_controller(request):
    worker, controller = _Profile(), _Profile()
    for profile in (worker, controller):
        request.addfinalizer(profile.close)
    worker.tests["t::a"] = {"wall": 1.0, "cpu": 0.5, "children": 0.0, "trace": 0.1,
                            "lower": 0.1, "compile": 0.2, "programs": 3}
    config = types.SimpleNamespace(workeroutput={})
    worker.pytest_sessionfinish(types.SimpleNamespace(config=config))
    controller.pytest_testnodedown(types.SimpleNamespace(workeroutput=config.workeroutput), None)
    assert controller.tests == worker.tests
