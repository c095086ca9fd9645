"""Real worker processes, one per database: each drains its own database and touches nothing else."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from tasks.models import Task, Worker
from tests.helpers import start_manage, stop_process, wait_until, worker_names
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(databases=["default", "second"], transaction=True), pytest.mark.slow]

ROUTES = {"reports": "second"}
FAST = ["--ttl", "2", "--recovery-interval", "0.2", "--poll-interval", "0.1", "--no-scheduler"]


def test_one_worker_per_database_drains_its_own_and_never_the_others(settings: Any, tmp_path: Path) -> None:
    settings.LEASING_TASKS = {"QUEUE_DATABASES": ROUTES}
    env = {
        "LEASING_TEST_SECOND_DATABASE": connections["second"].settings_dict["NAME"],
        "LEASING_TEST_QUEUE_DATABASES": json.dumps(ROUTES),
    }
    on_default = Task.objects.bulk_enqueue(NOOP, [{}] * 150)
    on_second = Task.objects.bulk_enqueue(NOOP, [{}] * 150, queue="reports")
    # The same queue name in the database it is not routed to: nobody's to run.
    stray = Task.objects.db_manager("default").enqueue(NOOP, queue="reports").id
    assert set(on_second).isdisjoint(Task.objects.using("default").filter(queue="reports").values_list("pk", flat=True))

    started: list[subprocess.Popen[bytes]] = []
    try:
        for name, args in [
            ("on-default", ["--queues", "default"]),
            ("on-second", ["--database", "second", "--queues", "reports"]),
        ]:
            started.append(
                start_manage(tmp_path / f"{name}.log", "run_worker", "--worker-id", name, *FAST, *args, **env)
            )

        def drained() -> bool:
            return all(
                Task.objects.using(alias).filter(pk__in=ids, status="SUCCESSFUL").count() == len(ids)
                for alias, ids in (("default", on_default), ("second", on_second))
            )

        wait_until(drained, timeout=60, what="both databases drained")
        # Each worker registered itself in its own database only.
        assert list(Worker.objects.using("default").values_list("name", flat=True)) == ["on-default"]
        assert list(Worker.objects.using("second").values_list("name", flat=True)) == ["on-second"]
    finally:
        codes = [stop_process(proc) for proc in started]
    assert codes == [0, 0], [(tmp_path / f"{n}.log").read_text()[-3000:] for n in ("on-default", "on-second")]
    for alias, ids, worker in (("default", on_default, "on-default"), ("second", on_second, "on-second")):
        done = Task.objects.using(alias).filter(pk__in=ids)
        assert {tuple(worker_names(t.worker_ids)) for t in done} == {(worker,)}  # each exactly once, by its own worker
        assert set(done.values_list("attempts", flat=True)) == {1}
    assert Task.objects.using("default").get(pk=stray).status == "READY"
    assert Task.objects.using("second").exclude(queue="reports").count() == 0


def test_a_worker_on_the_second_database_refuses_a_queue_routed_elsewhere(settings: Any, tmp_path: Path) -> None:
    env = {
        "LEASING_TEST_SECOND_DATABASE": connections["second"].settings_dict["NAME"],
        "LEASING_TEST_QUEUE_DATABASES": json.dumps(ROUTES),
    }
    proc = start_manage(tmp_path / "refused.log", "run_worker", "--database", "second", "--queues", "default", **env)
    assert proc.wait(60) != 0
    assert (
        "these queues live in another database: default (routed to default)" in (tmp_path / "refused.log").read_text()
    )
