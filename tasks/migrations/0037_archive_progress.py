"""The mover's progress per final status (issue 43; tasks/maintenance/archive.py): how far it has
come, so ``/metrics`` can say how far behind it is (``tasks_archive_behind_seconds``, the alert
``TasksArchiveBehind``) from three rows, not from a read of tasks_task that would step over every
retained workflow member."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0036_finished_tasks_page_indexes"),
    ]

    operations = [
        migrations.CreateModel(
            name="ArchiveProgress",
            fields=[
                ("status", models.CharField(max_length=12, primary_key=True, serialize=False)),
                (
                    "moved_until",
                    models.DateTimeField(help_text="Every plain task of the status finished before this has moved."),
                ),
                (
                    "recorded_at",
                    models.DateTimeField(help_text="When the mover last wrote this row (the database clock)."),
                ),
                ("moved", models.BigIntegerField(default=0, help_text="Rows of the status moved (ever).")),
            ],
            options={
                "ordering": ["status"],
            },
        ),
    ]
