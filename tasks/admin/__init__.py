"""The Django admin of the task queue: tasks (``tasks.py``, its list filters in ``task_filters.py``),
workers and queue switches (``workers.py``), periodic tasks (``schedules.py``), workflows
(``workflows.py``). Importing this package registers them all. The demo's generator state is the demo
app's (``tasks/demo/admin.py``): registered where it is installed."""

from tasks.admin import schedules, tasks, workers, workflows

__all__ = ["schedules", "tasks", "workers", "workflows"]
