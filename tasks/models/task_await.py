"""Waiting for a task to finish in async code (``await Task.objects.await_(task_id, timeout=10)``; a
django.tasks result's ``await_()``), on the event loop itself: no thread is held while it waits.

The waits of one event loop on one database alias share one :class:`Hub`: a connection that runs
their reads (the statements of tasks/models/task_wait.py, each short and never waiting for a lock)
and, where the alias allows LISTEN (tasks/lifecycle/listening.py), one more that LISTENs on
``leasing_task_finished`` and wakes the waits of the id each notification names. Behind a pooler the
waits poll as the sync wait does. The hub opens with its first wait and closes with its last: a wait
its caller cancels (``asyncio.wait_for``, an ASGI client hanging up) leaves at once, and the last to
leave closes the connections. A read a cancelled wait started is finished by the hub (never cut off
halfway on a shared connection) and its answer dropped.

A timeout counts from the call, on the loop's clock: nothing waits for a free thread first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import psycopg
from asgiref.sync import sync_to_async
from django.db import connections

from tasks.exceptions import TaskError, TaskWaitTimeout
from tasks.lifecycle.listening import athrough_a_pooler, connect_async, wakeup_for
from tasks.lifecycle.states import FINISHED
from tasks.models.finished import FINISHED_STATUS_SQL
from tasks.models.task_send import OperationsBase
from tasks.models.task_wait import (
    FINISHED_CHANNEL,
    FIRST_POLL,
    MARK_WAITED_SQL,
    READ_STATUS_SQL,
    not_in_database,
)

#: Open hubs: one per event loop and alias while a wait of that loop on that alias is under way.
_hubs: dict[tuple[asyncio.AbstractEventLoop, str], Hub] = {}
#: Hubs closing (their last wait left): held here until their connections are closed.
_closing: set[asyncio.Task[None]] = set()
#: Hubs whose connections are open (or opening), whether or not a new wait may still join them.
_open: set[Hub] = set()


class Hub:
    """The connections every async wait of one loop on one alias shares (see the module doc)."""

    def __init__(self, using: str) -> None:
        self.using = using
        self.waits = 0
        self.listening = False
        self.woken: dict[int, set[asyncio.Event]] = {}
        self.reads: set[asyncio.Task[Any]] = set()
        self.reader: psycopg.AsyncConnection | None = None
        self.listener: psycopg.AsyncConnection | None = None
        self.abandoned = False
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.life = asyncio.get_running_loop().create_task(self.live(), name=f"task waits on {using}")

    @classmethod
    def join(cls, using: str) -> Hub:
        _close_abandoned()
        key = (asyncio.get_running_loop(), using)
        hub = _hubs.get(key)
        if hub is None:
            hub = _hubs[key] = cls(using)
            _open.add(hub)
        hub.waits += 1
        return hub

    def leave(self) -> None:
        self.waits -= 1
        if self.waits == 0:
            self.retire()
            if self.life.get_loop().is_closed():  # a pending wait collected after its loop was closed
                self.abandon()
                return
            self.life.cancel()
            _closing.add(self.life)
            self.life.add_done_callback(_closing.discard)

    def retire(self) -> None:
        """No new wait joins this hub (its last wait left, or its reading connection broke)."""
        key = (self.life.get_loop(), self.using)
        if _hubs.get(key) is self:
            del _hubs[key]

    async def live(self) -> None:
        """Open the connections, LISTEN where the alias allows it, hand notifications to the waits of
        their ids; when cancelled (the last wait left), finish the reads under way and close."""
        listener = None
        try:
            try:
                aconnect = wakeup_for(self.using, FIRST_POLL).aconnect
                if aconnect is not None:
                    self.listener = listener = await aconnect()
                    if await athrough_a_pooler(listener):
                        await listener.close()  # an undeclared pooler: its LISTEN would be lost
                        self.listener = listener = None
                    else:
                        await listener.execute(f"LISTEN {FINISHED_CHANNEL}")
                self.reader = await (aconnect or (lambda: connect_async(self.using)))()
            except Exception as exc:
                self.retire()
                self.ready.set_exception(exc)
                return
            self.listening = listener is not None
            self.ready.set_result(None)
            if listener is not None:
                with contextlib.suppress(psycopg.Error):
                    async for notify in listener.notifies():
                        with contextlib.suppress(ValueError):
                            self.wake(self.woken.get(int(notify.payload), ()))
                # The listener broke: this hub's waits poll from now on, each woken to re-read first,
                # and the waits that start later open a hub of their own, listening again (joined
                # before this one's last wait left, they would all poll, on a loop that never lacks
                # a wait for as long as it runs: an ASGI server's).
                self.listening = False
                self.retire()
                self.wake(event for events in self.woken.values() for event in events)
            await asyncio.get_running_loop().create_future()  # until the last wait leaves
        finally:
            # Closed by abandon(), its loop closed: nothing may be awaited.
            if not self.abandoned:
                if not self.ready.done():
                    self.ready.cancel()
                if self.reads:
                    await asyncio.gather(*self.reads, return_exceptions=True)
                for conn in (self.listener, self.reader):
                    if conn is not None:
                        await conn.close()
                _open.discard(self)

    def abandon(self) -> None:
        """Its loop was closed with waits pending (this hub never ran to its end): close its
        connections from here, as the loop can no longer."""
        _open.discard(self)
        self.abandoned = True
        self.retire()
        for conn in (self.listener, self.reader):
            if conn is not None and not conn.closed:
                conn.pgconn.finish()  # the socket closed at once; nothing of the loop's is needed

    @staticmethod
    def wake(events: Any) -> None:
        for event in events:
            event.set()

    async def fetchone(self, sql: str, params: Any) -> Any:
        """One row of a short statement on the shared connection. A wait cancelled meanwhile leaves
        at once; the hub finishes the statement (a cut-off one would leave the connection busy)."""
        read = asyncio.ensure_future(self._fetchone(sql, params))
        self.reads.add(read)
        read.add_done_callback(self._read_done)
        return await asyncio.shield(read)

    async def _fetchone(self, sql: str, params: Any) -> Any:
        assert self.reader is not None
        try:
            return await (await self.reader.execute(sql, params)).fetchone()
        except psycopg.Error:
            if self.reader.broken or self.reader.closed:
                self.retire()  # the next wait opens a new hub
            raise

    def _read_done(self, read: asyncio.Task[Any]) -> None:
        self.reads.discard(read)
        if not read.cancelled():
            read.exception()  # retrieved: a cancelled wait's read may fail with nobody to tell

    async def status(self, task_id: int, *, mark: bool) -> tuple[str, bool]:
        """(status, marked): marks the row waited for when ``mark`` (MARK_WAITED_SQL), else reads it."""
        if mark:
            row = await self.fetchone(MARK_WAITED_SQL, {"id": task_id})
        else:
            row = await self.fetchone(READ_STATUS_SQL, [task_id])
            row = None if row is None else (row[0], True)
        if row is None:  # moved to tasks_finished once final, or deleted
            found = await self.fetchone(FINISHED_STATUS_SQL, [task_id])
            if found is None:
                raise LookupError(task_id)  # in neither table
            row = (found[0], False)
        return row[0], bool(row[1])


def _close_abandoned() -> None:
    """The connections of hubs whose event loop was closed while waits were pending (``loop.close()``
    with the waits' tasks never finished: asyncio.run cancels them first, a hand-made loop may not):
    nothing will run their close, and the module keeps them. Looked for at each wait's start."""
    for hub in [h for h in _open if h.life.get_loop().is_closed()]:
        hub.abandon()


class AwaitOperations(OperationsBase):
    """Waiting for a task to finish in async code. A base of TaskQuerySet: its methods are
    ``Task.objects``'s."""

    async def await_(self, task_id: int, *, timeout: float | None = None, poll: float = 1.0) -> Any:
        """:meth:`wait` for async code: the task's row once it is final, waited for on the running
        event loop (the module doc). The row is read in one short call on a thread of the loop's
        default executor, its connection closed when it returns."""
        using = self.db
        await self.await_final(task_id, timeout=timeout, poll=poll)

        def find() -> Any:
            try:
                return self.model.objects.db_manager(using).find(task_id)
            finally:
                connections.close_all()  # this thread's own: nothing else will close them

        task = await sync_to_async(find, thread_sensitive=False)()
        if task is None:
            raise self.model.DoesNotExist(f"task {task_id} was deleted once it finished")
        return task

    async def await_final(self, task_id: int, *, timeout: float | None = None, poll: float = 1.0) -> str:
        """The task's final status once it has one, waited for on the running event loop (what
        :meth:`await_` and a result's ``await_()`` read the rest after);
        :class:`~tasks.exceptions.TaskWaitTimeout` after ``timeout`` seconds from the call."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0 or None, not {timeout!r}")
        using = self.db
        deadline = None if timeout is None else time.monotonic() + timeout
        hub = Hub.join(using)
        woken = asyncio.Event()
        hub.woken.setdefault(task_id, set()).add(woken)
        try:
            await asyncio.shield(hub.ready)
            try:
                status, marked = await hub.status(task_id, mark=True)
            except LookupError:
                raise self.model.DoesNotExist(not_in_database(task_id, using)) from None
            pause = FIRST_POLL
            while status not in FINISHED:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TaskWaitTimeout(task_id, status, timeout or 0.0)
                step = poll if left is None else min(poll, left)
                if hub.listening and marked:
                    # asyncio's own TimeoutError: not the builtin one before Python 3.11
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(woken.wait(), step)
                else:
                    await asyncio.sleep(min(pause, step))
                    pause = min(pause * 2, poll)
                woken.clear()  # before the read: a finish notified from now on ends the next pause
                try:
                    status, marked = await hub.status(task_id, mark=not marked)
                except LookupError:
                    raise self.model.DoesNotExist(f"task {task_id} was deleted while it was waited for") from None
            return status
        except psycopg.Error as exc:
            raise TaskError(f"waiting for task {task_id}: the database refused: {exc}") from exc
        finally:
            waiting = hub.woken.get(task_id)
            if waiting is not None:
                waiting.discard(woken)
                if not waiting:
                    del hub.woken[task_id]
            hub.leave()
