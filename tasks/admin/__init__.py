"""The Django admin of the task queue: tasks, workers and queue switches (``tasks.py``), periodic
tasks (``schedules.py``). Importing this package registers both."""

from tasks.admin import schedules, tasks

__all__ = ["schedules", "tasks"]
