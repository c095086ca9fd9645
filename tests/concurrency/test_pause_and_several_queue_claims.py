"""The claim hot path under attack: several queues, queue pause, the bounded error history.

Real connections, threads and worker processes; every wait polls the database with a deadline.


Found by a bug hunt (breaker) on issues 12 and 13: queue pause, claims over several queues."""

from __future__ import annotations

import itertools
import subprocess
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, connections
from django.db.models.functions import Now

from tasks.exceptions import TaskError
from tasks.models import QueueControl, Task, Worker
from tests.helpers import start_manage, stop_process, wait_until, worker_row
from tests.helpers import test_database_url as database_url
from tests.helpers.pgproxy import PgProxy
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True)]


def _backend_state(pid: int) -> str | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return row[0] if row else None


class InThread:
    """Runs ``call`` on its own thread and database connection; remembers its backend pid."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.pid: int | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                self.pid = cursor.fetchone()[0]
            self.result = self.call()
        except BaseException as exc:  # reported by the test thread
            self.error = exc
        finally:
            connections.close_all()
            self.done.set()

    def waiting_on_lock(self) -> bool:
        if self.error is not None:
            raise AssertionError("the thread failed") from self.error
        return self.pid is not None and not self.done.is_set() and _backend_state(self.pid) == "Lock"

    def join(self) -> Any:
        assert self.done.wait(30), "the thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


def _admin() -> psycopg.Connection[Any]:
    return psycopg.connect(database_url().replace("postgres://", "postgresql://", 1))


def test_pause_waits_for_a_round_in_flight_so_no_claim_lands_after_it() -> None:
    """A worker's finish-and-claim round has claimed a task of ``mail`` and then waits on a row lock (an
    admin transaction holds a task it is finishing). An operator pauses ``mail`` meanwhile. Either the
    round's claim commits before the pause does, or it sees the pause: ``pause`` must not return while
    a claim that missed it is still to commit."""
    Task.objects.enqueue(NOOP, queue="bulk")
    finishing = Task.objects.claim("w", queues=["bulk"], start=True)[0]
    first = Task.objects.enqueue(NOOP, queue="mail").id
    with _admin() as admin:
        admin.execute("SELECT id FROM tasks_task WHERE id = %s FOR UPDATE", [finishing.id])
        round_ = InThread(
            lambda: Task.objects.finish_start_claim(
                "w", [(finishing.id, finishing.token, "null")], limit=1, queues=["mail"]
            )
        )
        wait_until(round_.waiting_on_lock, what="the round to wait on the admin's row lock")
        pause = InThread(lambda: QueueControl.objects.pause("mail", by="breaker"))
        wait_until(
            lambda: pause.done.is_set() or pause.waiting_on_lock(), what="the pause to commit or to wait for the round"
        )
        returned_early = pause.done.is_set()
        admin.commit()
    pause.join()
    _finished, _started, claimed = round_.join()
    assert not returned_early, f"pause returned while a round that claimed {[c.id for c in claimed]} had yet to commit"
    assert [c.id for c in claimed] == [first]  # it committed before the pause: allowed
    Task.objects.enqueue(NOOP, queue="mail")
    assert Task.objects.claim("w", queues=["mail", "bulk"], limit=5) == []


def test_a_pause_blocked_by_a_long_reader_fails_clearly_and_changes_nothing(monkeypatch: Any) -> None:
    """While ``pause`` waits, claims queue behind it: so it waits a bounded time, then says why."""
    import tasks.models

    monkeypatch.setattr(tasks.models, "PAUSE_LOCK_TIMEOUT_MS", 300)
    task_id = Task.objects.enqueue(NOOP, queue="mail").id
    with _admin() as admin:
        admin.execute("SELECT count(*) FROM tasks_queuecontrol")  # an open transaction that read the table
        with pytest.raises(TaskError, match=r"could not pause 'mail'.*try again"):
            QueueControl.objects.pause("mail")
        admin.rollback()
    assert not QueueControl.objects.exists()
    assert [c.id for c in Task.objects.claim("w", queues=["mail"])] == [task_id]


def test_a_several_queue_claimer_does_not_make_another_worker_skip_the_best_task() -> None:
    """``fast`` always outranks ``slow``, so the two-queue claimer only ever takes ``fast`` tasks; the
    ``slow`` queue's one claimer must then take its tasks strictly in order. Rows the two-queue
    claimer locks but does not claim would make it skip the best one (a priority inversion)."""
    Task.objects.bulk_enqueue(NOOP, [{}] * 3000, queue="fast", priority=10)
    slow = Task.objects.bulk_enqueue(NOOP, [{}] * 200, queue="slow")
    stop = threading.Event()

    def two_queues() -> int:
        n = 0
        while not stop.is_set():
            n += len(Task.objects.claim("both", queues=["fast", "slow"], limit=1))
        return n

    def one_queue() -> list[int]:
        order: list[int] = []
        try:
            while len(order) < len(slow):
                order += [c.id for c in Task.objects.claim("one", queues=["slow"], limit=1)]
        finally:
            stop.set()
        return order

    both = InThread(two_queues)
    one = InThread(one_queue)
    order = one.join()
    claimed_by_both = both.join()
    assert claimed_by_both > 0
    assert Task.objects.filter(queue="slow", holder__startswith="both:").count() == 0
    inversions = [(a, b) for a, b in itertools.pairwise(order) if b < a]
    assert order == slow, f"{len(inversions)} inversion(s), e.g. {inversions[:5]}"


def test_http_style_claims_from_threads_over_several_queues_run_each_task_once_best_first() -> None:
    """Four threads claim (``start=True``, as the JSON API does) from three queues, one a paused one
    that is resumed half-way, and complete what they get. Each task is claimed exactly once, charged
    once, and every claim returns its tasks best first; nothing of the paused queue goes while paused."""
    import random

    rng = random.Random(7)
    ids: dict[int, int] = {}
    for queue in ("a", "b", "held"):
        for _ in range(150):
            priority = rng.randint(-5, 5)
            ids[Task.objects.enqueue(NOOP, queue=queue, priority=priority).id] = priority
    QueueControl.objects.pause("held")
    held = set(Task.objects.filter(queue="held").values_list("id", flat=True))
    resumed = threading.Event()

    def client(name: str) -> list[list[tuple[int, int, str]]]:
        batches: list[list[tuple[int, int, str]]] = []
        while True:
            was_resumed = resumed.is_set()
            claimed = Task.objects.claim(name, queues=["a", "b", "held"], limit=3, start=True)
            if not claimed:
                if was_resumed:
                    return batches
                continue
            batches.append([(c.id, c.priority, "resumed" if was_resumed else "paused") for c in claimed])
            done = Task.objects.complete_many(name, [(c.id, c.token, "null") for c in claimed])
            assert done == {c.key for c in claimed}

    clients = [InThread(partial(client, f"http-{i}")) for i in range(4)]
    wait_until(lambda: Task.objects.filter(queue__in=["a", "b"], status="READY").count() < 150, what="progress")
    assert not Task.objects.filter(queue="held").exclude(status="READY").exists()
    # On the database clock: a claim that saw the queue resumed began after the resume committed,
    # hence after this instant. (The labels below only say which loop turn a claim belongs to.)
    resuming_at = _db_now()
    resumed.set()
    QueueControl.objects.resume("held")
    batches = [batch for c in clients for batch in c.join()]
    claimed = [task_id for batch in batches for task_id, _p, _w in batch]
    assert sorted(claimed) == sorted(ids)  # every task once, none twice
    for batch in batches:
        assert [p for _id, p, _w in batch] == sorted((p for _id, p, _w in batch), reverse=True), batch
    early = Task.objects.filter(pk__in=held, acquired_at__lt=resuming_at).values_list("id", flat=True)
    assert list(early) == []
    rows = Task.objects.filter(pk__in=ids)
    assert set(rows.values_list("status", "attempts", "failures")) == {("SUCCESSFUL", 1, 0)}
    assert all(len(w) == 1 for w in rows.values_list("worker_ids", flat=True))


# -- real worker processes ------------------------------------------------------------------------


@pytest.fixture
def worker_procs(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str, **env: str) -> subprocess.Popen[bytes]:
        proc = start_manage(tmp_path / f"{name}.log", "run_worker", "--worker-id", name, *args, **env)
        started.append(proc)
        wait_until(lambda: Worker.objects.filter(name=name).exists(), 30, what=f"{name} to register")
        return proc

    yield start
    for proc in started:
        stop_process(proc)
    for log in sorted(tmp_path.glob("*.log")):  # shown by pytest for a failing test only
        print(f"----- {log.name} -----\n{log.read_text(errors='replace')[-5000:]}")


def _db_now() -> Any:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


@pytest.mark.slow
def test_pause_and_resume_under_several_queue_workers_never_lets_a_claim_through(worker_procs: Any) -> None:
    """Two worker processes drain ``mail`` and ``bulk`` flat out while an operator pauses and resumes
    ``mail`` again and again. After each ``pause`` returns, no ``mail`` task may be claimed: none with a
    grant later than the pause, and no more of them out of READY than at the moment it returned, even
    after every worker has claimed from ``bulk`` since."""
    Task.objects.bulk_enqueue(NOOP, [{}] * 4000, queue="mail")
    Task.objects.bulk_enqueue(NOOP, [{}] * 4000, queue="bulk")
    names = ["pw-1", "pw-2"]
    for name in names:
        worker_procs(name, "--queues", "mail,bulk", "--concurrency", "2", "--batch-size", "8", "--poll-interval", "0.2")
    mail = Task.objects.filter(queue="mail")
    for cycle in range(4):
        wait_until(lambda: mail.filter(status="RUNNING").exists() or mail.exclude(status="READY").count() > 0)
        QueueControl.objects.pause("mail", by="breaker")
        paused_at = _db_now()
        taken = mail.exclude(status="READY").count()
        # Every worker has claimed from bulk after the pause: each went through at least one round.
        for name in names:
            claimed_since = Task.objects.filter(queue="bulk", holder__startswith=f"{name}:", acquired_at__gt=paused_at)
            wait_until(claimed_since.exists, what=f"{name} to claim from bulk after the pause (cycle {cycle})")
        late = list(mail.filter(acquired_at__gt=paused_at).values_list("id", "holder", "acquired_at"))
        assert late == [], f"cycle {cycle}: mail tasks claimed after the pause: {late[:5]}"
        assert mail.exclude(status="READY").count() == taken, f"cycle {cycle}: a claim in flight landed after pause"
        QueueControl.objects.resume("mail", by="breaker")
        wait_until(mail.filter(acquired_at__gt=paused_at).exists, what="mail to flow again after resume")
    assert not Task.objects.filter(status="RUNNING", expires_at__lt=_db_now()).exists()


def _failures_beyond(task_id: int, seen: int) -> int:
    """The task's failures once there are more than ``seen`` (0 until then)."""
    failures = Task.objects.get(pk=task_id).failures
    return failures if failures > seen else 0


@pytest.mark.slow
def test_a_lost_reply_to_the_twelfth_failure_is_reconciled_through_the_capped_history(worker_procs: Any) -> None:
    """A task fails 13 times (past the 10-entry cap) and the reply to its 12th failure never reaches
    the worker (the statement committed). The worker must learn from ``errors -> -1`` that its write
    landed (reconciled, not re-sent, not a fencing rejection), and the history must hold the first
    entry and the newest nine, in order, with the three dropped ones counted."""
    task_id = Task.objects.enqueue(
        "tests.testapp.handlers.fail_until", kwargs={"succeed_on": 14}, queue="flaky", max_attempts=20
    ).id
    with PgProxy.from_database_url(database_url()) as proxy:
        fault = proxy.drop_reply_after(b"attempt 12 fails on purpose")
        worker_procs(
            "flaky-1",
            "--queues",
            "flaky,other",
            "--ttl",
            "3",
            "--poll-interval",
            "0.1",
            DATABASE_URL=proxy.url_for(database_url()),
        )
        task = Task.objects.filter(pk=task_id)
        failures = 0
        while failures < 13:
            failures = wait_until(partial(_failures_beyond, task_id, failures), 30, what=f"failure {failures + 1}")
            # The handler's own failures back off for up to minutes: the operator's "retry now".
            task.filter(status="READY").update(run_after=Now())
        assert fault.fired.is_set() and fault.status == b"I"  # the 12th failure committed, its reply was lost
        wait_until(lambda: task.get().status == "SUCCESSFUL", 30, what="the 14th attempt to succeed")
        stats = wait_until(
            lambda: (worker_row("flaky-1").stats or {}).get("reconciled") and worker_row("flaky-1").stats,
            30,
            what="the worker to report reconciliation",
        )
    row = task.get()
    assert (row.attempts, row.failures, row.crashes, row.shared_crashes) == (14, 13, 0, 0)
    assert row.errors_dropped == 3
    assert [e["attempt"] for e in row.errors] == [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert {e["kind"] for e in row.errors} == {"failure"}
    assert len({e["token"] for e in row.errors}) == 10
    assert stats["rejected"] == 0 and stats["reconciled"] >= 1
