# Durable steps (tasks/steps.py, issue 58): each completed step of a task, its result stored by the
# step's own transaction under the attempt's fence (tasks/lifecycle/steps.py). Keyed by (task,
# position) with no foreign key: a finished task moves to tasks_finished and keeps its steps.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('tasks', '0038_workflow_requeue_cancelled_again'),
    ]

    operations = [
        migrations.CreateModel(
            name='TaskStep',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('task_id', models.BigIntegerField(help_text='The task whose step this is (in tasks_task or tasks_finished).')),
                ('position', models.IntegerField(help_text='The order the handler called its steps in, from 0.')),
                ('name', models.CharField(help_text='The name the handler called the step by.', max_length=200)),
                ('attempt', models.IntegerField(help_text='The attempt whose transaction committed the step.')),
                ('token', models.BigIntegerField(help_text="That attempt's fencing token.")),
                ('result', models.JSONField(help_text='What the step returned (JSON).', null=True)),
                ('started_at', models.DateTimeField(help_text="When the step began (the worker's clock).")),
                ('completed_at', models.DateTimeField(help_text='When its transaction stored the result (the database clock).')),
            ],
            options={
                'ordering': ['task_id', 'position'],
                'constraints': [models.UniqueConstraint(fields=('task_id', 'position'), name='tasks_taskstep_task_position')],
            },
        ),
    ]
