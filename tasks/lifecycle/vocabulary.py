"""The one vocabulary of a task's state: the name every page, the admin, the API's human fields and the
docs give each status, each view of a status, and each operator action.

A **status** is what a row holds (``TaskStatus``, the ``django.tasks`` names plus this queue's own
AWAITING and BLOCKED): its machine value (``READY``) is what the API, the database and the filters
take; its label (``Ready``) is what a person reads. A **view** is part of one status that the dashboard
lists apart (a stuck task is RUNNING, a retrying one READY): it has a label of its own, and a task in
a view is shown by the view's label alone, so that a page never calls one task by two names.

An **operator action** is what a button does. Which statuses it fits comes from the transition
table (tasks/lifecycle/transitions.py): the sources of the event it performs. Run now moves
``run_after`` only (a status-preserving statement), so its statuses are the waiting ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tasks.lifecycle.states import WAITING, TaskStatus
from tasks.lifecycle.transitions import SUCCESSFUL, TRANSITIONS


@dataclass(frozen=True, slots=True)
class State:
    #: The status's machine value (``READY``) or the view's name (``stuck``).
    key: str
    label: str
    #: What it means, in one line (the dashboard's tab descriptions, docs/reference/dashboard.md).
    meaning: str
    #: The status a task in this state has.
    status: str

    @property
    def is_view(self) -> bool:
        return self.key != self.status


STATUSES: dict[str, State] = {
    s.value: State(s.value, str(s.label), meaning, s.value)
    for s, meaning in (
        (TaskStatus.AWAITING, "a workflow member waiting for the tasks it depends on"),
        (TaskStatus.BLOCKED, "waiting for a free slot of its concurrency key"),
        (TaskStatus.READY, "waiting to run (due now or at its run after)"),
        (TaskStatus.RUNNING, "held by a worker with a live lease"),
        (TaskStatus.SUCCESSFUL, "finished: its handler returned"),
        (TaskStatus.FAILED, "finished: out of attempts, or an error its retry policy does not retry"),
        (TaskStatus.CANCELLED, "finished: cancelled by an operator, its handler or a failed dependency"),
    )
}

VIEWS: dict[str, State] = {
    view.key: view
    for view in (
        State("retrying", "Retrying", "Ready after a failure or a lost worker: waiting to run again", "READY"),
        State("snoozed", "Snoozed", "Ready after its handler snoozed it: waiting for its wake time", "READY"),
        State(
            "stuck",
            "Stuck",
            "Running, but its lease expired: the worker died or stalled; recovery requeues it",
            "RUNNING",
        ),
    )
}

#: Every state a page may name, statuses first.
STATES: dict[str, State] = {**STATUSES, **VIEWS}


def label(key: str) -> str:
    """The label of a status (``READY``) or a view (``stuck``); an unknown key is shown as it is."""
    state = STATES.get(key)
    return state.label if state is not None else key


def status_from_label(text: str) -> str | None:
    """The status a person named: its label or its machine value, in any case (``Ready``, ``ready``,
    ``READY``). None for anything else (a view is not a status a filter can take)."""
    wanted = text.strip().casefold()
    for state in STATUSES.values():
        if wanted in (state.label.casefold(), state.key.casefold()):
            return state.key
    return None


def state_of(task: Any) -> State:
    """The one state a page shows a task (a ``tasks.models.Task``) in: its view when it is in one, else
    its status."""
    if task.is_stuck:
        return VIEWS["stuck"]
    if task.status == TaskStatus.READY:
        if task.snoozed_at is not None:
            return VIEWS["snoozed"]
        if task.failures or task.crashes or task.shared_crashes:
            return VIEWS["retrying"]
    return STATUSES[task.status]


# -- operator actions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Action:
    #: The form's value (``action=cancel``).
    name: str
    label: str
    #: The statuses it applies to, from the transition table.
    statuses: tuple[str, ...]
    danger: bool = False


def _sources(event: str) -> tuple[str, ...]:
    (transition,) = (t for t in TRANSITIONS if t.event == event)
    return transition.sources


ACTIONS: dict[str, Action] = {
    action.name: action
    for action in (
        # ActionOperations.retry_now: run_after = now on waiting rows (status-preserving).
        Action("run_now", "Run now", tuple(WAITING)),
        # The requeue event. A successful task is not retried: it is run again, a separate button.
        Action("retry", "Retry", tuple(s for s in _sources("requeue") if s != SUCCESSFUL)),
        Action("run_again", "Run again", tuple(s for s in _sources("requeue") if s == SUCCESSFUL)),
        Action("cancel", "Cancel", _sources("cancel"), danger=True),
    )
}


def actions_for(statuses: Iterable[str]) -> list[Action]:
    """The actions that fit every one of ``statuses`` (none for no status)."""
    wanted = set(statuses)
    if not wanted:
        return []
    return [action for action in ACTIONS.values() if wanted <= set(action.statuses)]
