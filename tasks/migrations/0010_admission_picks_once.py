# The admission of a concurrency key (0009's tasks_concurrency_admit) picks the key's waiting tasks with
# LIMIT free-slots FOR UPDATE SKIP LOCKED, joined as a subquery. Planned as the inner side of a nested
# loop (statistics that say tasks_task is empty lead there), the pick ran again for every row and
# admitted every waiting task of the key past its limit. The pick is now an ARRAY(...) InitPlan, run
# once (tasks/lifecycle/statements.py, _PICK_ONE, says why; tests/db/test_pick_once.py). Only that statement of
# the function changes; the rest is 0009's text.

import importlib

from django.db import migrations

_0009 = importlib.import_module("tasks.migrations.0009_concurrency_keys")

_START = "CREATE FUNCTION tasks_concurrency_admit("
_END = "END $$;"
_begin = _0009.TRIGGERS_SQL.index(_START)
ADMIT_0009 = _0009.TRIGGERS_SQL[_begin : _0009.TRIGGERS_SQL.index(_END, _begin) + len(_END)]

JOINED_PICK = """    UPDATE tasks_task AS t SET status = 'READY'
    FROM (
        SELECT id FROM tasks_task
        WHERE status = 'BLOCKED' AND concurrency_key = k AND run_after <= clock_timestamp()
        ORDER BY priority DESC, run_after, id
        LIMIT cap - held
        FOR UPDATE SKIP LOCKED
    ) AS picked
    WHERE t.id = picked.id;"""
PICK_ONCE = """    UPDATE tasks_task AS t SET status = 'READY'
    WHERE t.id = ANY(ARRAY(
        SELECT id FROM tasks_task
        WHERE status = 'BLOCKED' AND concurrency_key = k AND run_after <= clock_timestamp()
        ORDER BY priority DESC, run_after, id
        LIMIT cap - held
        FOR UPDATE SKIP LOCKED
    ));"""
assert ADMIT_0009.count(JOINED_PICK) == 1, "0009's admission statement is not the one this migration replaces"

FORWARD = ADMIT_0009.replace(JOINED_PICK, PICK_ONCE).replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
BACKWARD = ADMIT_0009.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0009_concurrency_keys"),
    ]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
