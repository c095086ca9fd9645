"""``tasks_finished``: where finished tasks will be kept once the maintenance leader moves them out of
``tasks_task`` (issue 43; docs/explanation/finished-storage.md). The columns of ``tasks_task``, in its
order; primary key ``(id, finished_at)``; range-partitioned by ``finished_at``, one partition per UTC
day, created and dropped by tasks/maintenance/partitions.py (``manage.py tasks_partitions``). No
default partition: a row of a day with no partition is refused (nothing is moved for that day) rather
than kept where ``DETACH PARTITION ... CONCURRENTLY`` could no longer retire days. Nothing writes to
it yet."""

from django.db import migrations

FORWARD = """
CREATE TABLE tasks_finished (LIKE tasks_task INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (finished_at);
ALTER TABLE tasks_finished ALTER COLUMN finished_at SET NOT NULL, ADD PRIMARY KEY (id, finished_at);
"""
BACKWARD = "DROP TABLE tasks_finished;"


class Migration(migrations.Migration):
    dependencies = [("tasks", "0033_schedule_revisions_from_a_sequence")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
