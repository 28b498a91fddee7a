"""Date translation: a human-readable date in one of 17 formats -> ISO "YYYY-MM-DD".

Character level, with separate source and target vocabularies. Days run from 1970-01-01
to 2069-12-31, so a two-digit year is unambiguous (70-99 -> 19xx, 00-69 -> 20xx), and
each format fixes its field order ("03/04/21" is always month/day/year, "3.4.2021" always
day.month.year). A held-out day never appears in training, in any format.
"""

import datetime

import numpy as np

from attnjax.toy.tasks import Batch, Vocab, held_out, make_batch

FIRST_DAY = datetime.date(1970, 1, 1)
LAST_DAY = datetime.date(2069, 12, 31)
MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august",
          "september", "october", "november", "december")
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _fields(d: datetime.date) -> dict:
    month, weekday = MONTHS[d.month - 1], WEEKDAYS[d.weekday()]
    return dict(d=d.day, dd=f"{d.day:02d}", m=d.month, mm=f"{d.month:02d}", yyyy=d.year,
                yy=f"{d.year % 100:02d}", month=month, mon=month[:3], weekday=weekday,
                wkd=weekday[:3], nth=_ordinal(d.day))


FORMATS = (
    "{d} {month} {yyyy}",                # 3 march 2021
    "{mon} {d}, {yyyy}",                 # mar 3, 2021
    "{mm}/{dd}/{yy}",                    # 03/03/21
    "{weekday}, {month} {d}, {yyyy}",    # wednesday, march 3, 2021
    "{d}.{m}.{yyyy}",                    # 3.3.2021
    "{month} {d}, {yyyy}",               # march 3, 2021
    "{d} {mon} {yyyy}",                  # 3 mar 2021
    "{yyyy}/{mm}/{dd}",                  # 2021/03/03
    "{dd}-{mon}-{yyyy}",                 # 03-mar-2021
    "{wkd} {d} {mon} {yyyy}",            # wed 3 mar 2021
    "the {nth} of {month} {yyyy}",       # the 3rd of march 2021
    "{month} {nth}, {yyyy}",             # march 3rd, 2021
    "{yyyy}{mm}{dd}",                    # 20210303
    "{dd}.{mm}.{yy}",                    # 03.03.21
    "{weekday} {d} {month} {yyyy}",      # wednesday 3 march 2021
    "{mon} {dd} {yyyy}",                 # mar 03 2021
    "{m}/{d}/{yyyy}",                    # 3/3/2021
)


def format_date(d: datetime.date, fmt: int) -> str:
    """`d` written in format number fmt of `FORMATS`."""
    return FORMATS[fmt].format(**_fields(d))


class DatesTask:
    """Source: a date in a random format; target: the same date in ISO format."""

    name = "dates"
    src_vocab = Vocab(tuple(" ,-./0123456789abcdefghijklmnopqrstuvwxyz"))
    tgt_vocab = Vocab(tuple("-0123456789"))
    src_len = max(len(format_date(datetime.date(2000, 9, 27), i)) for i in range(len(FORMATS)))
    tgt_len = 10

    def __init__(self):
        days = np.arange(FIRST_DAY.toordinal(), LAST_DAY.toordinal() + 1, dtype=np.int64)
        held = held_out(days)
        self._days = {True: days[held], False: days[~held]}

    def sample(self, rng: np.random.Generator, size: int, *, held: bool = False) -> Batch:
        """size examples from the held-out days (held=True) or from the rest."""
        days = rng.choice(self._days[held], size)
        formats = rng.integers(0, len(FORMATS), size)
        dates = [datetime.date.fromordinal(int(day)) for day in days]
        sources = [self.src_vocab.encode(format_date(d, int(f))) for d, f in zip(dates, formats)]
        targets = [self.tgt_vocab.encode(d.isoformat()) for d in dates]
        return make_batch(sources, targets, self.src_len, self.tgt_len)
