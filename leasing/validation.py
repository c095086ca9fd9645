"""Input checks at the edge, shared by the JSON API, the dashboard pages and the admin.

What a request carries must be checked before it reaches the database, because PostgreSQL (or
psycopg reading a value back) is the wrong place to find out:

- **NUL** (``\\x00``) cannot be stored in text or jsonb, and psycopg refuses to even send it: a
  filter ``?queue=%00`` fails the query;
- a **lone surrogate** (``"\\ud800"`` in a JSON string) is not Unicode and cannot be encoded;
- a JSON number such as ``1e400`` parses to ``inf``, which is not JSON and jsonb refuses;
- ``str.isdigit()`` and ``int()`` accept non-ASCII digits (``"²"``, ``"٣"``), and ``int()`` of a
  5,000-digit string raises; identifiers and counts here are ASCII decimal digits of bounded length;
- a date-time's offset can push it outside what PostgreSQL stores *and* psycopg reads back
  (``0001-01-01T00:00:00+15:00`` is a BC timestamp): such a row, once inserted, fails every page
  that shows it. Dates are bounded to a sane range, compared in UTC.

Each check raises :class:`InvalidInput` (a ``ValueError``) naming the field; the API turns it into a
400 with a JSON reason, the pages into their own error.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

#: Largest id or token (PostgreSQL bigint).
MAX_BIGINT = 2**63 - 1
#: Dates accepted from clients, in UTC: any real schedule fits, and no offset can move a value in
#: this range outside what PostgreSQL stores and Python's datetime (years 1 to 9999) reads back.
EARLIEST = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
LATEST = dt.datetime(3000, 1, 1, tzinfo=dt.timezone.utc)
#: Longest number literal in a JSON body (characters) and deepest nesting.
MAX_NUMBER_LENGTH = 100
MAX_DEPTH = 64
#: Longest query-string or form value a page or the API looks at (characters).
MAX_PARAM_LENGTH = 1_000

# ``[0-9]`` is exactly the ASCII digits (``\d`` would also match "٣").
_WHOLE = re.compile(r"-?[0-9]+")
# The date-times read from clients, the same on every Python: ISO 8601's extended format, a ``T``
# or a space between date and time, seconds and 1 to 6 digits of fraction optional, the offset
# ``Z`` or ``+HH:MM`` (seconds and fraction allowed, as ``isoformat()`` writes them). Python 3.11's
# ``datetime.fromisoformat`` also reads basic format (``20300101T120000Z``), week dates and bare
# hours, which 3.10's refuses: without this gate an API would accept on one Python what it refuses
# on another (Django's ``parse_datetime`` tries ``fromisoformat`` first, so it varies as well).
_ISO_DATETIME = re.compile(
    r"(?P<date>[0-9]{4}-[0-9]{2}-[0-9]{2})[T ](?P<time>[0-9]{2}:[0-9]{2})(?P<seconds>:[0-9]{2}(?:\.[0-9]{1,6})?)?"
    r"(?P<offset>Z|[+-][0-9]{2}:[0-9]{2}(?::[0-9]{2}(?:\.[0-9]{6})?)?)?"
)
_DECIMAL = re.compile(r"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|-?\.[0-9]+(?:[eE][-+]?[0-9]+)?")


class InvalidInput(ValueError):
    """A value from a request that cannot be accepted; ``field`` names where it was."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


def check_text(value: str, field: str | None = None, *, label: str | None = None) -> str:
    """``value`` unchanged if it is storable text: no NUL, no lone surrogate."""
    label = label or field or "text"
    if "\x00" in value:
        raise InvalidInput(f"{label} must not contain NUL characters", field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(f"{label} must be valid Unicode (no lone surrogates)", field) from None
    return value


def clean_text(value: Any, field: str, *, max_length: int = 255, allow_blank: bool = False) -> str:
    """A string of at most ``max_length`` characters, storable, non-blank unless allowed."""
    if not isinstance(value, str) or (not allow_blank and not value.strip()):
        raise InvalidInput(f"{field} must be a non-empty string", field)
    if len(value) > max_length:
        raise InvalidInput(f"{field} must be at most {max_length} characters", field)
    return check_text(value, field)


def parse_whole(value: Any, field: str, *, low: int = 1, high: int = MAX_BIGINT) -> int:
    """An integer written in ASCII decimal digits (optional leading ``-``), from ``low`` to ``high``."""
    text = value.strip() if isinstance(value, str) else None
    width = max(len(str(low)), len(str(high)))
    if text is None or len(text) > width or not _WHOLE.fullmatch(text):
        raise InvalidInput(f"{field} must be a whole number from {low} to {high} (ASCII digits)", field)
    number = int(text)
    if not low <= number <= high:
        raise InvalidInput(f"{field} must be a whole number from {low} to {high}", field)
    return number


def parse_number(value: Any, field: str, *, low: float, high: float) -> float:
    """A finite decimal number in ASCII (``float()`` would also take "nan", "inf", "1_0" and Arabic-Indic digits)."""
    text = value.strip() if isinstance(value, str) else None
    if text is None or len(text) > MAX_NUMBER_LENGTH or not _DECIMAL.fullmatch(text):
        raise InvalidInput(f"{field} must be a number", field)
    number = float(text)
    if not math.isfinite(number) or not low < number <= high:
        raise InvalidInput(f"{field} must be greater than {low:g} and at most {high:g}", field)
    return number


def parse_iso_datetime(value: str) -> dt.datetime:
    """An ISO 8601 date-time in the extended format (``_ISO_DATETIME``), aware when it carries an
    offset; ``ValueError`` otherwise, or when a field is out of range (month 13, an offset of a day)."""
    parts = _ISO_DATETIME.fullmatch(value)
    if parts is None:
        raise ValueError(f"not an ISO 8601 date-time: {value!r}")
    seconds, _, fraction = (parts["seconds"] or ":00").partition(".")
    offset = {None: "", "Z": "+00:00"}.get(parts["offset"], parts["offset"])
    # Normalised to what datetime.isoformat() writes (6 digits of fraction or none), which
    # fromisoformat reads alike on every Python.
    return dt.datetime.fromisoformat(f"{parts['date']}T{parts['time']}{seconds}.{fraction:0<6}{offset}")


def parse_when(
    value: Any, field: str, *, earliest: dt.datetime = EARLIEST, latest: dt.datetime = LATEST
) -> dt.datetime:
    """An ISO 8601 date-time with a time zone, between ``earliest`` and ``latest`` once in UTC."""
    message = f"{field} must be an ISO 8601 date-time with a time zone"
    if not isinstance(value, str) or not value.isascii() or len(value) > 64:
        raise InvalidInput(message, field)
    try:
        parsed = parse_iso_datetime(value)
    except ValueError:  # not the extended format, or impossible: month 13, an offset of a day or more
        raise InvalidInput(message, field) from None
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        raise InvalidInput(message, field)
    out_of_range = InvalidInput(f"{field} must be from {earliest:%Y-%m-%d} to before {latest:%Y-%m-%d} (UTC)", field)
    try:
        in_utc = parsed.astimezone(dt.timezone.utc)
    except (ValueError, OverflowError):  # the offset pushes it before year 1 or past 9999
        raise out_of_range from None
    if not earliest <= in_utc < latest:
        raise out_of_range
    return in_utc


def check_json(value: Any, field: str | None = None, _depth: int = 0) -> Any:
    """``value`` unchanged if jsonb can store it: finite numbers, storable strings and keys, bounded
    depth. An error names where the value was (``kwargs.items[2]``)."""
    label = field or "value"
    if _depth > MAX_DEPTH:
        raise InvalidInput("body is nested too deeply", field)
    if isinstance(value, str):
        check_text(value, label)
    elif isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidInput(f"{label} must be a finite number (not NaN, not infinite, no overflow)", field)
    elif isinstance(value, _LongNumber):
        raise InvalidInput(f"{label} must be a number of at most {MAX_NUMBER_LENGTH} characters", field)
    elif isinstance(value, int):
        if len(str(abs(value))) > MAX_NUMBER_LENGTH:  # the parser bounds it already; this is for Python callers
            raise InvalidInput(f"{label} must have at most {MAX_NUMBER_LENGTH} digits", field)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidInput(f"keys of {label} must be strings", field)
            check_text(key, field, label=f"a key of {label}" if field else "a field name")
            check_json(item, f"{field}.{key}" if field else key, _depth + 1)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_json(item, f"{label}[{index}]", _depth + 1)
    else:
        raise InvalidInput(f"{label} is not JSON", field)
    return value


class _LongNumber:
    """Stands in for a number literal longer than MAX_NUMBER_LENGTH until check_json names its field."""


def _constant(name: str) -> float:
    return float(name)  # NaN, Infinity, -Infinity: refused by check_json, which knows the field


def _parse_int(text: str) -> int | _LongNumber:
    return _LongNumber() if len(text) > MAX_NUMBER_LENGTH else int(text)


def _parse_float(text: str) -> float | _LongNumber:
    return _LongNumber() if len(text) > MAX_NUMBER_LENGTH else float(text)  # 1e400 -> inf: refused later


def loads(raw: bytes | str) -> Any:
    """Parse a JSON document that jsonb can store, or raise :class:`InvalidInput` saying why not."""
    try:
        data = json.loads(raw, parse_constant=_constant, parse_int=_parse_int, parse_float=_parse_float)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidInput(f"body is not valid JSON: {str(exc)[:200]}") from None
    return check_json(data)


def check_params(params: Mapping[str, Any] | Any, *, max_length: int = MAX_PARAM_LENGTH) -> None:
    """Every key and value of a query string or form (a QueryDict): storable and bounded."""
    items: Iterable[tuple[str, Any]] = params.lists() if hasattr(params, "lists") else params.items()
    for key, values in items:
        check_text(key, label="a parameter name")
        for value in values if isinstance(values, list) else [values]:
            if not isinstance(value, str):
                continue  # an uploaded file: not ours to read
            check_text(value, key)
            if len(value) > max_length:
                raise InvalidInput(f"{key} must be at most {max_length} characters", key)


def bad_params(params: Any, *, max_length: int = MAX_PARAM_LENGTH) -> dict[str, str]:
    """The parameters of ``params`` that :func:`check_params` would refuse: name -> reason."""
    refused: dict[str, str] = {}
    for key, values in params.lists():
        for value in values:
            try:
                check_params({key: value}, max_length=max_length)
            except InvalidInput as exc:
                refused[key] = exc.message
    return refused
