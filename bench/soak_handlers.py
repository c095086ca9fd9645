"""The crash soak's handler: one fenced effect per task (see bench/soak.py)."""

from __future__ import annotations

import os
import random
import time

from django.db.models import F

from leasing.exceptions import StaleTokenError
from leasing.fencing import fenced_update
from tasks.runtime import current_task


def effect(key: str) -> str:
    from tests.testapp.models import Effect, FencedRecord

    _record_start()
    run = current_task()
    Effect.objects.create(task_id=run.id, token=run.token, attempt=run.attempt, phase="started", pid=os.getpid())
    # Sleep before the write: a worker paused here wakes up to find a newer attempt has written.
    time.sleep(random.uniform(0.001, 0.005))
    try:
        fenced_update(FencedRecord.objects.filter(key=key), run.token, value=run.worker_id, writes=F("writes") + 1)
    except StaleTokenError:
        # A newer attempt already wrote: this one was paused or lost its lease. The fence said no.
        Effect.objects.create(
            task_id=run.id, token=run.token, attempt=run.attempt, phase="stale-rejected", pid=os.getpid()
        )
        raise
    return key


def _record_start() -> None:
    """Evidence that the handler was called, which survives SIGKILL a microsecond later: one line
    appended to a file (kernel page cache), not a database row that may never commit."""
    directory = os.environ.get("SOAK_START_LOG")
    if directory:
        run = current_task()
        _append_line(directory, "starts", f"{run.id} {run.attempt}")


def _append_line(directory: str, prefix: str, line: str) -> None:
    """``line`` appended to this process's file ``<prefix>-<pid>.txt`` in ``directory``: one write of
    O_APPEND, in the kernel's page cache once it returns, so a SIGKILL the moment after keeps it."""
    fd = os.open(os.path.join(directory, f"{prefix}-{os.getpid()}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def misbehave(key: str, kind: str) -> object:
    """What a careless task author writes: each kind ends in a recorded outcome, never a wedge."""
    _record_start()
    if kind == "nan":
        return {"mean": float("nan")}
    if kind == "inf":
        return [float("inf")]
    if kind == "nul":
        return "a\x00b"
    if kind == "surrogate":
        return {"text": "\ud800"}
    if kind == "object":
        return object()
    if kind == "error-nul":
        raise ValueError("bad byte \x00 in the input")
    if kind == "error-surrogate":
        raise ValueError("undecodable \udcff")
    if kind == "system-exit":
        raise SystemExit(3)
    if kind == "keyboard-interrupt":
        raise KeyboardInterrupt
    if kind == "timeout":
        time.sleep(1.0)  # the task's timeout is 0.3 s: abandoned, then this late result is dropped
        return "late"
    if kind == "poison":
        os._exit(7)  # kills every worker it lands on
    raise ValueError(f"unknown kind {kind}")


# -- durable steps (bench/durable_steps.py) -----------------------------------------------------------


def stepped(steps: int, slow: float = 0.0) -> int:
    """``steps`` durable steps, each writing an effect row inside its fenced transaction and calling a
    counting "external service" with its step key (bench/durable_steps.py counts both). ``slow``: the
    second step takes that many seconds (a zombie paused in it wakes while the worker that took the
    task over is still inside the same step)."""
    from tasks.steps import step

    for n in range(steps):
        step(f"part-{n}", _step_effect, n, slow if n == 1 else 0.0)
    return steps


def _step_effect(n: int, slow: float = 0.0) -> int:
    from tasks.steps import step_key
    from tests.testapp.models import Effect

    run = current_task()
    Effect.objects.create(task_id=run.id, token=run.token, attempt=run.attempt, phase=f"step-{n}", pid=os.getpid())
    # A kill or a pause lands inside the step (its write made, not committed) as often as between steps.
    time.sleep(slow or random.uniform(0.01, 0.05))
    _external_call(step_key(), run.attempt)
    return n


def _external_call(key: str, attempt: int) -> None:
    """The payment provider of the benchmark: it records every call (key, attempt, the time on this
    machine's clock) in a file, which survives SIGKILL the moment after."""
    _append_line(os.environ["DURABLE_CALL_LOG"], "calls", f"{key} {attempt} {time.time():.6f}")


def noop_steps(steps: int) -> int:
    """``steps`` steps that do nothing: what a step costs (bench/durable_steps.py overhead)."""
    from tasks.steps import step

    for n in range(steps):
        step(f"noop-{n}", _nothing)
    return steps


def _nothing() -> None:
    return None
