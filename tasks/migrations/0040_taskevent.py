# Durable events (tasks/steps.py send_event and wait_for_event, issue 58): the first payload sent to a
# task under a name. No foreign key, as tasks_taskstep: a finished task moves to tasks_finished. The
# partial index holds the events the recovery round may still have to wake their task for.
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tasks', '0039_taskstep'),
    ]

    operations = [
        migrations.CreateModel(
            name='TaskEvent',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('task_id', models.BigIntegerField(help_text='The task the event was sent to.')),
                ('name', models.CharField(help_text='The name the task waits for it by.', max_length=150)),
                ('payload', models.JSONField(help_text='What was sent (JSON).', null=True)),
                ('sent_at', models.DateTimeField(help_text='When it was stored (the database clock).')),
                ('delivered', models.BooleanField(default=False, help_text='The task was woken for it (or needs no waking).')),
            ],
            options={
                'ordering': ['task_id', 'id'],
                'indexes': [models.Index(condition=models.Q(('delivered', False)), fields=['id'], name='tasks_taskevent_pending_idx')],
                'constraints': [models.UniqueConstraint(fields=('task_id', 'name'), name='tasks_taskevent_task_name')],
            },
        ),
    ]
