"""What a new user meets first, in process: models that take `deterministic` as flax
does, padded batches, dtypes by name or type; errors that name the axis or key and say
what to do; readable signatures; plots with colour bars, labels and every line visible;
and a run's config that may only grow its steps. The installed command is checked in
tests/test_cli_installed.py."""

import dataclasses
import functools
import inspect
import pydoc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax import nn
from attnjax.parallel import mesh as mesh_lib
from attnjax.toy import cli
from attnjax.toy.config import ConfigError, dump_config, load_config
from attnjax.toy.report import attention_figure, curves_figure, scalar_tag
from tests import draws
from tests.trees import perturbed

TINY = ["task.num_symbols=5", "task.max_len=6", "model.d_model=16", "model.num_heads=2",
        "model.d_ff=32", "model.num_encoder_layers=1", "model.num_decoder_layers=1",
        "model.max_len=16", "steps=20", "log_every=5", "eval_every=10",
        "checkpoint_every=10"]


def _lm(rng, dropout_rate=0.0):
    config = nn.DecoderOnlyConfig(vocab_size=11, d_model=16, num_heads=2, num_kv_heads=1,
                                  num_layers=1, d_ff=24, max_len=24, dropout_rate=dropout_rate)
    model = nn.DecoderOnly(config)
    params = jax.jit(model.init)(rng, jnp.ones((1, 6), jnp.int32))["params"]
    # larger than the initial weights, so that logits differ clearly between tokens
    return model, perturbed(params, jax.random.fold_in(rng, 1), 0.5)


# --- models: deterministic as in flax -----------------------------------------------------


@functools.partial(jax.jit, static_argnames=("model", "deterministic"))
def _apply(model, params, tokens, key=None, *, deterministic=None, padding_mask=None):
    """model.apply, compiled once per model and shapes (eager flax is slow)."""
    return model.apply({"params": params}, tokens, padding_mask=padding_mask,
                       deterministic=deterministic,
                       rngs=None if key is None else {"dropout": key})


def test_a_model_with_dropout_needs_deterministic_and_applies_dropout_when_false(rng):
    model, params = _lm(rng, dropout_rate=0.3)
    tokens = draws.randint(rng, (2, 6), 1, 11)
    with pytest.raises(ValueError, match=r"DecoderOnly has dropout \(dropout_rate=0.3.*"
                                         r"deterministic is required: False to train"):
        _apply(model, params, tokens)
    evaluation = _apply(model, params, tokens, deterministic=True)
    key = jax.random.fold_in(rng, 2)
    trained = _apply(model, params, tokens, key, deterministic=False)
    assert not np.allclose(trained, evaluation)
    # the constructor's field, flax's other place for it: the same computation
    def traced(module, **kw):
        return str(jax.make_jaxpr(lambda p, k: module.apply(
            {"params": p}, tokens, rngs={"dropout": k}, **kw))(params, key))

    assert traced(model.clone(deterministic=False)) == traced(model, deterministic=False)


def test_dtype_is_taken_as_a_jnp_dtype_or_its_name():
    by_type = nn.DecoderOnlyConfig(vocab_size=7, dtype=jnp.bfloat16)
    assert by_type == nn.DecoderOnlyConfig(vocab_size=7, dtype="bfloat16")
    assert by_type.dtype == "bfloat16" and hash(by_type)
    assert nn.TransformerConfig(src_vocab_size=5, tgt_vocab_size=5,
                                dtype=np.dtype("float16")).dtype == "float16"
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16', "
                                         r"'float16'\); got 'int8'"):
        nn.DecoderOnlyConfig(vocab_size=7, dtype=jnp.int8)
    # a name numpy reads as another: the name given (it said "got 'float64'")
    with pytest.raises(ValueError, match=r"dtype must be one of \('float32', 'bfloat16', "
                                         r"'float16'\); got 'float' \(float64\)$"):
        nn.DecoderOnlyConfig(vocab_size=7, dtype="float")


def test_sizes_may_be_numpy_integers_as_in_jax_and_flax(rng, own_checks_only):
    """A count computed with NumPy (np.int64, np.int32) is a size like an int, as jax's
    shapes and flax's num_heads take it; a bool or a float is still refused."""
    sizes = draws.host(rng).integers(1, 3, 3)
    heads, kv, width = np.int64(2 * sizes[0]), np.int32(sizes[0]), np.int64(8 * sizes[1])
    x = jax.random.normal(rng, (2, int(sizes[2]) + 2, int(width)))
    as_ints = nn.MultiHeadDotProductAttention(num_heads=int(heads), num_kv_heads=int(kv))
    variables = as_ints.init(rng, x)
    numpy_sized = nn.MultiHeadDotProductAttention(num_heads=heads, num_kv_heads=kv)
    np.testing.assert_array_equal(numpy_sized.apply(variables, x), as_ints.apply(variables, x))
    params = attnjax.init_multi_head_attention(rng, width, heads, num_kv_heads=kv)
    assert params["query"]["kernel"].shape == (width, heads, width // heads)
    config = nn.TransformerConfig(src_vocab_size=np.int64(5), tgt_vocab_size=5, d_model=width,
                                  num_heads=heads, num_kv_heads=kv, d_ff=np.int32(16))
    assert config == nn.TransformerConfig(src_vocab_size=5, tgt_vocab_size=5, d_model=int(width),
                                          num_heads=int(heads), num_kv_heads=int(kv), d_ff=16)
    assert hash(config) == hash(dataclasses.replace(config, d_model=int(width)))
    np.testing.assert_array_equal(attnjax.scores.alibi_slopes(heads),
                                  attnjax.scores.alibi_slopes(int(heads)))
    table = jax.random.normal(rng, (8, int(heads)))
    assert attnjax.scores.relative_position_bias(table, num_buckets=np.int64(8),
                                                 max_distance=np.int32(16)).num_heads == heads
    np.testing.assert_array_equal(attnjax.masks.causal_mask(np.int64(3), np.int32(5)),
                                  attnjax.masks.causal_mask(3, 5))
    q = jax.random.normal(rng, (1, 4, 2, 8))
    np.testing.assert_array_equal(
        attnjax.dot_product_attention(q, q, q, mask=attnjax.masks.chunked_causal(np.int64(2))),
        attnjax.dot_product_attention(q, q, q, mask=attnjax.masks.chunked_causal(2)))
    assert mesh_lib.make_mesh({"data": np.int64(1)}).shape["data"] == 1
    for bad in (True, np.bool_(True), 2.0):
        with pytest.raises(ValueError, match=f"num_heads must be a positive int; got {bad!r}"):
            attnjax.init_multi_head_attention(rng, 8, bad)


# --- models: padded batches ----------------------------------------------------------------


def _padded(rng, lengths, width, side):
    """Random prompts of `lengths`, padded with 0 on `side` to `width`."""
    rows, mask = np.zeros((len(lengths), width), np.int32), np.zeros((len(lengths), width), bool)
    generator = draws.host(rng)
    for b, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        rows[b, cols] = generator.integers(1, 11, n)
        mask[b, cols] = True
    return rows, mask


@pytest.mark.parametrize("side", ["left", "right"])
def test_decoder_only_with_a_padding_mask_gives_each_sequence_its_logits_alone(rng, side):
    model, params = _lm(rng)
    tokens, mask = _padded(rng, [6, 3, 3], 6, side)
    logits = _apply(model, params, tokens, padding_mask=mask)
    for b in range(3):
        alone = _apply(model, params, jax.device_put(tokens[b][mask[b]][None]))
        np.testing.assert_allclose(logits[b][mask[b]], alone[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"padding_mask must have the shape of tokens "
                                         r"\[B, L\] = \[3, 6\]; got \[3, 5\]"):
        _apply(model, params, tokens, padding_mask=mask[:, 1:])


@pytest.mark.parametrize("side", ["left", "right"])
def test_generate_on_padded_prompts_equals_generating_each_alone(rng, side):
    model, params = _lm(rng)
    lengths = np.array([2, 6, 2], np.int32)
    prompt, mask = _padded(rng, lengths, 6, side)
    out = np.asarray(nn.generate(model, params, jax.device_put(prompt), jax.device_put(lengths),
                                 max_new_tokens=5, padding_side=side))
    assert out.shape == (3, 11)
    for b, n in enumerate(lengths):
        alone = np.asarray(nn.generate(model, params, jax.device_put(prompt[b][mask[b]][None]),
                                       max_new_tokens=5))[0]
        row = out[b, :n + 5] if side == "right" else out[b, 6 - n:]
        np.testing.assert_array_equal(row, alone)
    with pytest.raises(ValueError, match=r"padding_side must be one of \('left', 'right'\); "
                                         r"got 'middle'"):
        nn.generate(model, params, jax.device_put(prompt), jax.device_put(lengths),
                    max_new_tokens=1, padding_side="middle")


# --- errors that name the axis and say what to do -------------------------------------------


def test_a_query_without_its_heads_axis_is_named(rng):
    # the library's own checks, beneath the suite's jaxtyping check (as a user runs it)
    dot_product_attention = inspect.unwrap(attnjax.dot_product_attention)
    q, kv = draws.normals(rng, (2, 5, 8), (2, 7, 1, 8))   # [B, T, H]: N forgotten; [B, S, K, H]
    with pytest.raises(ValueError, match=r"query lacks an axis; if it is \[B, L, H\], its "
                                         r"heads axis N is missing: add it with "
                                         r"query\[:, :, None, :\]"):
        dot_product_attention(q, kv, kv)
    # every array without heads reads as one unbatched example; the failure says so
    with pytest.raises(ValueError, match=r"the heads axis is missing \(\[B, T, H\]\)"):
        dot_product_attention(q, kv[:, :, 0], kv[:, :, 0])
    with pytest.raises(ValueError, match=r"got shape \[5, 8\] \(rank 2\): the heads axis N "
                                         r"is missing"):
        dot_product_attention(q[0], kv[0, :, 0], kv[0, :, 0])


def test_a_wrong_input_width_is_blamed_on_the_input(rng):
    x = draws.normal(rng, (2, 5, 24))
    params = attnjax.init_multi_head_attention(rng, in_features=32, num_heads=4)
    with pytest.raises(ValueError, match=r"^inputs_q has 24 features \(its last axis, D\); "
                                         r"these parameters project 32"):
        attnjax.multi_head_attention(params, x)
    module = nn.MultiHeadDotProductAttention(num_heads=4)
    variables = module.init(rng, jnp.ones((2, 5, 32), jnp.float32))
    with pytest.raises(ValueError, match=r"^inputs_q has 24 features; the parameters of "
                                         r"'query' take 32"):
        module.apply(variables, x)


def test_a_mesh_larger_than_the_devices_says_how_to_emulate_them():
    devices = len(jax.devices())
    with pytest.raises(ValueError, match=rf"needs {devices + 3} devices; there are {devices} "
                                         rf"\(on a CPU, emulate them: set XLA_FLAGS="
                                         rf"--xla_force_host_platform_device_count="
                                         rf"{devices + 3} "):
        mesh_lib.make_mesh({"data": devices + 3})


# --- a workdir's config: steps may grow, nothing else may change ----------------------------


def test_a_run_continues_with_more_steps_and_refuses_other_changes_by_name(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    old = load_config("copy", TINY)
    (workdir / "config.yaml").write_text(dump_config(old))
    longer = dataclasses.replace(old, steps=old.steps * 3)
    cli._check_workdir_config(workdir, longer)
    with pytest.raises(ConfigError, match=r"differs in optim.learning_rate\): "
                                          r"optim.learning_rate=0.005 there, 0.01 here"):
        cli._check_workdir_config(workdir, dataclasses.replace(
            longer, optim=dataclasses.replace(old.optim, learning_rate=0.01)))
    with pytest.raises(ConfigError, match=r"differs in steps; steps may only grow, which "
                                          r"continues the run\): steps=20 there, 10 here"):
        cli._check_workdir_config(workdir, dataclasses.replace(old, steps=10))


# --- help() and the docstrings --------------------------------------------------------------


PUBLIC = [getattr(attnjax, name) for name in attnjax.__all__
          if callable(getattr(attnjax, name)) and not inspect.ismodule(getattr(attnjax, name))]
PUBLIC += [getattr(nn, name) for name in nn.__all__]


def test_help_shows_shapes_briefly_before_the_documentation():
    text = pydoc.render_doc(attnjax.dot_product_attention, renderer=pydoc.plaintext)
    signature = text[: text.index("Scaled dot-product attention")]
    assert "query: \"Float[ArrayLike, '*B T N H']\"" in signature
    assert "jaxlib" not in signature and "Union[" not in signature
    for fn in filter(inspect.isfunction, PUBLIC):
        for name, param in inspect.signature(fn).parameters.items():
            shown = inspect.formatannotation(param.annotation)
            assert len(shown) <= 70, f"{fn.__name__}({name}: {shown})"


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda obj: obj.__name__)
def test_docstrings_start_with_one_line(obj):
    doc = inspect.getdoc(obj)
    assert doc, f"{obj.__name__} has no docstring"
    first = doc.split("\n\n")[0]
    assert "\n" not in first and first.endswith("."), first


# --- plots -------------------------------------------------------------------------------


def _records(rng, steps=8):
    u = draws.host(rng).random((steps, 4))
    logs = [{"step": 10 * (i + 1), "loss": float(2.0 - 0.2 * i + 0.1 * u[i, 0]),
             "accuracy": float(u[i, 1]), "learning_rate": 1e-3 * (1 - i / steps),
             "tokens_per_s": 100.0} for i in range(steps)]
    evals = [{"step": 10 * (i + 1), "eval_token_accuracy": float(u[i, 2]),
              "eval_exact_match": float(u[i, 3])} for i in range(1, steps, 2)]
    return sorted(logs + evals, key=lambda r: r["step"])


def _lines(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def test_curves_put_loss_with_learning_rate_and_each_accuracy_on_its_own_panel(rng):
    records = _records(rng)
    fig = curves_figure(records)
    axes = fig.get_axes()
    by_label = {label: ax for ax in axes for label in _lines(ax)}
    loss_ax = by_label["train loss (label-smoothed)"]
    lr_ax = by_label["learning rate"]
    assert lr_ax is not loss_ax and lr_ax.get_ylabel() == "learning rate"
    assert lr_ax.get_shared_x_axes().joined(lr_ax, loss_ax)   # two y-axes, one x
    np.testing.assert_allclose(_lines(lr_ax)["learning rate"].get_ydata(),
                               [r["learning_rate"] for r in records if "loss" in r])
    token_ax = next(ax for ax in axes if ax.get_ylabel() == "token accuracy")
    exact_ax = next(ax for ax in axes if ax.get_ylabel().startswith("exact match"))
    assert token_ax is not exact_ax
    np.testing.assert_allclose(_lines(exact_ax)["held-out (greedy)"].get_ydata(),
                               [r["eval_exact_match"] for r in records if "eval_exact_match" in r])
    assert len(_lines(token_ax)) == 2 and len(_lines(exact_ax)) == 1
    styles = {(line.get_linestyle(), line.get_marker()) for line in token_ax.get_lines()}
    assert len(styles) == 2   # the two accuracies stay apart where they coincide


def test_curves_of_one_log_step_show_its_points(rng):
    """A run of one log step (steps=1, or fewer steps than log_every): each curve is one
    point, drawn with a marker (a line of one point draws nothing: the loss panel was
    empty)."""
    records = _records(rng, steps=1)
    records.append({"step": 10, "eval_token_accuracy": float(draws.host(rng).random()),
                    "eval_exact_match": 0.0, "eval_s": 0.5})
    fig = curves_figure(records)
    lines = [line for ax in fig.get_axes() for line in ax.get_lines()]
    assert len(lines) == 5
    for line in lines:
        assert len(line.get_ydata()) == 1
        assert line.get_marker() not in (None, "None", "", " "), line.get_label()
    styles = {(line.get_linestyle(), line.get_marker()) for line in _lines(
        next(ax for ax in fig.get_axes() if ax.get_ylabel() == "token accuracy")).values()}
    assert len(styles) == 2


def test_attention_heatmaps_have_a_colour_bar_labelled_axes_and_legible_ticks(rng):
    src, tgt = list("0123456"), ["<bos>", "a", "b", "c"]
    generator = draws.host(rng)
    maps = {name: jax.device_put(generator.random(shape, np.float32)) for name, shape in
            (("encoder/layer_0/self", (1, 2, 7, 7)), ("decoder/layer_0/self", (1, 2, 4, 4)),
             ("decoder/layer_0/cross", (1, 2, 4, 7)))}
    fig = attention_figure(maps, src, tgt)
    heatmaps = [ax for ax in fig.get_axes() if ax.get_images()]
    bars = [ax for ax in fig.get_axes() if ax.get_ylabel() == "attention weight"]
    assert len(heatmaps) == 6 and len(bars) == 1
    cross = {int(ax.get_title()[-1]): ax for ax in heatmaps
             if ax.get_title().startswith("decoder/layer_0/cross")}
    np.testing.assert_array_equal(cross[1].get_images()[0].get_array(),
                                  np.asarray(maps["decoder/layer_0/cross"][0, 1], np.float32))
    for ax in cross.values():
        assert ax.get_xlabel() == "source tokens (keys)"
        assert [t.get_text() for t in ax.get_xticklabels()] == src
    # the row's heads share its queries: the first panel names them
    assert cross[0].get_ylabel() == "output tokens (queries)"
    assert [t.get_text() for t in cross[0].get_yticklabels()] == tgt
    assert cross[1].get_ylabel() == "" and not cross[1].get_yticklabels()
    # no panel overlaps another, nor the colour bar
    boxes = [ax.get_position() for ax in fig.get_axes()]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[:i])
    for ax in heatmaps:
        for tick in ax.get_xticklabels() + ax.get_yticklabels():
            assert tick.get_fontsize() >= 9
        short = all(len(t.get_text()) <= 2 for t in ax.get_xticklabels())
        assert not short or all(t.get_rotation() == 0 for t in ax.get_xticklabels())


def test_attention_labels_of_a_short_sequence_stay_apart(rng):
    """A decoder-only model's short sequence: panels narrower than their titles and
    key labels, and shorter than the query label, are spaced by their labels."""
    tokens = ["0", "<sep>", "<pad>"]
    generator = draws.host(rng)
    maps = {f"decoder/layer_{i}/self": jax.device_put(generator.random((1, 3, 3, 3), np.float32))
            for i in range(2)}
    fig = attention_figure(maps, tokens, tokens)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [text for ax in fig.get_axes() if ax.get_images()
             for text in (ax.title, ax.xaxis.label, ax.yaxis.label) if text.get_text()]
    assert len(texts) == 6 * 2 + 2
    boxes = [text.get_window_extent(renderer) for text in texts]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[:i])
    width, height = fig.canvas.get_width_height()
    assert all(0 <= box.x0 and box.x1 <= width and 0 <= box.y0 and box.y1 <= height
               for box in boxes)


def test_tensorboard_tags_group_training_evaluation_and_time():
    assert [scalar_tag(k) for k in ("loss", "learning_rate", "eval_exact_match",
                                    "eval_token_accuracy", "eval_s", "tokens_per_s")] == [
        "train/loss", "train/learning_rate", "eval/exact_match", "eval/token_accuracy",
        "time/eval_s", "time/tokens_per_s"]


def test_shipped_configs_load_by_name_and_a_missing_path_names_them(tmp_path, monkeypatch,
                                                                     capsys):
    assert load_config("dates") == load_config("dates.yaml")
    assert load_config("dates").task.name == "dates"
    monkeypatch.chdir(tmp_path)   # no configs/ here
    assert cli.main(["--config", "configs/dates.yaml", "--workdir", "w"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: cannot read config configs/dates.yaml: no such file, nor a shipped config of "
        "that name (shipped: copy, ")
    assert err.endswith("; the shipped 'dates' is --config dates\n")
    assert not (tmp_path / "w").exists()
