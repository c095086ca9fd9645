"""The demo singleton: generates fake work only while it holds the generator lease.

Run it on every replica (``manage.py run_generator``); one leads, the others stand by and take
over when it dies. Its desired state lives in the database (:class:`~tasks.models.GeneratorState`),
so ``manage.py run_generator --stop`` (or the dashboard) on any replica reaches the leader: no
request has to land on the right instance behind a load balancer.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, Error, connections, transaction
from django.db.models import F
from django.db.models.functions import Now

from leasing.election import LeaderElection, Term
from leasing.exceptions import StaleTokenError
from leasing.fencing import fenced_update
from leasing.models import Lease
from tasks.demo import showcase
from tasks.models import GeneratorState, Task

logger = logging.getLogger("tasks.generator")

DEMO_TASK = "tasks.demo.sleep"


def lease_name(name: str) -> str:
    return f"tasks:generator:{name}"


def set_state(
    name: str = "default",
    *,
    running: bool | None = None,
    rate: float | None = None,
    max_sleep: float | None = None,
    queue: str | None = None,
) -> GeneratorState:
    """Change the desired state (from any replica); the leader picks it up at its next tick."""
    if rate is not None and not 0 < rate <= 10_000:
        raise ValueError("rate must be between 0 and 10000 tasks per second")
    if max_sleep is not None and not 0 < max_sleep <= 3600:
        raise ValueError("max_sleep must be between 0 and 3600 seconds")
    GeneratorState.objects.get_or_create(name=name)
    changes: dict[str, Any] = {
        key: value
        for key, value in {"running": running, "rate": rate, "max_sleep": max_sleep, "queue": queue}.items()
        if value is not None
    }
    if changes:
        GeneratorState.objects.filter(name=name).update(updated_at=Now(), **changes)
    return GeneratorState.objects.get(name=name)


@dataclass(frozen=True)
class GeneratorStatus:
    name: str
    running: bool
    rate: float
    max_sleep: float
    queue: str
    generated: int
    leader: str | None  # the instance holding the generator lease now, if any
    leader_expires_at: Any
    observed_running: bool


def status(name: str = "default") -> GeneratorStatus:
    state, _ = GeneratorState.objects.get_or_create(name=name)
    held = Lease.objects.active().filter(resource=lease_name(name)).first()
    return GeneratorStatus(
        name=name,
        running=state.running,
        rate=state.rate,
        max_sleep=state.max_sleep,
        queue=state.queue,
        generated=state.generated,
        leader=held.holder if held else None,
        leader_expires_at=held.expires_at if held else None,
        observed_running=state.observed_running,
    )


class Generator:
    def __init__(
        self,
        name: str = "default",
        *,
        ttl: float = 10.0,
        tick: float = 0.25,
        instance_id: str | None = None,
        using: str = DEFAULT_DB_ALIAS,
        with_showcase: bool | None = None,
    ) -> None:
        self.name = name
        self.tick = tick
        self.using = using
        self.election = LeaderElection(lease_name(name), ttl=ttl, holder=instance_id, retry_interval=min(1.0, ttl / 4))
        self.generated = 0
        self._owed = 0.0  # fractional tasks the rate owes since the last round
        # The demo project's other features at small rates (tasks/demo/showcase.py), when it asks.
        self.showcase = (
            showcase.Showcase() if (showcase.enabled() if with_showcase is None else with_showcase) else None
        )

    @property
    def instance_id(self) -> str:
        return self.election.holder

    def run(self) -> None:
        GeneratorState.objects.get_or_create(name=self.name)
        self.election.run(self._lead)

    def stop(self) -> None:
        self.election.stop()

    def _lead(self, term: Term) -> None:
        logger.info("generator %s leads (token %d)", self.instance_id, term.token)
        self._owed = 0.0
        last = time.monotonic()
        while not term.should_stop:
            try:
                now = time.monotonic()
                if not self._round(term, now - last):
                    return
                last = now
            except StaleTokenError:
                logger.warning("generator %s was deposed (a newer leader wrote); standing down", self.instance_id)
                return
            except Error as exc:
                logger.warning("generator round failed: %s", exc)
                connections[self.using].close()
            term.wait(self.tick)

    def _round(self, term: Term, elapsed: float) -> bool:
        """One tick: read the desired state, generate what the rate owes since the last tick."""
        state = GeneratorState.objects.get(name=self.name)
        count = 0
        if state.running:
            self._owed += elapsed * state.rate
            count = int(self._owed)
            self._owed -= count
        else:
            self._owed = 0.0
        if term.should_stop:
            return False
        # The fenced write and the inserts commit together: if a newer leader has written the
        # state row, our write raises StaleTokenError and nothing is inserted.
        with transaction.atomic(using=self.using):
            fenced_update(
                GeneratorState.objects.filter(name=self.name),
                term.token,
                leader=self.instance_id,
                leader_seen_at=Now(),
                observed_running=state.running,
                ticks=F("ticks") + 1,
                generated=F("generated") + count,
            )
            if count:
                Task.objects.bulk_enqueue(
                    DEMO_TASK,
                    (
                        {
                            "sleep_duration_seconds": round(random.uniform(0.05, state.max_sleep), 2),
                            "generator": self.instance_id,
                        }
                        for _ in range(count)
                    ),
                    queue=state.queue,
                )
            if state.running and self.showcase is not None:
                self._show(time.monotonic())
        self.generated += count
        return True

    def _show(self, now: float) -> None:
        """The showcase's due enqueues, in a savepoint of the round: one that fails (a feature's
        statement refused) is logged and costs the round's own sleep tasks nothing."""
        assert self.showcase is not None
        try:
            with transaction.atomic(using=self.using):
                self.showcase.due(now)
        except (Error, ValueError) as exc:
            logger.warning("demo showcase: an enqueue failed: %s", exc)
