# Written by hand. Built and dropped concurrently (as 0042), so workers keep claiming and finishing
# while it runs. If the build fails, PostgreSQL leaves an INVALID index: DROP INDEX CONCURRENTLY
# tasks_task_retry_idx, migrate again.
#
# A task snoozed by its handler after a failure is shown as snoozed, not retrying (one state a task:
# tasks.lifecycle.vocabulary.state_of), so the retrying list and count leave snoozed rows out. Their
# index (tasks_task_retrying_idx, READY rows that failed before) held them: the list and the count
# would step over every one of them. tasks_task_retry_idx leaves them out.

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ("tasks", "0042_fewer_index_entries"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="task",
            index=models.Index(
                models.OrderBy(models.F("id"), descending=True),
                condition=models.Q(
                    ("snoozed_at__isnull", True),
                    ("status", "READY"),
                    models.Q(("failures__gt", 0), ("crashes__gt", 0), ("shared_crashes__gt", 0), _connector="OR"),
                ),
                name="tasks_task_retry_idx",
            ),
        ),
        RemoveIndexConcurrently(model_name="task", name="tasks_task_retrying_idx"),
    ]
