"""Page indexes on ``tasks_finished`` (issue 43; docs/explanation/finished-storage.md, "Lists").

The dashboard's lists, the JSON API's listing and the admin read finished tasks from both tables,
newest first (tasks/web/queries.py, ``Listing``). On ``tasks_finished`` its primary key
``(id, status, finished_at)`` gives a status's unfiltered page (a backward scan of each day, merged);
a page filtered by queue or task path, and a search by dedup key or holder (the worker), are each
read from an index of their own here, ``(column, id)``: each day's scan starts at the page's first
row, so a page costs the days kept, never the rows in them. The other filters (the keys no page index
holds, the enqueue time range, an argument search) are checked within the lists' bounded window, as
on the hot table.

Created on the partitioned table, so each day's partition gets its own (and each day created after,
by ``ATTACH PARTITION``, before it holds a row). ``CREATE INDEX`` on a partitioned table cannot run
``CONCURRENTLY``: it holds off the mover's inserts while it builds; with the mover off (the default)
the table is empty and this is instant."""

from django.db import migrations

INDEXES = {
    "tasks_finished_queue_idx": "(queue, id)",
    "tasks_finished_task_path_idx": "(task_path, id)",
    "tasks_finished_dedup_key_idx": "(dedup_key, id) WHERE dedup_key IS NOT NULL",
    "tasks_finished_holder_idx": "(holder, id) WHERE holder IS NOT NULL",
}

FORWARD = "\n".join(f"CREATE INDEX {name} ON tasks_finished {how};" for name, how in INDEXES.items())
BACKWARD = "\n".join(f"DROP INDEX {name};" for name in INDEXES)


class Migration(migrations.Migration):
    dependencies = [("tasks", "0035_finished_tasks_by_status")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
