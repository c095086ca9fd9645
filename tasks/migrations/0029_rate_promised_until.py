# Rate limits (issue 38, item 6): a task that comes back from its key's line before its start is free
# keeps its place, given the next start the window frees after the last one promised so (RATE_START_SQL
# in tasks/lifecycle/statements.py); the key's row records that last promise. A nullable column, no
# index: the rate start reads it by the key's primary key.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("tasks", "0028_worker_handed"),
    ]

    operations = [
        migrations.AddField(
            model_name="ratelimit",
            name="promised_until",
            field=models.DateTimeField(
                blank=True,
                help_text="The latest start promised to a task back from the line whose start was not free yet: the"
                " next such task is given the start after it (its place in line kept).",
                null=True,
            ),
        ),
    ]
