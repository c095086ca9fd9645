"""The enqueue side: the ``django.tasks`` backend (``backend.py``), which task paths may come
through the JSON API (``allowlist.py``) and where a queue's tasks land (``placement.py``).

``tasks.backends.LeaseBackend`` is the path settings name in ``TASKS[...]["BACKEND"]``."""

from tasks.backends.backend import LeaseBackend, LeaseTaskContext
from tasks.backends.options import LeaseTask, task

__all__ = ["LeaseBackend", "LeaseTask", "LeaseTaskContext", "task"]

# Named by its public path wherever Django shows a class's path: the sender of task_started and
# task_finished, checks' messages, the repr of a backend.
LeaseBackend.__module__ = __name__
LeaseTaskContext.__module__ = __name__
LeaseTask.__module__ = __name__
