"""The edge checks on their own (no database): what each accepts, what each refuses and why."""

from __future__ import annotations

import datetime as dt
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from leasing.access import Caller, parse_tokens
from leasing.validation import (
    InvalidInput,
    check_json,
    check_params,
    clean_text,
    loads,
    parse_iso_datetime,
    parse_number,
    parse_when,
    parse_whole,
)
from project.settings import secret_key_from_file
from tasks.lifecycle.bulk import BulkFilterError, parse_filter


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"x": 1e400}', "x"),
        ('{"x": -1e400}', "x"),
        ('{"a": {"b": [1, NaN]}}', "a.b[1]"),
        ('{"x": Infinity}', "x"),
        ('{"x": -Infinity}', "x"),
        ('{"x": "\\ud800"}', "x"),
        ('{"x": ["ok", "\\udfff tail"]}', "x[1]"),
        ('{"x": "a\\u0000b"}', "x"),
        ('{"x": {"\\u0000": 1}}', "x"),
        ('{"x": ' + "9" * 5000 + "}", "x"),
        ('{"x": 0.' + "1" * 200 + "}", "x"),
    ],
)
def test_json_bodies_jsonb_cannot_store_are_refused_naming_the_field(raw: str, field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        loads(raw.encode())
    assert caught.value.field == field, caught.value.message


def test_json_that_jsonb_can_store_passes_unchanged() -> None:
    raw = '{"x": [1, 2.5, -3e10, "\\u00e9\\ud83d\\ude00", "\\\\u0000 is text", null, true], "n": ' + "9" * 100 + "}"
    data = loads(raw.encode())
    assert data["x"][3] == "é😀"
    assert data["x"][4] == "\\u0000 is text"  # an escaped backslash, not a NUL
    assert data["n"] == int("9" * 100)


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"{", b"[" * 100_000, b'{"a": 1} trailing'])
def test_malformed_json_is_invalid_input(raw: bytes) -> None:
    with pytest.raises(InvalidInput, match=r"not valid JSON|nested too deeply"):
        loads(raw)


def test_deep_nesting_is_refused() -> None:
    with pytest.raises(InvalidInput, match="nested too deeply"):
        check_json(eval("[" * 70 + "]" * 70))


NON_ASCII_DIGITS = ["\u00b2", "\u0663", "\uff11"]
NOT_WHOLE = [*NON_ASCII_DIGITS, "1_000", " ", "", "+5", "0x10", "1e3", "9" * 20, "9" * 5000, "12\n3", "-1", "0"]


@pytest.mark.parametrize("text", NOT_WHOLE)
def test_whole_numbers_are_ascii_digits_in_range(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_whole(text, "id")


def test_whole_numbers_accept_the_bigint_range() -> None:
    assert parse_whole("1", "id") == 1
    assert parse_whole(" 42 ", "id") == 42
    assert parse_whole(str(2**63 - 1), "id") == 2**63 - 1
    with pytest.raises(InvalidInput):
        parse_whole(str(2**63), "id")


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400", "1_0", "\u0661", "", "0", "-3", "10001", "1" * 200])
def test_numbers_are_finite_ascii_decimals_in_range(text: str) -> None:
    with pytest.raises(InvalidInput):
        parse_number(text, "rate", low=0, high=10_000)


def test_numbers_parse() -> None:
    assert parse_number("7.5", "rate", low=0, high=10_000) == 7.5
    assert parse_number(".5", "rate", low=0, high=10_000) == 0.5
    assert parse_number("1e3", "rate", low=0, high=10_000) == 1000.0


@pytest.mark.parametrize(
    "value",
    [
        "0001-01-01T00:00:00+15:00",  # a BC timestamp in UTC
        "9999-12-31T23:00:00-15:00",  # year 10000 in UTC: psycopg cannot read it back
        "1969-12-31T23:59:59Z",
        "3000-01-01T00:00:00Z",
        "2030-01-01T00:00:00",  # no time zone
        "2030-13-01T00:00:00Z",
        "2030-01-01T00:00:00+24:00",
        "2030-01-01T00:00:00+99:00",
        "\uff12\uff10\uff13\uff10-01-01T00:00:00Z",  # fullwidth digits
        "tomorrow",
        20300101,
        "",
    ],
)
def test_dates_must_be_representable_and_sane(value: Any) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_when(value, "run_after")
    assert caught.value.field == "run_after"


def test_dates_come_back_in_utc() -> None:
    assert parse_when("2030-01-01T10:00:00+02:00", "run_after") == dt.datetime(2030, 1, 1, 8, tzinfo=dt.timezone.utc)
    assert parse_when("2999-12-31T23:59:59Z", "run_after").year == 2999


# Forms Python 3.11+'s datetime.fromisoformat reads and 3.10's refuses: every date-time a client
# sends (run_after, bulk filters, a schedule page's "before") is read alike on every Python.
ONLY_311_FORMS = [
    "20300101T100000Z",  # basic format
    "20300101T100000+0200",
    "2030-W01-1T10:00:00Z",  # a week date
    "2030-01-01T10Z",  # a bare hour
    "2030-01-01T10:00:00.1234567Z",  # more than 6 digits of fraction
]


@pytest.mark.parametrize("value", ONLY_311_FORMS)
def test_date_times_are_read_alike_on_every_python(value: str) -> None:
    with pytest.raises(ValueError, match="not an ISO 8601 date-time"):
        parse_iso_datetime(value)
    with pytest.raises(InvalidInput):
        parse_when(value, "run_after")
    with pytest.raises(BulkFilterError, match="not an ISO 8601 date-time"):
        parse_filter("retry", {"enqueued_after": value})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        # "Z" is what most clients write; Python 3.10's fromisoformat refuses it.
        ("2030-01-01T10:00:00Z", dt.datetime(2030, 1, 1, 10, tzinfo=dt.timezone.utc)),
        ("2030-01-01 10:00+02:00", dt.datetime(2030, 1, 1, 8, tzinfo=dt.timezone.utc)),
        # 3.10 reads 3 or 6 digits of fraction only.
        ("2030-01-01T10:00:00.5Z", dt.datetime(2030, 1, 1, 10, 0, 0, 500_000, tzinfo=dt.timezone.utc)),
        ("2030-01-01T10:00:00-00:00:30.500000", dt.datetime(2030, 1, 1, 10, 0, 30, 500_000, tzinfo=dt.timezone.utc)),
    ],
)
def test_extended_format_date_times_are_read_on_every_python(value: str, expected: dt.datetime) -> None:
    assert parse_iso_datetime(value) == expected
    assert parse_when(value, "run_after") == expected


def test_text_is_storable_and_bounded() -> None:
    assert clean_text("ok", "queue") == "ok"
    for bad in ("", "   ", "a\x00b", "\ud800", "x" * 101, 5, None):
        with pytest.raises(InvalidInput):
            clean_text(bad, "queue", max_length=100)


def test_query_parameters_are_checked_key_and_value() -> None:
    check_params({"q": "fine", "before": "12"})
    for bad in ({"q": "a\x00"}, {"\x00": "x"}, {"q": "x" * 1001}, {"q": "\udc80"}):
        with pytest.raises(InvalidInput):
            check_params(bad)


def test_token_scopes() -> None:
    tokens = parse_tokens(["plain", "scoped:tasks.view_task+tasks.change_task", "all:*", " "])
    assert tokens == {"plain": None, "scoped": frozenset({"tasks.view_task", "tasks.change_task"}), "all": None}
    assert parse_tokens({"t": ["leasing.view_lease"]}) == {"t": frozenset({"leasing.view_lease"})}
    scoped = Caller("token", scopes=tokens["scoped"])
    assert scoped.has_perms(["tasks.view_task"]) and not scoped.has_perms(["tasks.add_task"])
    assert Caller("token").has_perms(["tasks.add_task", "leasing.change_lease"])
    with pytest.raises(ImproperlyConfigured, match="unknown scope"):
        parse_tokens(["t:tasks.view_tsk"])


def test_secret_key_file_is_born_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With umask 0 a file created by write_text() would be 0644 until a chmod; the key file must
    # never exist with a wider mode, so creating it may not rely on chmod at all.
    def no_chmod(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the key file must be created 0600, not chmod-ed afterwards")

    monkeypatch.setattr(os, "chmod", no_chmod)
    monkeypatch.setattr(Path, "chmod", no_chmod)
    old_umask = os.umask(0)
    try:
        key = secret_key_from_file(tmp_path / ".secret_key")
    finally:
        os.umask(old_umask)
    path = tmp_path / ".secret_key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(key) >= 50
    assert secret_key_from_file(path) == key  # kept, not regenerated
    assert [p.name for p in tmp_path.iterdir()] == [".secret_key"]  # no temporary file left behind
