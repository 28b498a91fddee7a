"""The API reference (mkdocs + mkdocstrings) builds offline from the docstrings with
warnings as errors, and lists the public names."""

import doctest
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnjax
from attnjax import nn

ROOT = Path(__file__).resolve().parents[1]


def test_the_api_reference_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocstrings", reason="the docs extra: pip install -e '.[docs]'")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    pages = {name: (tmp_path / "site" / name / "index.html").read_text()
             for name in ("attnjax", "nn")}
    functions = [n for n in attnjax.__all__
                 if callable(getattr(attnjax, n)) and n not in ("attention", "nn", "nnx")]
    for name in functions:
        assert f'id="attnjax.{name}"' in pages["attnjax"], name
    assert 'id="attnjax.core.attention"' in pages["attnjax"]
    for name in nn.__all__:
        assert f'id="attnjax.nn.{name}"' in pages["nn"], name


def _documented():
    """Every name of the API reference: (its qualified name, the object)."""
    from attnjax import masks, parallel, scores

    names = [("attnjax", n) for n in attnjax.__all__
             if callable(getattr(attnjax, n)) and not inspect.ismodule(getattr(attnjax, n))]
    names += [("attnjax.nn", n) for n in nn.__all__]
    names += [("attnjax.masks", n) for n in MASKS] + [("attnjax.scores", n) for n in SCORES]
    names += [("attnjax.parallel", n) for n in parallel.__all__]
    modules = {"attnjax": attnjax, "attnjax.nn": nn, "attnjax.masks": masks,
               "attnjax.scores": scores, "attnjax.parallel": parallel}
    return [(f"{module}.{n}", getattr(modules[module], n)) for module, n in names]


# the members the reference lists (docs/api/masks.md, scores.md)
MASKS = ("Mask", "everything", "causal", "window", "lengths", "segments", "prefix",
         "chunked_causal", "from_array", "from_fn", "causal_mask", "sliding_window_mask",
         "padding_mask", "query_key_mask", "combine_masks")
SCORES = ("scaled_dot_score", "dot_score", "general_score", "additive_score", "soft_cap",
          "alibi_slopes", "alibi", "relative_position_bucket", "relative_position_bias",
          "chain")


def test_the_reference_lists_the_members_these_tests_check():
    for page, members in (("masks", MASKS), ("scores", SCORES)):
        text = (ROOT / "docs" / "api" / f"{page}.md").read_text()
        listed = re.findall(r"^        - (\w+)$", text, flags=re.M)
        assert tuple(listed) == members


@pytest.mark.parametrize("name, obj", _documented(), ids=[n for n, _ in _documented()])
def test_every_public_name_has_a_one_line_summary_shapes_and_an_example(name, obj):
    doc = inspect.getdoc(obj)
    assert doc and "\n" not in doc.split("\n\n")[0], f"{name}: no one-line summary"
    assert re.search(r"\[[A-Za-z_][\w, ]*\]", doc), f"{name}: no shape in its docstring"
    assert "Examples:" in doc, f"{name}: no example"
    for example in doctest.DocTestParser().get_examples(doc):
        compile(example.source, name, "single")


# The examples of the top-level functions run here; the others take seconds each to run
# (modules compile), and the README's examples run the same calls.
RUN = [(name, obj) for name, obj in _documented() if name.count(".") == 1]


@pytest.mark.parametrize("name, obj", RUN, ids=[n for n, _ in RUN])
def test_the_examples_of_the_top_level_functions_run_as_written(name, obj):
    test = doctest.DocTestParser().get_doctest(inspect.getdoc(obj), {}, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = []
    runner.run(test, out=report.append)
    assert test.examples and not runner.failures, "".join(report)
