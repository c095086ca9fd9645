# Issue 25: OpenTelemetry tracing (tasks/tracing.py). The enqueuing span's context on the row, NULL
# while tracing is off. A nullable column without a default: added to the catalog only (no rewrite).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tasks', '0021_activity_rollup'),
    ]

    operations = [
        migrations.AddField(
            model_name='task',
            name='trace_context',
            field=models.JSONField(blank=True, editable=False, help_text="The enqueuing span's context (traceparent, tracestate) when tracing was on (tasks/tracing.py).", null=True),
        ),
    ]
