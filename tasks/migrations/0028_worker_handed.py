# The attempts a worker has handed to its executors, named on its own row by the round statement
# before any of them can start (tasks/worker/handoff.py): recovery counts an attempt named there as one
# that may have run, never as a claim returned unstarted (issue 38, invariant 14). A plain column, no
# index: recovery reads it by the worker's primary key.

from django.db import migrations

import tasks.models.worker


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0027_workflow_settle_serialised"),
    ]

    operations = [
        migrations.AddField(
            model_name="worker",
            name="handed",
            field=tasks.models.worker.Tokens(
                blank=True,
                editable=False,
                help_text="Tokens of the attempts it handed to its executors whose start is not recorded on their"
                " row yet: recovery counts them as attempts that may have run (tasks/worker/handoff.py).",
                null=True,
            ),
        ),
    ]
