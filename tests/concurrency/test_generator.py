"""Three generator instances: one generates; kill it, another takes over; a stored stop stops it."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.demo.generator import DEMO_TASK, lease_name, set_state, status
from tasks.models import GeneratorState, Task
from tests.helpers import start_manage, stop_process, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def instances(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    procs = {
        name: start_manage(
            tmp_path / f"{name}.log", "run_generator", "--instance-id", name, "--ttl", "1", "--tick", "0.05", "-v", "2"
        )
        for name in ("gen-a", "gen-b", "gen-c")
    }
    yield procs
    for proc in procs.values():
        stop_process(proc)


def generators_of_tasks() -> set[str]:
    return {kwargs["generator"] for kwargs in Task.objects.filter(task_path=DEMO_TASK).values_list("kwargs", flat=True)}


def test_one_instance_generates_another_takes_over_and_a_stored_stop_reaches_the_leader(
    instances: dict[str, subprocess.Popen[bytes]],
) -> None:
    set_state(running=True, rate=50)
    leader = wait_until(lambda: status().leader, 30, what="a leader")
    wait_until(lambda: Task.objects.filter(task_path=DEMO_TASK).count() >= 20, 30, what="tasks to be generated")
    assert generators_of_tasks() == {leader}, "only the lease holder generates"

    instances[leader].send_signal(signal.SIGKILL)
    instances[leader].wait(10)
    successor = wait_until(lambda: (s := status().leader) not in (None, leader) and s, 30, what="a successor")
    before = Task.objects.filter(task_path=DEMO_TASK).count()
    wait_until(lambda: Task.objects.filter(task_path=DEMO_TASK).count() >= before + 20, 30, what="generation to resume")
    assert generators_of_tasks() == {leader, successor}
    assert GeneratorState.objects.get().leader == successor

    # Stop from "another replica": only the database row changes; the leader must notice.
    set_state(running=False)
    wait_until(lambda: not GeneratorState.objects.get().observed_running, 30, what="the leader to see the stop")
    count = Task.objects.filter(task_path=DEMO_TASK).count()
    ticks = GeneratorState.objects.get().ticks
    wait_until(lambda: GeneratorState.objects.get().ticks >= ticks + 5, 30, what="more rounds")
    assert Task.objects.filter(task_path=DEMO_TASK).count() == count
    assert status().leader == successor  # it still leads, idle
    assert sum(1 for proc in instances.values() if proc.poll() is None) == 2


def test_status_and_state_validation() -> None:
    state = set_state(running=True, rate=3.5, max_sleep=2)
    assert (state.running, state.rate, state.max_sleep) == (True, 3.5, 2)
    with pytest.raises(ValueError, match="rate"):
        set_state(rate=0)
    assert status().leader is None
    assert lease_name("default") == "tasks:generator:default"


def test_generator_control_commands(tmp_path: Path) -> None:
    from tests.helpers import child_env
    from tests.helpers.zygote import run_python

    done = run_python(
        ["manage.py", "run_generator", "--start", "--rate", "7"],
        cwd=Path(__file__).resolve().parents[2],
        env=child_env(),
        check=True,
    )
    assert "desired=running rate=7.0/s" in done.stdout
    bad = run_python(
        ["manage.py", "run_generator", "--rate", "-1"], cwd=Path(__file__).resolve().parents[2], env=child_env()
    )
    assert bad.returncode != 0
    assert "must be positive" in bad.stderr
