# Written by hand. Built and dropped concurrently (as 0042, 0043 and 0044), so workers keep claiming
# and finishing while it runs. If the build fails, PostgreSQL leaves an INVALID index: DROP INDEX
# CONCURRENTLY tasks_task_holder_state_idx, migrate again (backwards, the same with
# tasks_task_holder_newest_idx). A concurrent build waits for every transaction older than it, an old
# snapshot held open by someone else included; an INVALID index is still written by every change.
#
# The index of a holder's tasks (holder, status, id DESC) leaves the RUNNING rows out, as the status
# index does since 0044: a worker's running rows are a part of the running set, read through
# tasks_task_running_exp_idx. A claim and every renewal of a lease (each a new row version, its lease
# expiry being indexed) wrote an entry to it: one index entry less at each (issue 59).

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ("tasks", "0044_state_idx_without_running"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="task",
            index=models.Index(
                models.F("holder"),
                models.F("status"),
                models.F("id").desc(),
                condition=models.Q(holder__isnull=False) & ~models.Q(status="RUNNING"),
                name="tasks_task_holder_state_idx",
            ),
        ),
        RemoveIndexConcurrently(model_name="task", name="tasks_task_holder_newest_idx"),
    ]
