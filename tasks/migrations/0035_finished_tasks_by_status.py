"""``tasks_finished`` partitioned by final status, then by day (issue 43; docs/explanation/finished-storage.md).

0034 partitioned it by day alone; but retention keeps each final status its own time (7 days of
successes, 30 of failures by default), and a day holding every status could then only be dropped when
its longest-kept status allows, the others deleted row by row before that: what the table exists to
avoid. Now its first level is a list partition per final status (``tasks_finished_successful``,
``_failed``, ``_cancelled``), each range-partitioned by ``finished_at``, one partition per UTC day
(``tasks_finished_successful_YYYYMMDD``), created ahead and retired whole by
tasks/maintenance/partitions.py. The primary key is ``(id, status, finished_at)``: PostgreSQL requires
each level's partition key in it. Still no default partition at either level.

Nothing writes to the table before this migration (0034's table is empty unless rows were put there by
hand): the migration refuses to run if it holds any row rather than drop it."""

from django.db import migrations

FORWARD = """
DO $$
BEGIN
    IF EXISTS (SELECT FROM tasks_finished) THEN
        RAISE EXCEPTION 'tasks_finished holds rows: move them aside before migrating (nothing in django-leasing writes there yet)';
    END IF;
END $$;
DROP TABLE tasks_finished;
CREATE TABLE tasks_finished (LIKE tasks_task INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY LIST (status);
ALTER TABLE tasks_finished ALTER COLUMN finished_at SET NOT NULL, ADD PRIMARY KEY (id, status, finished_at);
CREATE TABLE tasks_finished_successful PARTITION OF tasks_finished
    FOR VALUES IN ('SUCCESSFUL') PARTITION BY RANGE (finished_at);
CREATE TABLE tasks_finished_failed PARTITION OF tasks_finished
    FOR VALUES IN ('FAILED') PARTITION BY RANGE (finished_at);
CREATE TABLE tasks_finished_cancelled PARTITION OF tasks_finished
    FOR VALUES IN ('CANCELLED') PARTITION BY RANGE (finished_at);
"""
BACKWARD = """
DROP TABLE tasks_finished;
CREATE TABLE tasks_finished (LIKE tasks_task INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
    PARTITION BY RANGE (finished_at);
ALTER TABLE tasks_finished ALTER COLUMN finished_at SET NOT NULL, ADD PRIMARY KEY (id, finished_at);
"""


class Migration(migrations.Migration):
    dependencies = [("tasks", "0034_finished_tasks_table")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
