"""The no-op task for django-tasks-db (a django.tasks task on its backend)."""

from django.tasks import task


@task(queue_name="bench")
def noop(i: int = 0) -> None:
    return None
