"""How values are stored: timestamps as naive UTC, JSON columns as sorted-key text. Every store file
reads and writes them through these helpers."""

from __future__ import annotations

import json
from datetime import date, datetime, timezone

from store.errors import InvalidRequest


def utcnow() -> datetime:
    """Naive UTC, the form timestamps are stored in."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def to_db_time(value: datetime | date | str | None) -> datetime | None:
    """Accept an aware datetime, a naive one (taken as UTC), a date, or an ISO string."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError as exc:
            raise InvalidRequest(f"not an ISO date or time: {value!r}") from exc
    if isinstance(value, date) and not isinstance(value, datetime):
        value = datetime(value.year, value.month, value.day)
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value


def from_db_time(value: datetime | None) -> datetime | None:
    return None if value is None else value.replace(tzinfo=timezone.utc)


def dumps(value) -> str:
    return json.dumps(value if value is not None else {}, ensure_ascii=False, sort_keys=True)


def loads(text: str | None, default=None):
    if text is None:
        return {} if default is None else default
    return json.loads(text)


def whole_number(value, what: str, lo: int, hi: int) -> int:
    """A whole number from lo to hi, else InvalidRequest naming `what`."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer()
            or not lo <= value <= hi):
        raise InvalidRequest(f"the {what} must be a whole number from {lo} to {hi}, not {value!r}")
    return int(value)
