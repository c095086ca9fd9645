"""Stored schedules' revisions come from one sequence: every write takes the next value, so a
revision is never given twice, not even to a schedule deleted and stored again under its name (a
PUT or PATCH made with the deleted schedule's revision finds no row at it: a 409, nothing written).
Until now each schedule counted 1, 2, 3 ... and a new one under an old name started at 1 again."""

from django.db import migrations

FORWARD = """
CREATE SEQUENCE tasks_storedschedule_revision_seq AS bigint;
SELECT setval('tasks_storedschedule_revision_seq', GREATEST((SELECT max(revision) FROM tasks_storedschedule), 1));
"""
BACKWARD = "DROP SEQUENCE tasks_storedschedule_revision_seq;"


class Migration(migrations.Migration):
    dependencies = [("tasks", "0032_help_texts_by_label")]

    operations = [migrations.RunSQL(FORWARD, BACKWARD)]
