# Awaitable results (issue 40): a caller that waits for a task marks its row (finish_waited) and
# LISTENs on leasing_task_finished; the row's move to a final status then NOTIFYs the task's id. Only
# marked rows notify: the WHEN clause is evaluated in the executor for each updated row and queues
# nothing for the rest, so a task nobody waits for costs its finish nothing more (a NOTIFY takes a
# global lock at commit). A boolean with a constant default: adding it rewrites no row.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0029_rate_promised_until"),
    ]

    operations = [
        migrations.AddField(
            model_name="task",
            name="finish_waited",
            field=models.BooleanField(
                db_default=False,
                default=False,
                help_text="A caller waits for this task to finish: its final status NOTIFYs leasing_task_finished.",
            ),
        ),
        migrations.RunSQL(
            """
            CREATE FUNCTION tasks_task_notify_finished() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM pg_notify('leasing_task_finished', NEW.id::text);
                RETURN NULL;
            END $$;
            CREATE TRIGGER tasks_task_notify_finished AFTER UPDATE OF status ON tasks_task
                FOR EACH ROW
                WHEN (NEW.finish_waited AND NEW.status IN ('SUCCESSFUL', 'FAILED', 'CANCELLED')
                      AND OLD.status NOT IN ('SUCCESSFUL', 'FAILED', 'CANCELLED'))
                EXECUTE FUNCTION tasks_task_notify_finished();
            """,
            """
            DROP TRIGGER IF EXISTS tasks_task_notify_finished ON tasks_task;
            DROP FUNCTION IF EXISTS tasks_task_notify_finished();
            """,
        ),
    ]
