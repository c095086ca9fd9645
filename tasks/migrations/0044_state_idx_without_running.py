# Written by hand. Built and dropped concurrently (as 0042 and 0043), so workers keep claiming and
# finishing while it runs. If the build fails, PostgreSQL leaves an INVALID index: DROP INDEX
# CONCURRENTLY tasks_task_state_idx, migrate again.
#
# The dashboard's index of tasks by status (status, id DESC) leaves the RUNNING rows out: they are a
# set bounded by the workers, read from the running indexes (tasks_task_running_exp_idx,
# tasks_task_holder_newest_idx). A claim and every renewal of a lease (each a new row version, its
# lease expiry being indexed) wrote an entry to it: one index entry less at each (issue 59).

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ("tasks", "0043_retrying_without_snoozed"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="task",
            index=models.Index(
                fields=["status", "-id"],
                condition=~models.Q(status="RUNNING"),
                name="tasks_task_state_idx",
            ),
        ),
        RemoveIndexConcurrently(model_name="task", name="tasks_task_status_idx"),
    ]
