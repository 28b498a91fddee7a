"""The README's examples run, and the public docstrings document every argument."""

import inspect
import pathlib
import re

import pytest

import attnjax

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_a_functional_api_example():
    assert any("attnjax.dot_product_attention" in block for block in _python_blocks())


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_block_runs(index, own_compiled_programs):
    # The blocks run eagerly, as a reader pastes them: each compiles hundreds of
    # one-operation programs of its own, dropped when it ends.
    exec(compile(_python_blocks()[index], f"README.md block {index}", "exec"), {})


def test_readme_quick_start_trains_then_tests_as_ci_does():
    ci = (README.parent / ".ci" / "run").read_text()
    quick_start = re.search(r"## Quick start.*?```bash\n(.*?)\n```", README.read_text(), re.S)
    assert quick_start is not None
    train, test = quick_start.group(1).strip().splitlines()
    assert train == 'pip install -e ".[dev]" && python train_toy.py'
    assert test == 'pip install -e ".[dev,docs]" && pytest'
    assert test in ci
    assert (README.parent / "configs" / "copy.yaml").exists()   # train_toy.py's default


def _documented_args(fn):
    doc = inspect.getdoc(fn)
    args = doc.split("Args:")[1].split("Returns:")[0]
    return dict(re.findall(r"^  (\*{0,2}\w+): (.*?)(?=^  \S|\Z)", args, flags=re.M | re.S))


@pytest.mark.parametrize("fn", [
    attnjax.dot_product_attention, attnjax.attention, attnjax.attention_weights,
    attnjax.multi_head_attention, attnjax.init_multi_head_attention, attnjax.score_attention,
])
def test_every_argument_is_documented(fn):
    documented = _documented_args(fn)
    for name, param in inspect.signature(fn).parameters.items():
        key = "**" + name if param.kind is param.VAR_KEYWORD else name
        assert key in documented, f"{fn.__name__}: argument {name} is not documented"


def test_dot_product_attention_documents_each_array_shape():
    documented = _documented_args(attnjax.dot_product_attention)
    for name in ("query", "key", "value", "bias", "mask", "query_lengths", "key_lengths"):
        assert re.search(r"`\[[A-Z, ]*\]`", documented[name]), f"{name} has no shape"
    assert "[B, N, T, S]" in documented["return_weights"]
