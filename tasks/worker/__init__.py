"""The worker process, in parts around one attempt (tasks.runtime.Execution, keyed by task id and
fencing token):

- ``process.py``: the ``Worker``, which builds the parts, starts them and stops them in order;
- ``session.py``: its id, database, counters, stop flags, bounded and retried statements;
- ``mailbox.py``: the hand-offs between its threads; ``ledger.py``: the attempts it holds;
- ``dispatcher.py``: the one thread that writes (finish, mark started, claim, route);
  ``positions.py``: where its claims resume; ``timeouts.py``: attempts past their timeout;
  ``endings.py``: how an attempt's end is told (counters, log record, signal, span);
- ``threads.py`` and ``aio.py``: the executors (threads; an event loop for ``async def``);
- ``handlers.py``: from a task path to its handler, and from what it did to an outcome;
- ``writer.py``: outcomes that cannot wedge it; ``heartbeat.py``; ``listener.py`` (LISTEN or poll);
- ``sizing.py``: how much it claims (pure functions); ``slots.py``: kept concurrency-key slots;
- ``isolation.py``: an isolated task's turn; ``signals.py``: ``task_started`` / ``task_finished``;
- ``identity.py``: its name and incarnation id.

``tasks.worker.Worker`` is the public path."""

from tasks.worker.identity import check_worker_name, default_worker_name, incarnation_id
from tasks.worker.process import Worker

__all__ = ["Worker", "check_worker_name", "default_worker_name", "incarnation_id"]
