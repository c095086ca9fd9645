"""What the dispatcher's thread no longer pays per round (tasks/lifecycle/prepared.py): the hot
statements' placeholders converted once per text, arrays sent as literals written in one join,
timestamps loaded by psycopg's C loader, claimed rows built without a frozen __init__. Each must give
exactly what psycopg's own path gave."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from typing import Any

import psycopg
import pytest
from django.db import connection
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg._queries import PostgresQuery

from tasks.lifecycle import prepared
from tasks.lifecycle import statements as sql
from tasks.lifecycle.values import ClaimedTask, claimed_from_row
from tasks.models import Task

pytestmark = pytest.mark.django_db

HOT_STATEMENTS = [
    *sql.CLAIM_SQL,
    *sql.FINISH_AND_CLAIM_SQL,
    *sql.FINISH_START_CLAIM_SQL,
    sql.FAIR_CLAIM_SQL,
    sql.FAIR_FINISH_AND_CLAIM_SQL,
    sql.FAIR_FINISH_START_CLAIM_SQL,
    sql.COMPLETE_SQL,
    sql.HEARTBEAT_SQL,
    sql.START_SQL,
    sql.ENQUEUE_SQL,
]


def raw() -> psycopg.Connection:
    connection.ensure_connection()
    return connection.connection


@pytest.mark.parametrize("statement", HOT_STATEMENTS)
def test_a_long_statement_is_converted_once_and_as_psycopg_converts_it(statement):
    cursor = prepared._cursor(raw())
    params = dict.fromkeys(_placeholders(statement), 1)
    ours = prepared._ConstantQuery(cursor._tx)
    ours.convert(statement, params)
    theirs = PostgresQuery(cursor._tx)
    theirs.convert(statement, params)
    assert ours.query == theirs.query
    assert ours._order == theirs._order
    assert ours.params is not None and theirs.params is not None
    assert list(ours.params) == list(theirs.params)
    hits = prepared._converted.cache_info().hits
    again = prepared._ConstantQuery(cursor._tx)
    again.convert(statement, params)
    assert prepared._converted.cache_info().hits == hits + 1
    assert again.query is ours.query  # the cached bytes, not a new parse


def _placeholders(statement: str) -> list[str]:
    return sorted(set(re.findall(r"%\((\w+)\)s", statement)))


def _round_trip(value, cast: str):
    with prepared._cursor(raw()) as cursor:
        cursor.execute(f"SELECT %(v)s::{cast}", {"v": prepared._array(value)})
        row = cursor.fetchone()
        assert row is not None
        return row[0]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), min_size=1, max_size=40))
def test_int_arrays_arrive_as_sent(values):
    assert type(prepared._array(values)) is prepared._Int8Array
    assert _round_trip(values, "bigint[]") == values


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(st.none(), st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"))),
        min_size=1,
        max_size=20,
    )
)
def test_text_arrays_arrive_as_sent(values):
    literal = prepared._array(values)
    if all(v is None for v in values):
        assert literal is values  # no element says which type: psycopg's own dumper decides
        return
    assert type(literal) is prepared._TextArray
    assert _round_trip(values, "text[]") == values


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False)), min_size=1, max_size=20))
def test_float_arrays_arrive_as_sent(values):
    literal = prepared._array(values)
    if all(v is None for v in values):
        assert literal is values
        return
    assert type(literal) is prepared._Float8Array
    got = _round_trip(values, "float8[]")
    assert got == values
    assert [math.copysign(1, v) for v in got if v is not None] == [math.copysign(1, v) for v in values if v is not None]


def test_json_texts_arrive_as_the_same_jsonb():
    values = ['{"a": [1, "\\"q\\"", "back\\\\slash"]}', "null", '"\\u00e9t\\u00e9"', "[]"]
    got = _round_trip(values, "jsonb[]")  # Django's jsonb loader gives the text: parse it
    assert [json.loads(v) for v in got] == [{"a": [1, '"q"', "back\\slash"]}, None, "été", []]


@pytest.mark.parametrize(
    "values",
    [[], [True, False], [1, True], [1, 2.5], [float("nan")], [float("inf"), 1.0], [None], [dt.date(2020, 1, 1)]],
    ids=["empty", "bools", "int-and-bool", "mixed-numbers", "nan", "infinity", "all-none", "dates"],
)
def test_what_is_not_a_plain_array_of_one_kind_is_left_to_psycopg(values):
    assert prepared._array(values) is values


def test_timestamps_come_back_as_django_loads_them():
    query = "SELECT clock_timestamp(), '2020-02-29 23:59:59.999999+05:30'::timestamptz, NULL::timestamptz"
    with connection.cursor() as cursor:
        cursor.execute(query)
        djangos = cursor.fetchone()
    ours = prepared.rows(connection, query, {})[0]
    assert ours[1] == djangos[1] and ours[1].utcoffset() == djangos[1].utcoffset() == dt.timedelta(0)
    assert ours[1].tzinfo == djangos[1].tzinfo
    assert ours[2] is None
    assert ours[0].tzinfo is not None and abs(ours[0] - djangos[0]) < dt.timedelta(minutes=1)


def test_a_claimed_row_builds_the_same_frozen_value_with_its_own_empty_containers():
    Task.objects.enqueue("tests.testapp.handlers.noop")
    Task.objects.enqueue("tests.testapp.handlers.noop", args=[1, {"x": "y"}], kwargs={"k": [None]})
    claimed = Task.objects.claim("w-fast", limit=2, queues=["default"])
    by_args = {bool(task.args): task for task in claimed}
    plain, rich = by_args[False], by_args[True]
    assert (plain.args, plain.kwargs, plain.worker_ids) == ([], {}, [])
    assert (rich.args, rich.kwargs) == ([1, {"x": "y"}], {"k": [None]})
    with pytest.raises(AttributeError):
        plain.args = [1]  # type: ignore[misc]
    row: tuple[Any, ...] = (1, 2, "p", "[]", "{}", 0, 3, None, plain.expires_at, None, "q", 0, plain.enqueued_at)
    row += ("[]", True, False, None, None, False, plain.run_after, '{"max_attempts": 2}')
    first, second = claimed_from_row(row), claimed_from_row(row)
    assert first == ClaimedTask(
        1, 2, "p", [], {}, 0, 3, None, plain.expires_at, None, "q", 0, plain.enqueued_at, [], True, False, None,
        None, False, plain.run_after, {"max_attempts": 2},
    )  # fmt: skip
    first.args.append("mine")
    assert second.args == []  # never one shared list
    assert claimed_from_row(row[:20]).retry_policy is None


def test_a_statement_without_rows_gives_none_and_one_with_an_empty_result_gives_none_either():
    task = Task.objects.enqueue("tests.testapp.handlers.noop")
    update = "UPDATE tasks_task SET priority = %(p)s::smallint WHERE id = %(id)s::bigint"
    assert prepared.rows(connection, update, {"p": 3, "id": task.id}) == []
    assert prepared.rows(connection, update + " RETURNING id", {"p": 4, "id": -1}) == []
    assert prepared.rows(connection, update + " RETURNING id, priority", {"p": 5, "id": task.id}) == [(task.id, 5)]
