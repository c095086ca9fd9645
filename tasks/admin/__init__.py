"""The Django admin of the task queue: tasks, workers and queue switches (``tasks.py``), periodic
tasks (``schedules.py``), workflows (``workflows.py``). Importing this package registers them all."""

from tasks.admin import schedules, tasks, workflows

__all__ = ["schedules", "tasks", "workflows"]
