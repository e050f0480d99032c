"""What an export selects and how it writes it: `ExportOptions`, one frozen record built alike by
the command line (`python -m store export`), the Data tab's form (annotate/admin.py) and a round's
snapshot (pipeline/orchestrate/steps.py), and checked when it is built, so that no export starts on
a bad option. store/export.py `export_dataset` writes with it; store/export_select.py turns its
filters into SQL.

A refused option raises `InvalidOption`, an InvalidRequest that names the field and its problem
("min_quality must be between 0 and 1, not 1.5"); the form says the same under its own label.
"""

from __future__ import annotations

import datetime as dt
import numbers
from dataclasses import dataclass, fields

from store.errors import InvalidRequest
from store.records import EXPORT_FORMATS
from store.values import to_db_time

TRL_FORMATS = ("conversational", "text")
"""How the pairs' texts are written: TRL's conversational rows (chat messages) or plain text."""
LICENSE_CHARS = 100
"""The longest license the dataset card takes (an SPDX-like id is a few characters)."""


class InvalidOption(InvalidRequest):
    """An export option was refused: `field` names it, `problem` says what is wrong with its value."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field} {problem}")


@dataclass(frozen=True)
class ExportOptions:
    """What an export selects (the filters, the split) and how it writes it (format, columns,
    license). Checked when built (InvalidOption); kept in one form: tuples of rounds and
    annotators, floats, naive UTC datetimes, a stripped license."""

    format: str = "jsonl"  # noqa: A003 (the manifest's name)
    """File format: jsonl, parquet or datasets (store/export.py: where each part goes)."""
    trl_format: str = "conversational"
    """conversational: the prompt as chat messages, chosen and rejected one assistant message
    each; text: the stored texts (chat prompts as HH-style transcripts)."""
    rounds: tuple[int, ...] | None = None
    """Only the items of these round ids (one id, or several)."""
    annotators: tuple[str | int, ...] | None = None
    """Only the pairs and rankings of these annotators (names or ids)."""
    min_agreement: float | None = None
    """Only pairs that at least this share of their item's rankings agree with, in [0, 1]."""
    since: dt.datetime | None = None
    """Only what was created at or after this time (a datetime, a date or an ISO string; UTC)."""
    until: dt.datetime | None = None
    """Only what was created before this time."""
    include_all_bad: bool = False
    """Also the "all bad" rankings and their pairs."""
    include_imported: bool = True
    """Also the imported pairs."""
    include_evaluations: bool = False
    """Also the rankings of blind evaluation items (store/evaluations.py), left out by default so
    that no model trains on the prompts it is judged on."""
    include_empty: bool = True
    """False: leave out the pairs with a blank side (counted in counts['left_out_empty'])."""
    min_quality: float | None = None
    """Leave out the annotators measured below this quality, in [0, 1] (store/quality.py)."""
    quality_weights: bool = False
    """Add the `weight` column: each pair's annotator's quality weight."""
    test_fraction: float = 0.0
    """About this share of the prompts held out as the 'test' split, in [0, 1)."""
    seed: int = 0
    """The seed of the held-out prompts' hash."""
    margin_column: bool = False
    """Add TRL's `margin` column (the pair's strength as Llama 2's margin, else its rank gap)."""
    license: str = "unknown"  # noqa: A003 (the dataset card's field)
    """The dataset card's license field, one short line (an SPDX-like id such as cc-by-4.0)."""
    overwrite: bool = False
    """Replace an existing export at the same place."""

    def __post_init__(self) -> None:
        for f in fields(self):
            try:
                value = _CHECKS[f.name](getattr(self, f.name))
            except _Refused as exc:
                raise InvalidOption(f.name, str(exc)) from None
            object.__setattr__(self, f.name, value)


class _Refused(Exception):
    """A check's problem with a value, said after the option's name."""


def _one_of(allowed: tuple[str, ...]):
    def check(value):
        if value not in allowed:
            raise _Refused(f"must be one of {', '.join(allowed)}, not {value!r}")
        return value
    return check


def _round_ids(value):
    if value is None:
        return None
    ids = [value] if _whole(value) else value
    if not isinstance(ids, (list, tuple)) or not all(_whole(i) for i in ids):
        raise _Refused(f"must be round ids, not {value!r}")
    return tuple(int(i) for i in ids)


def _annotators(value):
    if value is None:
        return None
    names = [value] if isinstance(value, str) or _whole(value) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(a, str) or _whole(a) for a in names):
        raise _Refused(f"must be account names or ids, not {value!r}")
    return tuple(a if isinstance(a, str) else int(a) for a in names)


def _share(upper_open: bool):
    """A number between 0 and 1 (below 1 with upper_open), as a float."""
    interval = "in [0, 1)" if upper_open else "between 0 and 1"

    def check(value):
        try:
            x = float("nan") if isinstance(value, bool) else float(value)
        except (TypeError, ValueError):
            x = float("nan")
        if not (0.0 <= x < 1.0 if upper_open else 0.0 <= x <= 1.0):  # NaN fails the comparison too
            raise _Refused(f"must be {interval}, not {value!r}")
        return x
    return check


def _optional(check):
    return lambda value: None if value is None else check(value)


def _time(value):
    if value is None:
        return None
    try:
        if isinstance(value, (str, dt.date)):
            return to_db_time(value)
    except InvalidRequest:
        pass
    raise _Refused(f"must be a date or time such as 2024-06-01, not {value!r}")


def _flag(value):
    if not isinstance(value, bool):
        raise _Refused(f"must be True or False, not {value!r}")
    return value


def _seed(value):
    if not _whole(value):
        raise _Refused(f"must be a whole number, not {value!r}")
    return int(value)


def _license(value):
    text = value.strip() if isinstance(value, str) else ""
    if not text or "\n" in text or len(text) > LICENSE_CHARS:
        raise _Refused(f"must be one short line such as 'cc-by-4.0', not {value!r}")
    return text


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_CHECKS = {
    "format": _one_of(EXPORT_FORMATS), "trl_format": _one_of(TRL_FORMATS), "rounds": _round_ids,
    "annotators": _annotators, "min_agreement": _optional(_share(upper_open=False)), "since": _time,
    "until": _time, "include_all_bad": _flag, "include_imported": _flag, "include_evaluations": _flag,
    "include_empty": _flag, "min_quality": _optional(_share(upper_open=False)), "quality_weights": _flag,
    "test_fraction": _share(upper_open=True), "seed": _seed, "margin_column": _flag, "license": _license,
    "overwrite": _flag,
}
"""Each field's check: the value in its one form, or _Refused saying what is wrong."""
