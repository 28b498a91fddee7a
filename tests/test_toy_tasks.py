"""The task generators: shapes, vocabularies, targets, determinism, the held-out split,
and dates checked against the standard library's `datetime`."""

import datetime
import re

import numpy as np
import pytest

from attnjax.toy import DatesTask, SequenceTask, make_task
from attnjax.toy.config import TaskConfig
from attnjax.toy import dates
from attnjax.toy.dates import FIRST_DAY, FORMATS, LAST_DAY, format_date
from attnjax.toy import tasks
from attnjax.toy.report import write_samples
from attnjax.toy.tasks import BOS, EOS, PAD, SPECIALS
from attnjax.toy.train import accuracies

TASKS = {
    "copy": lambda: SequenceTask("copy", 7, 3, 11),
    "reverse": lambda: SequenceTask("reverse", 13, 1, 9),
    "sort": lambda: SequenceTask("sort", 5, 2, 17),
    "dates": DatesTask,
}


def _rows(batch):
    """Per example: source ids, target ids (without bos/eos/pad)."""
    rows = []
    for i in range(len(batch.src)):
        src = batch.src[i, : batch.src_lengths[i]].tolist()
        tgt = batch.tgt_out[i].tolist()
        rows.append((src, tgt[: tgt.index(EOS)]))
    return rows


@pytest.mark.parametrize("name", sorted(TASKS))
def test_batch_shapes_vocabularies_and_padding(name):
    task = TASKS[name]()
    batch = task.sample(np.random.default_rng(3), 37)
    assert batch.src.shape == (37, task.src_len) and batch.src.dtype == np.int32
    assert batch.src_lengths.shape == (37,)
    assert batch.tgt_in.shape == batch.tgt_out.shape == (37, task.tgt_len + 1)
    assert batch.src.max() < task.src_vocab.size and batch.tgt_out.max() < task.tgt_vocab.size
    positions = np.arange(task.src_len)
    np.testing.assert_array_equal(batch.src == PAD, positions >= batch.src_lengths[:, None])
    assert (batch.src[batch.src != PAD] >= len(SPECIALS)).all()
    assert (batch.tgt_in[:, 0] == BOS).all()
    target_lengths = (batch.tgt_out != PAD).sum(1)
    rows = np.arange(37)
    assert (batch.tgt_out[rows, target_lengths - 1] == EOS).all()
    # teacher forcing: the decoder input is the label shifted right by one, after bos
    np.testing.assert_array_equal(batch.tgt_in[:, 1:][batch.tgt_out[:, 1:] != PAD],
                                  batch.tgt_out[:, :-1][batch.tgt_out[:, 1:] != PAD])
    if name != "dates":
        assert len(set(batch.src_lengths.tolist())) > 1   # lengths vary, padding matters


@pytest.mark.parametrize("name", ["copy", "reverse", "sort"])
def test_sequence_targets(name):
    task = TASKS[name]()
    expected = {"copy": lambda s: s, "reverse": lambda s: s[::-1], "sort": sorted}[name]
    for src, tgt in _rows(task.sample(np.random.default_rng(5), 200)):
        assert tgt == list(expected(src))
    lengths = task.sample(np.random.default_rng(6), 2000).src_lengths
    assert lengths.min() == task.min_len and lengths.max() == task.max_len


@pytest.mark.parametrize("name", sorted(TASKS))
def test_deterministic_per_seed(name):
    task = TASKS[name]()
    a = task.sample(np.random.default_rng([4, 0, 9]), 64)
    b = task.sample(np.random.default_rng([4, 0, 9]), 64)
    c = task.sample(np.random.default_rng([4, 0, 10]), 64)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.src, c.src)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_held_out_set_is_disjoint_from_training(name):
    task = TASKS[name]()
    # (enough draws that training meets nearly every short source: 625 of length 4 in
    # sort's, each in 1 of 16 lengths)
    train = task.sample(np.random.default_rng(1), 40000)
    held = task.sample(np.random.default_rng(2), 2000, held=True)
    key = (lambda s, t: tuple(t)) if name == "dates" else (lambda s, t: tuple(s))
    train_keys = {key(s, t) for s, t in _rows(train)}
    held_keys = {key(s, t) for s, t in _rows(held)}
    assert len(held_keys) > 100
    if name == "dates":
        assert not train_keys & held_keys
        return
    # sources of the lengths too short to split are shared; the longer ones are disjoint
    short = {k for k in held_keys if len(k) < task.split_len}
    assert task.min_len < task.split_len <= task.max_len and short
    assert len(short & train_keys) > 0.9 * len(short)
    assert not (train_keys & held_keys) - short


@pytest.mark.parametrize("num_symbols, max_len", [(10, 16), (31, 16), (7, 30), (2, 12)])
def test_both_sides_of_the_split_keep_uniform_lengths(num_symbols, max_len):
    """Short sources (shared) had been kept whatever their side: 59% of the default copy
    task's held-out set had 1 or 2 symbols. And an even num_symbols + 1 had pushed a
    short source's first symbols off its 64-bit key: with 31 symbols every source of
    length 3 was held out (training never saw one), lengths 4 to 7 one in five."""
    task = SequenceTask("copy", num_symbols, 1, max_len)
    seed = np.random.default_rng().integers(1 << 30)
    symbols, lengths = task._draw(np.random.default_rng(seed), 200_000)
    held_out = tasks.held_out(task._keys(symbols, lengths))
    # each length's share of held-out sources: one in ten, as the hash gives it (with 2
    # symbols, a length has a few thousand sources: 8.7% of length 11's, say)
    shares = np.full(max_len, 1 / tasks.HELD_OUT_ONE_IN)
    for length in range(task.split_len, max_len + 1):
        shares[length - 1] = held_out[lengths == length].mean()
        assert 0.07 < shares[length - 1] < 0.13, (length, shares[length - 1])
    for held, side in ((True, shares), (False, 1 - shares)):
        size = 300 * max_len
        lengths = task.sample(np.random.default_rng([seed, held]), size,
                              held=held).src_lengths
        counts = np.bincount(lengths, minlength=max_len + 1)[1:]
        # each length as common as its share of the side allows, within 5 standard
        # deviations of the draw (59% of lengths 1 and 2 was 30 of them)
        expected = size * side / side.sum()
        assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected)), (held, counts,
                                                                           expected)


def test_samples_mark_what_exact_match_counts(tmp_path):
    """samples.txt had marked "ok" a prediction without its eos, or with a bos inside (the
    decoded strings leave pad, bos and eos out), which exact match counts wrong."""
    task = SequenceTask("copy", 10, 3, 6)
    batch = task.sample(np.random.default_rng(), 3, held=True)
    predictions = batch.tgt_out.copy()
    n = batch.src_lengths
    predictions[1, n[1]] = PAD                                      # no eos
    predictions[2] = np.concatenate([[BOS], batch.tgt_out[2, :-1]])  # a bos first
    write_samples(tmp_path / "samples.txt", task, batch, predictions)
    marks = re.findall(r"\((ok|WRONG)\)", (tmp_path / "samples.txt").read_text())
    assert marks == ["ok", "WRONG", "WRONG"]
    assert accuracies(predictions, batch.tgt_out)["exact_match"] == pytest.approx(1 / 3)


def _iso(task, ids) -> datetime.date:
    return datetime.date.fromisoformat(task.tgt_vocab.decode(ids))


# An independent reading of FORMATS with strptime (ordinal suffixes removed first).
STRPTIME = ("%d %B %Y", "%b %d, %Y", "%m/%d/%y", "%A, %B %d, %Y", "%d.%m.%Y", "%B %d, %Y",
            "%d %b %Y", "%Y/%m/%d", "%d-%b-%Y", "%a %d %b %Y", "the %d of %B %Y", "%B %d, %Y",
            "%Y%m%d", "%d.%m.%y", "%A %d %B %Y", "%b %d %Y", "%m/%d/%Y")


def _strptime(text: str, pattern: str) -> datetime.datetime:
    parsed = datetime.datetime.strptime(re.sub(r"(\d)(st|nd|rd|th)\b", r"\1", text), pattern)
    if "%y" in pattern and parsed.year < FIRST_DAY.year:  # attnjax reads 69 as 2069
        parsed = parsed.replace(year=parsed.year + 100)
    return parsed


def test_date_formats_read_back_with_datetime():
    assert len(FORMATS) == len(STRPTIME) >= 15
    rng = np.random.default_rng(0)
    days = rng.integers(FIRST_DAY.toordinal(), LAST_DAY.toordinal() + 1, 300)
    for day in [FIRST_DAY.toordinal(), LAST_DAY.toordinal(), *days.tolist()]:
        date = datetime.date.fromordinal(day)
        for fmt, pattern in enumerate(STRPTIME):
            text = format_date(date, fmt)
            parsed = _strptime(text, pattern)
            assert parsed.date() == date, (text, pattern)
            if "%A" in pattern or "%a" in pattern:   # strptime ignores the weekday: check it
                assert parsed.strftime(pattern.split(" ")[0].rstrip(",")).lower() in text


def test_dates_batches_against_datetime():
    task = DatesTask()
    batch = task.sample(np.random.default_rng(8), 500)
    formats_seen = set()
    for src, tgt in _rows(batch):
        source = task.src_vocab.decode(src)
        date = _iso(task, tgt + [EOS])
        assert task.tgt_vocab.decode(tgt) == date.isoformat()
        matches = [f for f in range(len(FORMATS)) if format_date(date, f) == source]
        assert matches, source
        formats_seen.update(matches)
        assert _strptime(source, STRPTIME[matches[0]]).date() == date
    assert len(formats_seen) == len(FORMATS)
    assert task.src_vocab.symbols != task.tgt_vocab.symbols


def test_dates_source_length_covers_every_day():
    day, longest = FIRST_DAY, 0
    while day <= LAST_DAY:
        # format_date, its fields made once a day rather than once a format (36,524 days)
        fields = dates._fields(day)
        longest = max(longest, *(len(f.format(**fields)) for f in FORMATS))
        day += datetime.timedelta(days=1)
    assert DatesTask.src_len == longest


def test_make_task_and_bad_arguments():
    assert isinstance(make_task(TaskConfig(name="dates")), DatesTask)
    task = make_task(TaskConfig(name="reverse", num_symbols=6, min_len=2, max_len=5))
    assert (task.name, task.src_vocab.size, task.src_len) == ("reverse", 9, 5)
    with pytest.raises(ValueError, match="num_symbols must lie in"):
        SequenceTask("copy", 99, 1, 4)
    with pytest.raises(ValueError, match="name must be copy, reverse or sort; got 'rot13'"):
        SequenceTask("rot13", 9, 1, 4)
