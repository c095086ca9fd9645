"""Child tasks a task waits for (issue 58; tasks/steps.py ``spawn`` and ``wait_for_task``).

``awaited_by`` names the task that spawned this one. When the child's status becomes final, in the
very statement that makes it so (a worker's finish, a cancel, a bulk operation, a workflow's cancel,
recovery failing it for good), a row trigger stores its outcome as the event ``task:<child id>`` of
that task, the first outcome winning as any event's first payload does. A parent suspended on it is
made due there and then, unless another session holds its row (``SKIP LOCKED``: a trigger that waited
for a row lock here could deadlock with a bulk statement locking the two rows the other way); then
the event is left undelivered, and the recovery round's EVENTS_WAKE_SQL wakes the parent once it no
longer runs, as it does for an event sent to a running task. As for any send (EVENT_SEND_SQL), the
outcome is stored only for a parent that is an unfinished row of tasks_task: one that has ended, been
moved to tasks_finished or deleted reads no more events, and a row stored for it would outlive it.

The trigger's WHEN clause is evaluated in C as a row is updated: for a task nobody awaits it is false
at its first term, no row event is queued and no function runs. The finished table takes the column
too: its columns stay in the order of tasks_task's, which the mover and a restore copy by position.
"""

from django.db import migrations, models

FORWARD_SQL = """
ALTER TABLE tasks_finished ADD COLUMN awaited_by bigint;

CREATE FUNCTION tasks_report_to_parent() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    event_name text := 'task:' || NEW.id;
    woken boolean;
BEGIN
    UPDATE tasks_task AS t SET run_after = LEAST(t.run_after, statement_timestamp())
    WHERE t.id = (SELECT p.id FROM tasks_task AS p WHERE p.id = NEW.awaited_by FOR UPDATE SKIP LOCKED)
      AND t.status IN ('READY', 'BLOCKED')
      AND EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'wait:' || event_name)
      AND NOT EXISTS (SELECT FROM tasks_taskstep AS s WHERE s.task_id = t.id AND s.name = 'event:' || event_name);
    woken := FOUND;
    INSERT INTO tasks_taskevent (task_id, name, payload, sent_at, delivered)
    SELECT p.id, event_name,
           jsonb_build_object('status', NEW.status, 'result', NEW.return_value, 'error', NEW.errors -> -1),
           clock_timestamp(), woken
    FROM tasks_task AS p
    WHERE p.id = NEW.awaited_by AND p.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
    ON CONFLICT (task_id, name) DO NOTHING;
    RETURN NULL;
END $$;

CREATE TRIGGER tasks_task_report_to_parent AFTER UPDATE ON tasks_task
    FOR EACH ROW WHEN (NEW.awaited_by IS NOT NULL
                       AND NEW.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
                       AND OLD.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))
    EXECUTE FUNCTION tasks_report_to_parent();
"""

BACKWARD_SQL = """
DROP TRIGGER tasks_task_report_to_parent ON tasks_task;
DROP FUNCTION tasks_report_to_parent();
ALTER TABLE tasks_finished DROP COLUMN awaited_by;
"""


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0040_taskevent"),
    ]

    operations = [
        migrations.AddField(
            model_name="task",
            name="awaited_by",
            field=models.BigIntegerField(
                blank=True,
                help_text="The task that spawned this one (tasks.steps.spawn): when this one ends, its outcome is "
                "sent to that task as the event task:<id> (a trigger, tasks/migrations/0041_task_awaited_by.py).",
                null=True,
            ),
        ),
        migrations.RunSQL(FORWARD_SQL, BACKWARD_SQL),
    ]
