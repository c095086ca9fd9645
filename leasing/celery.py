"""Celery tasks that hold a lease while their body runs, so broker redelivery cannot run them twice.

    from celery import shared_task
    from leasing.celery import LeasedTask

    @shared_task(base=LeasedTask, bind=True, acks_late=True, lease_key="invoice_id", lease_ttl=60)
    def send_invoice(self, invoice_id):
        fenced_update(Invoice.objects.filter(pk=invoice_id), self.request.lease_token, sent=True)

The problem: with a Redis or SQS broker, a message that is not acknowledged within the visibility
timeout is delivered again, to another worker, while the first may still be running; with
``acks_late``, a worker that dies mid-task gets its message redelivered. Either way the body runs
twice, often at the same time. Locks that never expire wedge after a crash; locks that expire
while the body still runs let the duplicate in.

Here the body runs under a lease (renewed in the background, released at the end) keyed by the
task name and the chosen arguments. A delivery that finds the lease held by a live holder does
not run. What it does instead is ``lease_on_held``:

- ``"retry"`` (the default): re-schedule itself for later (``self.retry``). This is the choice
  that is right for redelivery: if the first delivery is alive and finishes, the retry then finds
  the *completion marker* (below) and is acknowledged without running; if the first delivery's
  worker died, its lease expires within ``lease_ttl`` and the retry runs the body, once.
- ``"skip"``: acknowledge and drop the delivery. Only safe when something else guarantees a later
  run (a periodic task that will come round again), because a redelivery after a crash can arrive
  before the dead holder's lease has expired.

Completion marker (``lease_dedup``, on by default): when the body succeeds, a long lease
``<key>:done`` (``lease_dedup_ttl``, a day by default) is taken and never released; deliveries of
the same key that arrive within that window are acknowledged without running. Turn it off for
tasks that should run again for the same arguments (a refresh), keep it for effects (a payment).

The body sees its lease as ``self.request.lease`` (a :class:`~leasing.holder.LeaseHolder`) and the
fencing token as ``self.request.lease_token``, for :func:`leasing.fencing.fenced_update`; a
long body can call ``self.request.lease.check()`` between steps.

Settings keep the convention users already have: ``app.config_from_object("django.conf:settings",
namespace="CELERY")``; nothing here needs a Celery setting of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable, Sequence
from typing import Any

from celery import Task
from celery.exceptions import Ignore
from django.db import close_old_connections

from leasing.holder import LeaseHolder
from leasing.models import Lease

logger = logging.getLogger("leasing.celery")

KeySpec = str | Sequence[str] | Callable[..., str] | None


def lease_key_for(
    task_name: str, spec: KeySpec, args: Sequence[Any], kwargs: dict[str, Any], arg_names: Sequence[str]
) -> str:
    """The lease resource of one call: ``celery:<task name>:<chosen arguments>``."""
    if callable(spec):
        return f"celery:{task_name}:{spec(*args, **kwargs)}"
    bound = dict(zip(arg_names, args, strict=False)) | kwargs
    if spec is None:
        chosen: Any = {"args": list(args), "kwargs": kwargs}
    else:
        names = [spec] if isinstance(spec, str) else list(spec)
        missing = [name for name in names if name not in bound]
        if missing:
            raise ValueError(f"lease_key names argument(s) {missing} that {task_name} was not called with")
        chosen = {name: bound[name] for name in names}
    text = json.dumps(chosen, sort_keys=True, default=str)
    if len(text) > 120:
        text = hashlib.sha256(text.encode()).hexdigest()[:32]
    return f"celery:{task_name}:{text}"


class LeasedTask(Task):
    """Celery task base class: the body runs only while this delivery holds the call's lease."""

    abstract = True
    #: Which arguments identify "the same work": a name, a list of names, a callable(*args, **kwargs)
    #: returning a string, or None (all arguments).
    lease_key: KeySpec = None
    lease_ttl: float = 60.0
    #: "retry" (default; right for redelivery) or "skip" (acknowledge and drop).
    lease_on_held: str = "retry"
    #: Seconds before a deferred delivery tries again (default: half the TTL, jittered).
    lease_retry_countdown: float | None = None
    #: How many times a delivery may be deferred before giving up (None: until it gets its turn).
    lease_max_retries: int | None = 1000
    #: Mark success with a ``<key>:done`` lease; deliveries within ``lease_dedup_ttl`` do not run.
    lease_dedup: bool = True
    lease_dedup_ttl: float = 86_400.0

    def _arg_names(self) -> list[str]:
        import inspect

        run = self.run
        try:
            names = list(inspect.signature(run).parameters)
        except (TypeError, ValueError):
            return []
        return names

    def lease_resource(self, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
        return lease_key_for(self.name, self.lease_key, args, kwargs, self._arg_names())

    def _holder_id(self) -> str:
        request = self.request
        return f"celery:{request.hostname or 'worker'}:{request.id or 'eager'}:{random.getrandbits(32):08x}"

    def on_lease_held(self, resource: str, holder: str | None, action: str) -> None:
        """Called when a delivery does not run because the lease is held (or the work is done)."""
        logger.warning("task %s[%s]: %s is held by %s; %s", self.name, self.request.id, resource, holder, action)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request.called_directly:  # a plain function call, not a delivery
            return self.run(*args, **kwargs)
        close_old_connections()
        resource = self.lease_resource(args, kwargs)
        done_marker = f"{resource}:done"
        held = LeaseHolder(resource, ttl=self.lease_ttl, timeout=0, holder=self._holder_id())
        if not held.try_acquire():
            current = Lease.objects.active().filter(resource=resource).values_list("holder", flat=True).first()
            if self.lease_on_held == "skip":
                self.on_lease_held(resource, current, "skipped")
                raise Ignore()
            countdown = self.lease_retry_countdown or self.lease_ttl / 2
            self.on_lease_held(resource, current, f"deferred by {countdown:.1f}s")
            raise self.retry(
                args=args,
                kwargs=kwargs,
                countdown=countdown * random.uniform(0.8, 1.2),
                max_retries=self.lease_max_retries,
            )
        # The marker is checked while holding the lease: a finished delivery sets it before it
        # releases, so whoever holds the lease now sees it if the work was done.
        if self.lease_dedup and Lease.objects.active().filter(resource=done_marker).exists():
            held.release()
            self.on_lease_held(resource, None, "already done: acknowledged without running")
            raise Ignore()
        held._start_heartbeat()
        self.request.lease = held
        self.request.lease_token = held.token
        try:
            result = self.run(*args, **kwargs)
            if self.lease_dedup and not held.lost:
                Lease.objects.acquire(
                    done_marker, held.holder, ttl=self.lease_dedup_ttl, metadata={"task_id": self.request.id}
                )
            return result
        finally:
            held.release()
            close_old_connections()
