"""The task state machine as one table: every way a task row changes status, and the statements that
do it.

A statement is named by where it lives:

- ``tasks.lifecycle.claim.CLAIM_SQL``: a SQL constant (a module attribute: the module of its transition
  family, tasks/lifecycle/statements.py lists them; its text as it runs is in tasks/sql/);
- ``tasks.models.task_actions.ActionOperations.cancel``: an ORM operation (a method);
- ``db:tasks_concurrency_admit``: a function the migrations create in the database (trigger
  functions and the admission; tasks/sql/schema.sql holds their current text).

``tests/unit/test_transitions.py`` and ``tests/db/test_transitions.py`` hold the code to this table:
each name resolves, and every constant, ORM update and database function that writes a task's
status (or inserts or deletes task rows) is named here. ``docs/explanation/state-machine.md`` is
generated from it (:func:`mermaid`); a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.lifecycle.fragments import capped_errors
from tasks.lifecycle.states import TaskStatus

#: Stands for "no row": the source of an enqueue, the target of a prune.
NO_ROW = "(none)"

AWAITING = TaskStatus.AWAITING.value
BLOCKED, READY, RUNNING = TaskStatus.BLOCKED.value, TaskStatus.READY.value, TaskStatus.RUNNING.value
SUCCESSFUL, FAILED, CANCELLED = TaskStatus.SUCCESSFUL.value, TaskStatus.FAILED.value, TaskStatus.CANCELLED.value
FINISHED = (SUCCESSFUL, FAILED, CANCELLED)

_W = "tasks.lifecycle.workflows."
_B = "tasks.lifecycle.bulk."


@dataclass(frozen=True, slots=True)
class Transition:
    event: str
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    statements: tuple[str, ...]
    why: str


TRANSITIONS: tuple[Transition, ...] = (
    Transition(
        "enqueue",
        (NO_ROW,),
        (READY, BLOCKED, AWAITING),
        (
            "tasks.lifecycle.enqueue.ENQUEUE_SQL",
            "tasks.lifecycle.enqueue.ENQUEUE_DEDUP_SQL",
            "tasks.lifecycle.enqueue.ENQUEUE_UNIQUE_SQL",
            "tasks.lifecycle.enqueue.ENQUEUE_DEBOUNCE_SQL",
            "tasks.lifecycle.enqueue.BULK_ENQUEUE_SQL",
            _W + "INSERT_MEMBERS_SQL",
            "tasks.maintenance.scheduler.SLOT_SQL",
            "db:tasks_concurrency_inserted",
        ),
        "a new row is READY; one whose concurrency key has no free slot is BLOCKED by the insert trigger; "
        "a workflow member that depends on others is AWAITING; "
        "the scheduler enqueues a periodic task's slot in the statement that advances its schedule; "
        "a key's unique_for window admits a task only in the statement that opens the next window; a "
        "debounced enqueue of a key whose task still waits updates that task instead (its arguments and "
        "start; a keyed one whose start moves later gives its slot up: wait for a slot)",
    ),
    Transition(
        "release",
        (AWAITING,),
        (READY,),
        ("db:tasks_workflow_settle",),
        "the last task it depends on became final (SUCCESSFUL, or any final status under "
        "on_parent_failure='run'): in the statement that finished that task (its workflow trigger); "
        "a keyed task then waits for its slot (BLOCKED) as any",
    ),
    Transition(
        "cancel by dependency",
        (AWAITING,),
        (CANCELLED,),
        ("db:tasks_workflow_settle", _W + "CANCEL_AT_ONCE_SQL"),
        "a task it depends on (or theirs, down the graph) failed or was cancelled, under "
        "on_parent_failure='cancel': in the statement that ended that task; at enqueue if one already had",
    ),
    Transition(
        "admit",
        (BLOCKED,),
        (READY,),
        ("db:tasks_concurrency_admit",),
        "a slot of the key came free (a holder finished, was deleted or released a kept slot) or the "
        "task came due; called by the row and statement triggers and by the sweep "
        "(tasks.lifecycle.concurrency.SWEEP_SQL)",
    ),
    Transition(
        "wait for a slot",
        (READY,),
        (BLOCKED,),
        ("db:tasks_concurrency_changed", "tasks.lifecycle.enqueue.ENQUEUE_DEBOUNCE_SQL"),
        "an update made a keyed task READY (retry, hand-back, recovery, requeue) while its key is full; a "
        "debounce pushed an admitted task's start later (its slot goes to the key's next due task in the same "
        "statement)",
    ),
    Transition(
        "claim",
        (READY,),
        (RUNNING,),
        (
            "tasks.lifecycle.claim.CLAIM_SQL",
            "tasks.lifecycle.rounds.FINISH_AND_CLAIM_SQL",
            "tasks.lifecycle.rounds.FINISH_START_CLAIM_SQL",
            "tasks.lifecycle.claim.FAIR_CLAIM_SQL",
            "tasks.lifecycle.rounds.FAIR_FINISH_AND_CLAIM_SQL",
            "tasks.lifecycle.rounds.FAIR_FINISH_START_CLAIM_SQL",
            "tasks.lifecycle.claim.CLAIM_CHOSEN_SQL",
        ),
        "a worker takes a due task of an unpaused queue under a lease (FOR UPDATE SKIP LOCKED); the "
        "finish-and-claim statements also finish the worker's previous attempts; from a fair queue the "
        "FAIR_ forms take turns between its keys; tasks.testing's eager mode takes the tasks an enqueue just "
        "inserted, due or not",
    ),
    Transition(
        "complete",
        (RUNNING,),
        (SUCCESSFUL,),
        (
            "tasks.lifecycle.finish.COMPLETE_SQL",
            "tasks.lifecycle.rounds.FINISH_AND_CLAIM_SQL",
            "tasks.lifecycle.rounds.FINISH_START_CLAIM_SQL",
            "tasks.lifecycle.rounds.FAIR_FINISH_AND_CLAIM_SQL",
            "tasks.lifecycle.rounds.FAIR_FINISH_START_CLAIM_SQL",
        ),
        "the handler returned; compare-and-set on holder and token, so a stale worker cannot win",
    ),
    Transition(
        "fail",
        (RUNNING,),
        (READY, BLOCKED, FAILED),
        ("tasks.lifecycle.finish.FAIL_SQL",),
        "the handler raised: back to waiting (after the default backoff, or its retry policy's) while "
        "attempts remain and its retry policy retries the exception, else FAILED for good; compare-and-set "
        "like complete",
    ),
    Transition(
        "discard",
        (RUNNING,),
        (FAILED,),
        ("tasks.lifecycle.finish.FAIL_SQL",),
        "the handler raised Discard: FAILED for good now, attempts left or not (a failure with retry off)",
    ),
    Transition(
        "snooze",
        (RUNNING,),
        (READY, BLOCKED),
        ("tasks.lifecycle.finish.FAIL_SQL",),
        "the handler raised Snooze(seconds): waiting again until the database clock plus that long, the "
        "attempt uncharged (a keyed task gives its slot up); compare-and-set like complete",
    ),
    Transition(
        "cancel by handler",
        (RUNNING,),
        (CANCELLED,),
        ("tasks.lifecycle.finish.FAIL_SQL",),
        "the handler raised Cancel(reason): CANCELLED, the reason its last error entry; its workflow "
        "dependants settle as for any cancel; compare-and-set like complete",
    ),
    Transition(
        "hand back",
        (RUNNING,),
        (READY, BLOCKED),
        ("tasks.lifecycle.finish.HAND_BACK_SQL",),
        "the worker gives a claim back uncharged (shutdown, a claim it could not start, a lost lease)",
    ),
    Transition(
        "refuse a rate-limited start",
        (RUNNING,),
        (READY, BLOCKED),
        ("tasks.lifecycle.ratelimits.RATE_START_SQL",),
        "its rate key's window is full, or earlier tasks of the key wait in its line, when the executor is about "
        "to start it: handed back uncharged in the statement that would have granted the start, run_after pushed "
        "to its place in the key's line (a keyed task waits BLOCKED); a granted start marks the attempt started "
        "instead (tasks/lifecycle/ratelimits.py)",
    ),
    Transition(
        "recover",
        (RUNNING,),
        (READY, BLOCKED, FAILED),
        (
            "tasks.lifecycle.recover.RECOVER_EXPIRED_SQL",
            "tasks.lifecycle.recover.RECOVER_EXPIRED_SINCE_SQL",
        ),
        "the lease expired (the worker died or hung): requeued, charged to the attempt when attributable; "
        "FAILED once it crashed MAX_CRASHES times; a keyed attempt still running in a live worker keeps "
        "its slot and waits BLOCKED",
    ),
    Transition(
        "cancel",
        (AWAITING, BLOCKED, READY, RUNNING),
        (CANCELLED,),
        ("tasks.models.task_actions.ActionOperations.cancel",),
        "an operator (dashboard, admin, API, Task.cancel); a running attempt's worker loses its lease",
    ),
    Transition(
        "requeue",
        FINISHED,
        (READY, BLOCKED),
        ("tasks.models.task_actions.ActionOperations.requeue",),
        "an operator runs a finished task again with fresh attempts (BLOCKED when its key is full)",
    ),
    Transition(
        "bulk retry",
        FINISHED,
        (READY, BLOCKED),
        (_B + "BULK_RETRY_SQL", _B + "BULK_RETRY_ONE_SQL", _B + "RETRY_RESTORED_SQL"),
        "a bulk operation requeues the finished tasks matching its filter, a batch per statement, as requeue "
        "does (SUCCESSFUL only when the filter names it); a row that moved meanwhile is skipped; those the "
        "mover took to tasks_finished are brought back by the batch's statement (restore) and requeued in "
        "its transaction, and so are those the mover took while the batch waited for them (RETRY_MISSED_SQL)",
    ),
    Transition(
        "bulk cancel",
        (AWAITING, BLOCKED, READY),
        (CANCELLED,),
        (_B + "BULK_CANCEL_SQL",),
        "a bulk operation cancels the waiting tasks matching its filter; never a RUNNING one",
    ),
    Transition(
        "bulk discard",
        (AWAITING, BLOCKED, READY),
        (FAILED,),
        (_B + "BULK_DISCARD_SQL",),
        "a bulk operation fails the waiting tasks matching its filter for good, with an error entry naming it; "
        "never a RUNNING one",
    ),
    Transition(
        "prune",
        FINISHED,
        (NO_ROW,),
        ("tasks.maintenance.retention.PRUNE_TASKS_SQL", _W + "PRUNE_WORKFLOWS_SQL"),
        "retention deletes finished rows older than their status's age; a workflow's members go with "
        "their workflow, once it is finished and older than its status's age",
    ),
    Transition(
        "archive",
        FINISHED,
        (NO_ROW,),
        ("tasks.maintenance.archive.ARCHIVE_SQL",),
        "with ARCHIVE_AFTER set, the recovery leader moves finished plain tasks whose hour the history has "
        "counted out of tasks_task into tasks_finished, unchanged, in the same statement (read there by id)",
    ),
    Transition(
        "restore",
        (NO_ROW,),
        FINISHED,
        ("tasks.models.finished.RESTORE_SQL", _B + "BULK_RETRY_SQL", _B + "RETRY_MISSED_SQL"),
        "an operator reruns a task the mover took to tasks_finished (alone or by a bulk retry): it comes back to "
        "tasks_task as it was, in the transaction of the requeue that follows (rolled back with it when the "
        "requeue is refused)",
    ),
    Transition(
        "delete",
        FINISHED,
        (NO_ROW,),
        (
            "tasks.models.task_actions.ActionOperations.delete_finished",
            "tasks.lifecycle.operations.DELETE_FINISHED_SQL",
            "tasks.models.finished.DELETE_ARCHIVED_SQL",
        ),
        "an operator deletes finished tasks (the admin's delete and its bulk action; a task the mover took to "
        "tasks_finished from its page there); one that is not finished refuses the whole delete, which changes "
        "nothing: cancel it first",
    ),
)

#: Statements that change a task row without changing its status (named so that the tests can tell
#: them from a forgotten transition): the lease and progress of a RUNNING task, run_after of a
#: waiting one, the shared fair key of a keyless READY one, the mark of a task a caller waits for.
STATUS_PRESERVING: tuple[str, ...] = (
    "tasks.lifecycle.finish.START_SQL",
    "tasks.lifecycle.finish.HEARTBEAT_SQL",
    "tasks.lifecycle.finish.CHECKPOINT_SQL",
    "tasks.lifecycle.recover.RELEASE_STRAY_LEASES_SQL",
    "tasks.lifecycle.recover.EXPIRE_ORPHANS_SQL",
    "tasks.models.task_actions.ActionOperations.retry_now",
    _W + "ADOPT_SQL",
    "tasks.maintenance.keyless.ADOPT_KEYLESS_SQL",
    "tasks.maintenance.keyless.ADOPT_NEW_KEYLESS_SQL",
    "tasks.models.task_wait.MARK_WAITED_SQL",
    # An event sent to a waiting task makes it due (run_after), at the send or at a recovery round.
    "tasks.lifecycle.steps.EVENT_SEND_SQL",
    "tasks.lifecycle.steps.EVENTS_WAKE_SQL",
    # A child bound to the task that spawned it; the child's end makes that task due, in the
    # statement that ends the child (its trigger), when it waits for it.
    "tasks.lifecycle.steps.SPAWN_BIND_SQL",
    "db:tasks_report_to_parent",
)


#: "Run again", the one definition: what a finished task's requeue writes, whoever sends it
#: (``tasks.models.task_actions.ActionOperations.requeue``'s UPDATE and the bulk retry's BULK_RETRY_SQL and
#: BULK_RETRY_ONE_SQL, tasks/lifecycle/bulk.py), so that a column added later is reset by both or by
#: neither. Column -> SQL expression: waiting again now on the database clock (``clock_timestamp()``,
#: as every write: docs/explanation/design.md), a fresh set of attempts and the counts that judge them
#: (failures, crashes, suspect returns), no finish and no snooze; the trace context marked as a run
#: again ("leasing-rerun", ``tasks.tracing.RERUN_KEY``: linked to its enqueue's span, not a child of
#: it; a NULL context stays NULL). Columns are unqualified: each statement names the table its own way
#: and none of its other FROM items has these columns. A keyed task's READY is the insert of its
#: concurrency trigger's: BLOCKED until its key admits it (tasks/lifecycle/concurrency.py).
#: A task without a fair key in a fair queue (enqueued before the queue was named in FAIR_QUEUES)
#: takes the shared key "" as an enqueue into that queue would give it (``fair_key_for``): its old id
#: is never read by the recovery leader's tail over new rows, and its start, the newest of its level,
#: is the last the pass over the backlog reaches, so left keyless it waited a whole pass, served only
#: by a fill. A key it has is kept; a plain queue's NULL stays NULL. The fragment's one
#: parameter, ``fair_queues`` (RERUN_FAIR_QUEUES), is LEASING_TASKS["FAIR_QUEUES"] as a list.
RERUN_FAIR_QUEUES = "%(fair_queues)s"
RERUN_SET: dict[str, str] = {
    "status": "'READY'",
    "run_after": "clock_timestamp()",
    "attempts": "0",
    "failures": "0",
    "crashes": "0",
    "shared_crashes": "0",
    "unstarted_returns": "0",
    "attempt_started": "false",
    "finished_at": "NULL",
    "snoozed_at": "NULL",
    "trace_context": """trace_context || '{"leasing-rerun": "1"}'::jsonb""",
    "fair_key": f"CASE WHEN fair_key IS NULL AND queue = ANY({RERUN_FAIR_QUEUES}::text[]) THEN '' ELSE fair_key END",
}


#: What an operator's cancel writes (TaskQuerySet.cancel, an ORM update of the unfinished rows named:
#: columns unqualified, read as they were before the update). A running attempt ends there, its
#: worker's late result refused: it gets an error entry of kind ``cancel`` with the attempt's
#: ``position`` in ``worker_ids``, as the worker's own cancel writes (FAIL_SQL), so that its attempts
#: table says "Cancelled", not "Successful" (issue 41); capped as every error list is.
CANCEL_ENDS_ATTEMPT = "(status = 'RUNNING' AND attempt_started)"
CANCEL_SET: dict[str, str] = {
    "status": "'CANCELLED'",
    "finished_at": "statement_timestamp()",
    "released_at": "CASE WHEN status = 'RUNNING' THEN statement_timestamp() ELSE released_at END",
    **capped_errors(
        """jsonb_build_object(
        'attempt', attempts, 'worker', holder, 'token', token, 'kind', 'cancel', 'at', statement_timestamp(),
        'started_at', last_attempted_at, 'position', jsonb_array_length(worker_ids),
        'exception_class_path', 'tasks.exceptions.Cancel',
        'message', 'Cancelled by an operator while this attempt ran; its worker lost the task.', 'traceback', '')""",
        when=CANCEL_ENDS_ATTEMPT,
        table="",
    ),
}


def rerun_set_sql() -> str:
    """:data:`RERUN_SET` as the body of a SET clause, one assignment a line."""
    return ",\n    ".join(f"{column} = {expression}" for column, expression in RERUN_SET.items())


def statements() -> set[str]:
    """Every statement the table names."""
    return {name for t in TRANSITIONS for name in t.statements}


def mermaid() -> str:
    """The state diagram of :data:`TRANSITIONS`, as a Mermaid ``stateDiagram-v2``: one arrow per pair of
    statuses, labelled with every event that takes it."""
    edges: dict[tuple[str, str], list[str]] = {}
    for t in TRANSITIONS:
        for source in t.sources:
            for target in t.targets:
                edge = ("[*]" if source == NO_ROW else source, "[*]" if target == NO_ROW else target)
                edges.setdefault(edge, []).append(t.event)
    lines = ["stateDiagram-v2"]
    lines.extend(f"    {a} --> {b}: {' / '.join(events)}" for (a, b), events in edges.items())
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The table itself, for the docs."""
    rows = ["| event | from | to | statements | why |", "| --- | --- | --- | --- | --- |"]
    for t in TRANSITIONS:
        names = "<br>".join(f"`{name}`" for name in t.statements)
        rows.append(f"| {t.event} | {', '.join(t.sources)} | {', '.join(t.targets)} | {names} | {t.why} |")
    return "\n".join(rows) + "\n"


def page() -> str:
    """docs/explanation/state-machine.md, whole."""
    return (
        "# The task state machine\n\n"
        "<!-- Generated from tasks/lifecycle/transitions.py by\n"
        "     python -m tasks.lifecycle.transitions > docs/explanation/state-machine.md\n"
        "     tests/unit/test_transitions.py fails while this page and the table differ. -->\n\n"
        "Every status a task row can have, and every statement that moves it. Each move is one\n"
        "statement: a SQL constant of the package, an ORM update, or a function the migrations\n"
        "create in the database (the concurrency-key triggers). A worker's finish is a\n"
        "compare-and-set on the attempt (task id, holder, fencing token): a worker whose lease\n"
        "lapsed cannot complete, fail or hand back a task that was recovered or claimed again.\n\n"
        "```mermaid\n" + mermaid() + "```\n\n"
        "BLOCKED is READY held back by a concurrency key without a free slot; AWAITING is a workflow\n"
        "member waiting for the tasks it depends on (tasks/lifecycle/workflows.py). django.tasks sees both\n"
        "as READY. `[*]` is no row: before an enqueue, after a prune.\n\n"
        "## The table\n\n" + markdown_table() + "\n"
        "Statements that change a task row but never its status: "
        + ", ".join(f"`{name}`" for name in STATUS_PRESERVING)
        + ".\n"
    )


if __name__ == "__main__":
    print(page(), end="")
