"""How an idle worker learns of new work: LISTEN where a session is its own, polling where it is not.

Behind a transaction pooler (PgBouncer ``pool_mode = transaction``) a LISTEN holds on whichever server
connection ran it, which the pooler hands to other clients between transactions; notifications are
then lost or delivered to someone else. So a worker LISTENs on the alias's own connection settings
only when the alias is not pooled (``LEASING_TASKS["POOLED_DATABASES"]``), on a direct URL when one is
given (``LEASING_TASKS["LISTEN_URLS"]``), and otherwise polls every poll interval. The worker's start
line says which.

A pooler nobody declared is found on the listener's first connection: PgBouncer (and the poolers like
it) answer a client's startup with a cancel key of their own, so the backend pid the connection was
told is not the pid of the server session that runs its statements. The worker then says so in a
warning naming the setting to change, and polls.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Sequence

from tasks.lifecycle.listening import WakeUp, through_a_pooler
from tasks.lifecycle.states import NOTIFY_CHANNEL
from tasks.worker.mailbox import Mailbox

logger = logging.getLogger("tasks.worker")


class Listener:
    """LISTENs for enqueues into the worker's queues and wakes the dispatcher at once; reconnects
    after a failure. Its wait ends at once on :meth:`stop` (a byte on a pipe), not at a poll."""

    def __init__(
        self, wakeup: WakeUp, mailbox: Mailbox, *, queues: Sequence[str], worker_id: str, poll_interval: float
    ):
        assert wakeup.connect is not None
        self.connect = wakeup.connect
        self.description = wakeup.description.removeprefix("LISTEN on ")
        self.using = wakeup.using
        self.mailbox = mailbox
        self.queues = set(queues)
        self.worker_id = worker_id
        self.poll_interval = poll_interval
        self._stop = threading.Event()
        self._pipe = os.pipe()  # (read, write): a byte written ends the wait at once
        self._pipe_lock = threading.Lock()  # a stop never writes to a pipe run() has closed
        self._closed = False

    def stop(self) -> None:
        with self._pipe_lock:
            self._stop.set()
            if not self._closed:
                os.write(self._pipe[1], b"x")

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                self._listen()
        finally:
            with self._pipe_lock:
                self._closed = True
                for fd in self._pipe:
                    os.close(fd)

    def _listen(self) -> None:
        conn = None
        try:
            conn = self.connect()
            if through_a_pooler(conn):
                logger.warning(
                    "worker %s: %s goes through a connection pooler (the backend pid it announced, %s, is not"
                    " the pid of the session that runs its statements): a LISTEN there loses notifications, so"
                    " this worker polls every %gs. Declare it: LEASING_TASKS['POOLED_DATABASES'] = [%r] (and"
                    " give LISTEN_URLS a direct URL to be woken at once); see docs/howto/pgbouncer.md",
                    self.worker_id,
                    self.description,
                    conn.info.backend_pid,
                    self.poll_interval,
                    self.using,
                )
                self._stop.set()  # the dispatcher's wait is the poll interval: it polls from now on
                return
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self.mailbox.notify()  # anything enqueued while we were not listening
            # Wait on the connection and on the stop pipe at once: a stop ends the wait at once (no
            # polling), a notification wakes the dispatcher at once.
            poller = select.poll()
            poller.register(conn.fileno(), select.POLLIN)
            poller.register(self._pipe[0], select.POLLIN)
            while not self._stop.is_set():
                poller.poll(self.poll_interval * 1000)
                for notice in conn.notifies(timeout=0):
                    if notice.payload in self.queues:
                        self.mailbox.notify()
        except Exception as exc:
            logger.warning("worker %s: listener connection failed: %s", self.worker_id, exc)
            self._stop.wait(1.0)
        finally:
            if conn is not None:
                try:
                    conn.close()
                except Exception:
                    logger.debug("closing the listener connection failed", exc_info=True)
