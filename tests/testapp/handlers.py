"""Task handlers used by the tests (plain callables and django.tasks tasks)."""

from __future__ import annotations

import os
import time
from typing import Any

from tasks.compat import task
from tasks.runtime import current_task


def noop(**kwargs: Any) -> None:
    return None


def _effect(phase: str) -> None:
    from tests.testapp.models import Effect

    run = current_task()
    Effect.objects.create(task_id=run.id, token=run.token, attempt=run.attempt, phase=phase, pid=os.getpid())


def record(**kwargs: Any) -> int:
    """One effect row per execution."""
    _effect("done")
    return os.getpid()


def record_then_discard(**kwargs: Any) -> None:
    """One effect row per execution, then FAILED for good: a task run twice shows as two rows."""
    from tasks.exceptions import Discard

    _effect("done")
    raise Discard("fails for good on purpose")


def block(gate: str, **kwargs: Any) -> dict[str, Any]:
    """Record the start, wait until the test opens ``gate``, record the end."""
    from tests.testapp.models import Gate

    _effect("started")
    deadline = time.monotonic() + 120
    while not Gate.objects.filter(key=gate, open=True).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.02)
    _effect("finished")
    return {"pid": os.getpid(), "token": current_task().token}


def slow_first(gate: str, **kwargs: Any) -> dict[str, Any]:
    """Attempt 1 waits for the gate (past any short timeout); later attempts return at once."""
    from tests.testapp.models import Gate

    run = current_task()
    if run.attempt == 1:
        deadline = time.monotonic() + 120
        while not Gate.objects.filter(key=gate, open=True).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return {"attempt": 1, "late": True}
    return {"attempt": run.attempt}


def fail_until(succeed_on: int, **kwargs: Any) -> str:
    run = current_task()
    if run.attempt < succeed_on:
        raise ValueError(f"attempt {run.attempt} fails on purpose")
    return f"succeeded on attempt {run.attempt}"


def resume(**kwargs: Any) -> dict[str, Any]:
    """Checkpoints, then fails on the first attempt; the retry resumes from the checkpoint."""
    run = current_task()
    start = (run.progress or {}).get("step", 0)
    if run.attempt == 1:
        run.checkpoint({"step": 3})
        raise RuntimeError("crash after step 3")
    return {"resumed_from": start, "attempt": run.attempt}


@task(priority=0)
def add(a: int, b: int) -> int:
    return a + b


@task(takes_context=True)
def context_info(context: Any, label: str) -> dict[str, Any]:
    context.checkpoint({"label": label})
    return {"attempt": context.attempt, "token": context.token, "label": label, "progress": context.progress}


@task()
async def async_double(n: int) -> int:
    return n * 2


@task()
def explode() -> None:
    raise KeyError("boom")


# -- fault matrix handlers (tests/concurrency/test_worker_faults.py) ---------------------------------
# Task arguments must be storable JSON, so each handler builds its poison (NaN, NUL, a lone surrogate,
# an exotic BaseException) itself from a plain name.

UNSTORABLE_RESULTS: dict[str, Any] = {
    "nan": lambda: {"mean": float("nan")},
    "inf": lambda: {"mean": float("inf")},
    "nul": lambda: "before\x00after",
    "surrogate": lambda: "lone \ud800 surrogate",
    "object": object,
    "circular": lambda: _circular(),
    "huge_int": lambda: {"n": 10**5000},  # past Python's int-to-text limit (4,300 digits)
    "deep": lambda: _deep(5000),  # past the encoder's recursion limit
}


def _circular() -> dict[str, Any]:
    value: dict[str, Any] = {"name": "loop"}
    value["self"] = value
    return value


def _deep(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def unstorable_result(kind: str, **kwargs: Any) -> Any:
    """Return a value jsonb cannot hold."""
    return UNSTORABLE_RESULTS[kind]()


def raise_base(kind: str, **kwargs: Any) -> None:
    """Raise an exception the worker must record as a failed attempt and survive."""
    import asyncio

    exceptions: dict[str, BaseException] = {
        "nul_message": ValueError("before\x00after"),
        "surrogate_message": ValueError("lone \ud800 surrogate"),
        "system_exit": SystemExit(7),
        "keyboard_interrupt": KeyboardInterrupt("interrupted by the handler"),
        "cancelled": asyncio.CancelledError("cancelled by the handler"),
        "generator_exit": GeneratorExit("closed by the handler"),
    }
    raise exceptions[kind]


async def async_cancelled(**kwargs: Any) -> None:
    """A coroutine handler cancelled from inside (what a cancelled await surfaces as)."""
    import asyncio

    raise asyncio.CancelledError("cancelled inside a coroutine handler")


def echo(value: Any, **kwargs: Any) -> Any:
    _effect("done")
    return value


def _wait_for_gate(gate: str) -> None:
    from tests.testapp.models import Gate

    deadline = time.monotonic() + 120
    while not Gate.objects.filter(key=gate, open=True).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.02)


def exit_after_start(code: int = 3, gate: str | None = None, every_time: bool = False, **kwargs: Any) -> Any:
    """Kill the whole worker process (``os._exit``) once this attempt's start is recorded.

    Waiting for the start marker makes the death a *started* attempt's (a crash, or a shared crash
    when other attempts ran beside it): a worker that dies before its marker lands has its claim
    returned uncharged, by design (invariant 10). Unless ``every_time``, later attempts return.
    """
    from tasks.models import Task

    run = current_task()
    _effect("started")
    if run.attempt > 1 and not every_time:
        return {"attempt": run.attempt}
    deadline = time.monotonic() + 60
    while not Task.objects.filter(pk=run.id, token=run.token, attempt_started=True).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the start marker never landed")
        time.sleep(0.02)
    if gate is not None:
        _wait_for_gate(gate)
    os._exit(code)


def fail_first_then_block(gate: str, **kwargs: Any) -> dict[str, Any]:
    """Attempt 1 fails at once; later attempts wait for ``gate`` (a newer attempt to fence against)."""
    run = current_task()
    if run.attempt == 1:
        raise ValueError("attempt 1 fails on purpose")
    _effect("started")
    _wait_for_gate(gate)
    return {"attempt": run.attempt, "token": run.token}


def work(seconds: float = 0.05, **kwargs: Any) -> int:
    """Stand-in for a short computation that touches no database (simulated work, not a wait)."""
    time.sleep(seconds)
    return os.getpid()


# -- lock-holding handlers (tests/concurrency/test_worker_locks.py) ---------------------------------


def checkpoint_in_atomic(gate: str, **kwargs: Any) -> str:
    """A handler wrapped in ``transaction.atomic`` (a common habit) that checkpoints, then waits: the
    checkpoint must not keep its own task row locked for the rest of the transaction."""
    from django.db import transaction

    with transaction.atomic():
        current_task().checkpoint({"step": 1})
        _wait_for_gate(gate)
    return "done"


# -- concurrency keys (tests/concurrency/test_concurrency_keys.py) ----------------------------------


def _span_mark(phase: str) -> None:
    """An effect row stamped with the database's clock (spans are compared on one clock)."""
    from django.db import connection

    run = current_task()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO testapp_effect (task_id, token, attempt, phase, pid, created_at)"
            " VALUES (%s, %s, %s, %s, %s, clock_timestamp())",
            [run.id, run.token, run.attempt, phase, os.getpid()],
        )


def span(seconds: float = 0.01, fail_first: bool = False, gate: str | None = None, **kwargs: Any) -> int:
    """Record the start and the end of the attempt on the database clock; between them, work for
    ``seconds``, or wait for ``gate``. With ``fail_first`` the first attempt raises after its start."""
    _span_mark("started")
    if fail_first and current_task().attempt == 1:
        raise RuntimeError("first attempt fails")
    if gate is not None:
        _wait_for_gate(gate)
    else:
        time.sleep(seconds)
    _span_mark("ended")
    return os.getpid()


def stalled_span(stall: float, seconds: float = 0.01, **kwargs: Any) -> int:
    """:func:`span` whose first attempt misses its heartbeats for ``stall`` seconds (the demo's latency
    spike: this attempt alone stalls while its worker lives on), so its lease lapses mid-handler."""
    _span_mark("started")
    run = current_task()
    if run.attempt == 1:
        run.miss_heartbeats(stall)
        time.sleep(stall)
    else:
        time.sleep(seconds)
    _span_mark("ended")
    return os.getpid()


def stall_past_expiry(**kwargs: Any) -> int:
    """:func:`span` whose first attempt misses its heartbeats until its lease has expired on the
    database clock, then returns at once (a latency spike that ends just after the lease ran out)."""
    from django.db import connection

    _span_mark("started")
    run = current_task()
    if run.attempt == 1:
        run.miss_heartbeats(600)
        deadline = time.monotonic() + 120
        with connection.cursor() as cursor:
            while time.monotonic() < deadline:
                cursor.execute("SELECT expires_at <= clock_timestamp() FROM tasks_task WHERE id = %s", [run.id])
                if cursor.fetchone()[0]:
                    break
                time.sleep(0.02)
    _span_mark("ended")
    return os.getpid()


# -- async executor handlers (tests/concurrency/test_async_executor.py) -------------------------------


async def _aeffect(phase: str) -> None:
    from asgiref.sync import sync_to_async

    await sync_to_async(_effect, thread_sensitive=False)(phase)


async def _await_gate(gate: str) -> None:
    import asyncio

    from tests.testapp.models import Gate

    deadline = time.monotonic() + 120
    while not await Gate.objects.filter(key=gate, open=True).aexists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        await asyncio.sleep(0.02)


async def async_sleep(seconds: float = 0.5, **kwargs: Any) -> dict[str, Any]:
    """Wait without a thread; report when it ran (epoch seconds), in which process and thread."""
    import asyncio
    import threading

    start = time.time()
    await asyncio.sleep(seconds)
    return {"start": start, "end": time.time(), "pid": os.getpid(), "thread": threading.current_thread().name}


async def async_identity(pause: float = 0.05, **kwargs: Any) -> dict[str, Any]:
    """current_task() before and after awaits, and inside sync code run from the coroutine: each
    coroutine must see its own attempt while hundreds of others interleave with it."""
    import asyncio
    import random

    from asgiref.sync import sync_to_async

    before = current_task()
    await asyncio.sleep(random.uniform(0, pause))
    inside = await sync_to_async(lambda: current_task().id, thread_sensitive=False)()
    await asyncio.sleep(random.uniform(0, pause))
    after = current_task()
    return {"before": before.id, "after": after.id, "inside": inside, "token": after.token}


async def async_raise(kind: str, **kwargs: Any) -> None:
    """raise_base from a coroutine on the event loop."""
    import asyncio

    await asyncio.sleep(0)
    raise_base(kind)


async def async_unstorable(kind: str, **kwargs: Any) -> Any:
    import asyncio

    await asyncio.sleep(0)
    return UNSTORABLE_RESULTS[kind]()


async def async_wait_cancelled(
    only_first: bool = False, cleanup: float = 0.0, mark: bool = False, **kwargs: Any
) -> str:
    """Record the start, wait (for ever); once cancelled, clean up for ``cleanup`` seconds (awaiting),
    record the cancellation, then let it end the coroutine. With ``only_first``, later attempts return
    at once; with ``mark``, the cleanup's start is recorded too (phase "cleaning")."""
    import asyncio

    if only_first and current_task().attempt > 1:
        return f"attempt {current_task().attempt}"
    await _aeffect("started")
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        if mark:
            await _aeffect("cleaning")
        if cleanup:
            await asyncio.sleep(cleanup)
        await _aeffect("cancelled")
        raise
    return "woke up"


async def async_block_loop(seconds: float, **kwargs: Any) -> str:
    """Blocks the event loop (a blocking call in async code) on its first attempt."""
    run = current_task()
    await _aeffect("started")
    if run.attempt == 1:
        time.sleep(seconds)
    return f"attempt {run.attempt}"


async def async_gate(gate: str, **kwargs: Any) -> dict[str, Any]:
    """Record the start, wait for ``gate`` without blocking the loop, record the end."""
    await _aeffect("started")
    await _await_gate(gate)
    await _aeffect("finished")
    return {"pid": os.getpid(), "token": current_task().token}


async def async_resume(**kwargs: Any) -> dict[str, Any]:
    """Checkpoints with acheckpoint, then fails on the first attempt; the retry resumes from it."""
    run = current_task()
    start = (run.progress or {}).get("step", 0)
    if run.attempt == 1:
        saved = await run.acheckpoint({"step": 3})
        raise RuntimeError(f"crash after step 3 (checkpoint saved: {saved})")
    return {"resumed_from": start, "attempt": run.attempt}


@task(takes_context=True)
async def async_context_task(context: Any, label: str) -> dict[str, Any]:
    """A django.tasks async Task: context, acheckpoint, the async ORM; where it ran."""
    import threading

    from tests.testapp.models import Gate

    await context.acheckpoint({"label": label})
    gates = await Gate.objects.filter(key=label).acount()
    return {
        "attempt": context.attempt,
        "token": context.token,
        "label": label,
        "gates": gates,
        "thread": threading.current_thread().name,
    }


# -- hostile async handlers (tests/concurrency/test_async_hostile_handlers.py) ------------------------


async def _aeffect_for(task_id: int, token: int, phase: str) -> None:
    """An effect row for a given attempt (from code that may no longer see current_task())."""
    from asgiref.sync import sync_to_async

    from tests.testapp.models import Effect

    def create() -> None:
        Effect.objects.create(task_id=task_id, token=token, attempt=0, phase=phase, pid=os.getpid())

    await sync_to_async(create, thread_sensitive=False)()


async def async_swallow_cancel(only_first: bool = False, **kwargs: Any) -> str:
    """Ignores every cancellation for ever (a handler that catches CancelledError and carries on).
    With ``only_first``, later attempts return at once."""
    import asyncio

    run = current_task()
    if only_first and run.attempt > 1:
        return f"attempt {run.attempt}"
    await _aeffect("started")
    swallowed = 0
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed += 1
            if swallowed == 1:
                await _aeffect_for(run.id, run.token, "swallowed")


async def async_spawn_orphans(**kwargs: Any) -> str:
    """Spawns tasks that outlive the handler: one checkpoints after the attempt ended (must be
    refused), one raises SystemExit on the loop, one raises KeyboardInterrupt."""
    import asyncio

    run = current_task()
    task_id, token = run.id, run.token

    async def late_checkpoint() -> None:
        await asyncio.sleep(0.5)
        try:
            outcome = str(await current_task().acheckpoint({"orphan": True}))
        except Exception as exc:
            outcome = f"raised {type(exc).__name__}"
        await _aeffect_for(task_id, token, f"orphan:{outcome}"[:20])

    async def exit_later(exc: BaseException) -> None:
        await asyncio.sleep(0.3)
        raise exc

    loop_tasks = [
        asyncio.ensure_future(late_checkpoint()),
        asyncio.ensure_future(exit_later(SystemExit(3))),
        asyncio.ensure_future(exit_later(KeyboardInterrupt("orphan"))),
    ]
    # Keep references somewhere the handler does not await (the loop holds them weakly otherwise).
    _ORPHANS.extend(loop_tasks)
    return "spawned"


_ORPHANS: list[Any] = []


async def async_sync_orm(**kwargs: Any) -> int:
    """Calls the sync ORM straight from the coroutine (Django refuses: SynchronousOnlyOperation)."""
    from tests.testapp.models import Gate

    return Gate.objects.count()


async def async_identity_everywhere(pause: float = 0.05, **kwargs: Any) -> dict[str, Any]:
    """What current_task() says in every place a coroutine can run code: asyncio.to_thread, a task
    it creates, thread-sensitive sync_to_async, and loop.run_in_executor (which copies no context)."""
    import asyncio
    import random

    from asgiref.sync import sync_to_async

    def seen() -> int | None:
        try:
            return current_task().id
        except RuntimeError:
            return None

    own = current_task().id
    await asyncio.sleep(random.uniform(0, pause))
    in_thread = await asyncio.to_thread(seen)
    await asyncio.sleep(random.uniform(0, pause))
    in_child = await asyncio.create_task(_seen_after(random.uniform(0, pause)))
    sensitive = await sync_to_async(seen, thread_sensitive=True)()
    executor = await asyncio.get_running_loop().run_in_executor(None, seen)
    after = current_task().id
    return {
        "own": own,
        "to_thread": in_thread,
        "child_task": in_child,
        "thread_sensitive": sensitive,
        "run_in_executor": executor,
        "after": after,
    }


async def _seen_after(pause: float) -> int | None:
    import asyncio

    await asyncio.sleep(pause)
    try:
        return current_task().id
    except RuntimeError:
        return None


def sync_identity(**kwargs: Any) -> int | None:
    """A sync handler on a thread: what current_task() says (run after coroutines on the same worker)."""
    return current_task().id


async def async_block_forever(**kwargs: Any) -> str:
    """Blocks the event loop far longer than any test waits (a blocking call in async code)."""
    await _aeffect("started")
    time.sleep(600)
    return "woke"


class AsyncCallable:
    """A handler object whose ``__call__`` is a coroutine function."""

    async def __call__(self, value: Any = None, **kwargs: Any) -> Any:
        import asyncio

        await asyncio.sleep(0)
        return {"value": value, "task": current_task().id}


async_callable = AsyncCallable()


def _timeouts_seen() -> list[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')")
        row = cursor.fetchone()
    return [row[0], row[1]]


def breaker_timeouts_seen(**kwargs: Any) -> list[str]:
    """The statement and lock timeouts a sync handler's own statements run under."""
    return _timeouts_seen()


async def breaker_async_timeouts_seen(**kwargs: Any) -> list[list[str]]:
    """The same from a coroutine: through thread-sensitive and thread-insensitive sync_to_async."""
    from asgiref.sync import sync_to_async

    sensitive = await sync_to_async(_timeouts_seen, thread_sensitive=True)()
    insensitive = await sync_to_async(_timeouts_seen, thread_sensitive=False)()
    return [sensitive, insensitive]


def breaker_poison_session(**kwargs: Any) -> None:
    """Task code that sets session-level timeouts (its own business; behind a pooler they land on a
    shared server connection and stay there for whoever is served next)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SET statement_timeout = '1ms'")
        cursor.execute("SET lock_timeout = '1ms'")


def _sleep_then_mark_end(seconds: float, task_id: int, token: int, attempt: int) -> None:
    from django.db import connection

    time.sleep(seconds)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO testapp_effect (task_id, token, attempt, phase, pid, created_at)"
            " VALUES (%s, %s, %s, 'ended', %s, clock_timestamp())",
            [task_id, token, attempt, os.getpid()],
        )
    connection.close()


async def async_span_in_thread(seconds: float = 0.01, **kwargs: Any) -> int:
    """:func:`span` as a coroutine whose work is blocking code handed to a thread
    (``sync_to_async(thread_sensitive=False)``, as async handlers call sync libraries): the start mark,
    then ``seconds`` of work and the end mark in the thread."""
    from asgiref.sync import sync_to_async

    run = current_task()
    await sync_to_async(_span_mark_for, thread_sensitive=False)(run.id, run.token, run.attempt, "started")
    await sync_to_async(_sleep_then_mark_end, thread_sensitive=False)(seconds, run.id, run.token, run.attempt)
    return os.getpid()


def _span_mark_for(task_id: int, token: int, attempt: int, phase: str) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO testapp_effect (task_id, token, attempt, phase, pid, created_at)"
            " VALUES (%s, %s, %s, %s, %s, clock_timestamp())",
            [task_id, token, attempt, phase, os.getpid()],
        )
    connection.close()


# -- composition matrix (tests/concurrency/test_composition_matrix.py) -----------------------------


def composed(fail_first: bool = False, snooze_first: bool = False, **kwargs: Any) -> int:
    """Records its start and end as effects around a short piece of work (long enough for an operator's
    action to find it RUNNING). ``snooze_first``: the task's first execution snoozes for a second before
    any work; ``fail_first``: its first execution that does the work fails for good (Discard) after it."""
    from tasks.exceptions import Discard, Snooze
    from tests.testapp.models import Effect

    run = current_task()
    if snooze_first and not Effect.objects.filter(task_id=run.id, phase="snoozed").exists():
        _effect("snoozed")
        raise Snooze(1.0)
    ran_before = Effect.objects.filter(task_id=run.id, phase="done").exists()
    _effect("started")
    time.sleep(0.05)  # the work itself, not a synchronisation
    _effect("done")
    if fail_first and not ran_before:
        raise Discard("the first execution fails on purpose")
    return run.attempt


#: Database clock readings a handler took, by the ``key`` its task was given (tests/db/test_attempt_durations.py).
CLOCK_READINGS: dict[str, list[Any]] = {}
#: Released by the test that started a handler waiting on it (an overrun handler's thread ends then).
RELEASES: dict[str, Any] = {}


def _db_clock(key: str) -> Any:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        reading = cursor.fetchone()[0]
    CLOCK_READINGS.setdefault(key, []).append(reading)
    return reading


def work_then_fail(key: str, work: float = 0.05, **kwargs: Any) -> None:
    """Read the database clock, work until it has moved on by ``work`` seconds, read it again, raise."""
    from django.db import connection

    first = _db_clock(key)
    with connection.cursor() as cursor:
        while True:  # the work: reads until the database clock says it is done (no sleep, no wall clock)
            cursor.execute("SELECT clock_timestamp() >= %s + make_interval(secs => %s)", [first, work])
            if cursor.fetchone()[0]:
                break
    _db_clock(key)
    raise ValueError("fails after doing its work")


def read_clock_then_overrun(key: str, **kwargs: Any) -> None:
    """Read the database clock, then wait (past the task's timeout) until the test releases it."""
    _db_clock(key)
    release = RELEASES.get(key)
    if release is not None:
        release.wait(120)


def _step_effect(phase: str) -> dict[str, Any]:
    """A durable step's write (an Effect row, committed with the step or not at all)."""
    _effect(phase)
    return {"phase": phase, "attempt": current_task().attempt}


def stepped(**kwargs: Any) -> list[Any]:
    """Two durable steps, the first attempt crashing between them: the retry gets the first step's
    stored result and runs only the second."""
    from tasks.steps import step

    first = step("one", _step_effect, "step-one")
    if current_task().attempt == 1:
        raise RuntimeError("crashed between its steps")
    return [first, step("two", _step_effect, "step-two")]


@task()
def stepped_django_task() -> list[Any]:
    """The same as ``stepped``, as a django.tasks task."""
    return stepped()


async def async_stepped(**kwargs: Any) -> list[Any]:
    """``stepped`` from an ``async def`` handler on the worker's event loop."""
    from tasks.steps import astep

    first = await astep("one", _step_effect, "astep-one")
    if current_task().attempt == 1:
        raise RuntimeError("crashed between its steps")
    return [first, await astep("two", _step_effect, "astep-two")]


def sleeper(seconds: float, **kwargs: Any) -> list[Any]:
    """A step, a durable sleep of ``seconds``, a step: the attempt that reaches the sleep ends there,
    and the one that runs after it gets the first step back stored."""
    from tasks.steps import sleep, step

    first = step("before", _step_effect, "before-sleep")
    sleep(seconds, name="nap")
    return [first, step("after", _step_effect, "after-sleep")]


async def async_sleeper(seconds: float, **kwargs: Any) -> list[Any]:
    """``sleeper`` from an ``async def`` handler on the worker's event loop."""
    from tasks.steps import asleep, astep

    first = await astep("before", _step_effect, "abefore-sleep")
    await asleep(seconds, name="nap")
    return [first, await astep("after", _step_effect, "aafter-sleep")]


def event_waiter(event: str, timeout: float | None = None, **kwargs: Any) -> dict[str, Any]:
    """A step, a wait for the event ``event`` (its payload, None at the timeout), a step."""
    from tasks.steps import step, wait_for_event

    step("before", _step_effect, "before-event")
    payload = wait_for_event(event, timeout=timeout)
    step("after", _step_effect, "after-event")
    return {"payload": payload}


async def async_event_waiter(event: str, timeout: float | None = None, **kwargs: Any) -> dict[str, Any]:
    """``event_waiter`` from an ``async def`` handler."""
    from tasks.steps import astep, await_event

    await astep("before", _step_effect, "before-event")
    payload = await await_event(event, timeout=timeout)
    await astep("after", _step_effect, "after-event")
    return {"payload": payload}


def _effect_outside_the_step(phase: str) -> None:
    """An Effect row committed on a connection of its own, outside the step's open transaction."""
    from django.db import connections

    from tests.testapp.models import Effect

    run = current_task()
    connection = connections.create_connection("default")
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {Effect._meta.db_table} (task_id, token, attempt, phase, pid, created_at)"
                " VALUES (%s, %s, %s, %s, %s, now())",
                [run.id, run.token, run.attempt, phase, os.getpid()],
            )
    finally:
        connection.close()


def step_then_wait(gate: str, **kwargs: Any) -> dict[str, Any]:
    """One durable step that writes, then waits inside the step for the gate ``<gate>:<token>`` of
    its attempt (a worker paused there past its lease is the zombie whose step must roll back)."""
    from tasks.steps import step

    def charge() -> dict[str, Any]:
        _effect("charge")
        _effect_outside_the_step("inside")  # committed at once: the test sees the worker is in the step
        _wait_for_gate(f"{gate}:{current_task().token}")
        return {"pid": os.getpid()}

    _effect("entering")
    return step("charge", charge)


def event_taken_then_frozen(**kwargs: Any) -> dict[str, Any]:
    """Attempt 1 records the wait's deadline, waits for gate ``sent`` (the test sends the
    event while it runs: stored undelivered), then runs the wait's second step exactly as
    wait_for_event does, but stays inside it after taking the event (for the test to SIGSTOP it)."""
    from tasks.steps import _look_for, _waited, step, wait_for_event

    run = current_task()
    if run.attempt == 1:
        step("wait:go", lambda: None)
        _wait_for_gate("sent")

        def look(name: str, deadline: Any) -> Any:
            found = _look_for(name, deadline)
            _effect_outside_the_step("taken")
            _wait_for_gate(f"never:{run.token}")
            return found

        return {"payload": _waited(step("event:go", look, "go", None))}
    return {"payload": wait_for_event("go")}


def parent_of(
    child: str,
    child_kwargs: dict[str, Any] | None = None,
    child_options: dict[str, Any] | None = None,
    timeout: float | None = None,
    django_task: bool = False,
    **kwargs: Any,
) -> dict[str, Any]:
    """A step, a spawned child (``child``: an import path; a django.tasks Task's with ``django_task``), a
    wait for it, a step: what the child returned, or how it ended (tests/db/test_child_tasks.py)."""
    from django.utils.module_loading import import_string

    from tasks.exceptions import ChildTaskFailed, ChildTaskTimeout
    from tasks.steps import spawn, step, wait_for_task
    from tasks.workflows import step as child_step

    step("before", _step_effect, "before-child")
    target: Any = import_string(child) if django_task else child
    child_id = spawn(child_step(target, **(child_kwargs or {})).options(**(child_options or {})))
    try:
        outcome: dict[str, Any] = {"result": wait_for_task(child_id, timeout=timeout)}
    except ChildTaskFailed as failed:
        outcome = {"status": failed.status, "error": (failed.error or {}).get("exception_class_path")}
    except ChildTaskTimeout:
        outcome = {"timed_out": True}
    step("after", _step_effect, "after-child")
    return {"child": child_id, **outcome}


def parent_of_many(sums: list[list[int]], **kwargs: Any) -> list[Any]:
    """Fan-out and fan-in: one ``add`` child per pair of ``sums``, all spawned first, then waited for
    in turn (docs/howto/durable-steps.md, "Waiting for several children")."""
    from tasks.steps import spawn, wait_for_task
    from tasks.workflows import step as child_step

    children = [spawn(child_step("tests.testapp.handlers.add", a, b)) for a, b in sums]
    return [wait_for_task(child) for child in children]


async def async_parent_of(child: str, child_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """``parent_of`` from an ``async def`` handler."""
    from tasks.steps import aspawn, astep, await_task

    await astep("before", _step_effect, "abefore-child")
    child_id = await aspawn(child, **(child_kwargs or {}))
    result = await await_task(child_id)
    await astep("after", _step_effect, "aafter-child")
    return {"child": child_id, "result": result}
