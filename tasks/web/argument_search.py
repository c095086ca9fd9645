"""Search by arguments: ``kwargs:{"customer": 7}`` or ``args:[7]`` finds the tasks whose keyword (or
positional) arguments contain that JSON (jsonb containment, ``@>``), served by an opt-in GIN index
(``jsonb_path_ops``) per column that ``manage.py tasks_search_index create`` builds.

Opt-in because every enqueue then writes a GIN entry per key and value of its arguments (the figures:
docs/howto/operations.md). Without the index the search is refused with a message saying how to
enable it, rather than scanning the table (invariant 12). With it, a search page reads the GIN
entries of the term (a bitmap of the matching rows) and sorts the newest page out of them: its cost
grows with the rows that match the term, not with the table (bench/pages.py, "argument search").
"""

from __future__ import annotations

import json
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Q

from leasing.validation import InvalidInput
from tasks import redaction
from tasks.lifecycle.storable import is_storable

#: column -> the index that serves its containment searches.
INDEXES = {"kwargs": "tasks_task_kwargs_search_idx", "args": "tasks_task_args_search_idx"}
#: Bytes of a search term's JSON: a search term, not a payload.
MAX_TERM = 1000

# CONCURRENTLY: the table stays writable while the index is built (it is never done inside a
# transaction, hence not in a migration: a migration runs in one). IF NOT EXISTS: a rerun is harmless.
# A build that failed leaves an invalid index, which ``present`` does not count and ``drop`` removes.
CREATE_INDEX_SQL = "CREATE INDEX CONCURRENTLY IF NOT EXISTS {index} ON tasks_task USING gin ({column} jsonb_path_ops)"
# The operator's removal of a search index: CONCURRENTLY, so writes go on meanwhile; IF EXISTS, so a
# second drop (or one of an index never built) is harmless.
DROP_INDEX_SQL = "DROP INDEX CONCURRENTLY IF EXISTS {index}"
# Which of the indexes exist and are valid (a build interrupted leaves one invalid: the planner cannot use it).
PRESENT_SQL = """
SELECT c.relname FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE c.relname = ANY(%s) AND i.indisvalid AND i.indrelid = 'tasks_task'::regclass
"""


def present(using: str = DEFAULT_DB_ALIAS) -> set[str]:
    """The columns whose search index exists and is valid."""
    with connections[using].cursor() as cursor:
        cursor.execute(PRESENT_SQL, [list(INDEXES.values())])
        found = {row[0] for row in cursor.fetchall()}
    return {column for column, index in INDEXES.items() if index in found}


def _has_a_value(value: Any) -> bool:
    """Whether ``value`` holds a scalar somewhere (null included). A jsonb_path_ops index has entries
    for paths to scalars only: a term of empty objects and arrays gives the index nothing to look up,
    and the search would read all of it, so every row."""
    if isinstance(value, dict):
        return any(_has_a_value(item) for item in value.values())
    if isinstance(value, list):
        return any(_has_a_value(item) for item in value)
    return True


def parse_term(term: str) -> tuple[str, Any] | None:
    """(column, JSON value) of an argument search term, None when the term is not one. Raises
    InvalidInput for a term that is one but malformed."""
    column, colon, text = term.partition(":")
    column = column.strip().lower()
    if not colon or column not in INDEXES:
        return None
    shape = dict if column == "kwargs" else list
    example = '{"customer": 7}' if column == "kwargs" else "[7]"
    try:
        value = json.loads(text) if len(text) <= MAX_TERM else None
    except ValueError:
        value = None
    if not isinstance(value, shape) or not _has_a_value(value) or not is_storable(value):
        raise InvalidInput(
            f"{column}: takes a JSON {shape.__name__.replace('dict', 'object').replace('list', 'array')}"
            f" holding a value, of at most {MAX_TERM} characters, e.g. {column}:{example}",
            "q",
        )
    return column, value


def argument_lookup(term: str, using: str = DEFAULT_DB_ALIAS) -> Q | None:
    """The containment lookup of an argument search term (None: the term is not one). Raises
    InvalidInput when the term is malformed or its index is not there."""
    parsed = parse_term(term)
    if parsed is None:
        return None
    column, value = parsed
    if redaction.hides_part_of(**{column: value}):
        # Its results would tell whether a hidden value is the one guessed (tasks/redaction.py).
        raise InvalidInput(
            f"{column}: this search names an argument that LEASING_TASKS['REDACT_ARGUMENTS'] hides;"
            " search by the arguments that are shown",
            "q",
        )
    if column not in present(using):
        raise InvalidInput(
            f"searching {column} needs its opt-in index (it would otherwise read the whole table):"
            " run `manage.py tasks_search_index create` (docs/howto/operations.md)",
            "q",
        )
    return Q(**{f"{column}__contains": value})
