# Written by hand (issue 59: the index entries a task writes). Built and dropped concurrently (as
# 0008), so workers keep claiming and finishing while it runs. If the build fails, PostgreSQL leaves an
# INVALID index: DROP INDEX CONCURRENTLY tasks_task_running_unheld_idx, migrate again.
#
# - tasks_task_running_holder_idx (holder, of RUNNING rows) goes: a worker's running rows are the range
#   (holder, 'RUNNING') of tasks_task_holder_newest_idx (holder, status, id DESC), and the running set
#   as a whole is tasks_task_running_exp_idx. A claim and each renewal write one index entry less.
#   The stuck list's third arm (running and held by nobody: normally no row) gets an index of its own,
#   tasks_task_running_unheld_idx, built first (concurrently): empty, it costs a claim nothing, and
#   the list reads the stuck rows, not every running one.
# - tasks_task_finished_idx (finished_at) goes: every read of finished rows by time reads
#   tasks_task_prune_idx (status, finished_at, id), one range per final status. A finish writes one
#   index entry less.

from django.contrib.postgres.operations import AddIndexConcurrently, RemoveIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ("tasks", "0041_task_awaited_by"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="task",
            index=models.Index(
                condition=models.Q(("holder__isnull", True), ("status", "RUNNING")),
                fields=["id"],
                name="tasks_task_running_unheld_idx",
            ),
        ),
        RemoveIndexConcurrently(model_name="task", name="tasks_task_running_holder_idx"),
        RemoveIndexConcurrently(model_name="task", name="tasks_task_finished_idx"),
    ]
