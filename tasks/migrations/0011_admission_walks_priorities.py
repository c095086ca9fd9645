# The admission of a concurrency key picks its due waiting tasks in claim order (priority DESC, run_after,
# id) through tasks_task_blocked_idx (concurrency_key, priority DESC, run_after, id) WHERE status =
# 'BLOCKED'. Two things made it read every deferred waiting task of the key (a retry backing off waits
# BLOCKED, so there can be many): ``run_after <= clock_timestamp()`` is volatile, so it was checked on
# each heap row instead of bounding the index scan; and one ordered scan meets a higher priority's
# deferred rows before a lower priority's due ones (PostgreSQL 18's skip scan jumps over them, 13-17
# have none). The clock is now read once, just before the pick, into ``due_by`` (a value the index
# can use), and the pick walks the key's priorities itself, as the claim does (tasks/lifecycle/statements.py,
# _PICK_ONE, says why and what it costs); still one ARRAY(...) InitPlan, run once (0010). Only that
# statement of the function and its new variable change; the rest is 0009's text.

import importlib

from django.db import migrations

_0010 = importlib.import_module("tasks.migrations.0010_admission_picks_once")

DECLARED = "    admitted integer;\n"
WALKING_PICK = """    due_by := clock_timestamp();
    UPDATE tasks_task AS t SET status = 'READY'
    WHERE t.id = ANY(ARRAY(
        WITH RECURSIVE levels(priority) AS (
            (SELECT b.priority FROM tasks_task AS b
             WHERE b.status = 'BLOCKED' AND b.concurrency_key = k
             ORDER BY b.priority DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT b.priority FROM tasks_task AS b
                    WHERE b.status = 'BLOCKED' AND b.concurrency_key = k AND b.priority < levels.priority
                    ORDER BY b.priority DESC LIMIT 1)
            FROM levels WHERE levels.priority IS NOT NULL
        )
        SELECT due.id FROM levels CROSS JOIN LATERAL (
            SELECT b.id FROM tasks_task AS b
            WHERE b.status = 'BLOCKED' AND b.concurrency_key = k AND b.priority = levels.priority
              AND b.run_after <= due_by
            ORDER BY b.run_after, b.id
            LIMIT cap - held
            FOR UPDATE SKIP LOCKED
        ) AS due
        LIMIT cap - held
    ));"""
assert _0010.FORWARD.count(_0010.PICK_ONCE) == 1, "0010's admission statement is not the one this migration replaces"
assert _0010.FORWARD.count(DECLARED) == 1

FORWARD = _0010.FORWARD.replace(_0010.PICK_ONCE, WALKING_PICK).replace(
    DECLARED, DECLARED + "    due_by timestamptz;\n", 1
)
BACKWARD = _0010.FORWARD


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0010_admission_picks_once"),
    ]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
