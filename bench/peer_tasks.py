"""The peers' tasks that must live in an importable module: the no-op task for django-tasks-db (a
django.tasks task on its backend), and oban's two workers (oban resolves a job's worker by its
dotted path, ``bench.peer_tasks.ObanNoop``, in the worker process)."""

import asyncio
from typing import Any

from oban import worker

from tasks.compat import task


@task(queue_name="bench")
def noop(i: int = 0) -> None:
    return None


@worker(queue="bench")
class ObanNoop:
    async def process(self, job: Any) -> None:
        return None


@worker(queue="bench")
class ObanSleep:
    async def process(self, job: Any) -> None:
        await asyncio.sleep(1.0)
