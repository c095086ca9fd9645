"""The task state machine's table holds the code: every statement it names exists, and every
statement that inserts, deletes or changes the status of task rows is named in it.

A new statement that moves a task (or an ORM ``update(status=...)``) fails here until it is added to
``tasks.lifecycle.transitions.TRANSITIONS``; the database's own functions are held in
tests/db/test_transitions.py."""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
import re

import pytest

import tasks
from tasks.lifecycle import transitions
from tasks.lifecycle.states import TaskStatus
from tasks.lifecycle.transitions import NO_ROW, STATUS_PRESERVING, TRANSITIONS

ROOT = pathlib.Path(tasks.__file__).parent
DOCS = ROOT.parent / "docs" / "explanation" / "state-machine.md"

_WRITES = re.compile(r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+tasks_task\b(?!_)", re.I)
# A SET clause ends where the next clause begins at the start of a line (the statements' layout).
_SET = re.compile(
    r"\bUPDATE\s+tasks_task\b(?!_)[^\n]*?\bSET\b(.*?)(?=^\s*(WHERE|FROM|RETURNING)\b|\Z)", re.I | re.S | re.M
)
_SETS_STATUS = re.compile(r"(^|[\s,(])(t\.)?status\s*=", re.M)


def _resolve(name: str) -> object:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise LookupError(name)


def _texts(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return []


def _modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(ROOT)], prefix="tasks."):
        if ".migrations" in info.name or ".management" in info.name:
            continue
        names.append(info.name)
    return names


def _sql_constants() -> dict[str, list[str]]:
    """Public module-level SQL constants that write tasks_task: qualified name -> texts."""
    found: dict[str, list[str]] = {}
    for module_name in _modules():
        module = importlib.import_module(module_name)
        for attr, value in vars(module).items():
            if attr.startswith("_") or not attr.isupper():
                continue
            if getattr(value, "__module__", None) not in (None, module_name) and not isinstance(value, (str, tuple)):
                continue
            texts = [t for t in _texts(value) if _WRITES.search(t)]
            if texts:
                found[f"{module_name}.{attr}"] = texts
    # a constant re-exported by another module is the same statement: keep the defining module's name
    by_text: dict[tuple[str, ...], str] = {}
    for name, texts in sorted(found.items(), key=lambda item: len(item[0])):
        by_text.setdefault(tuple(texts), name)
    named = set(transitions.statements()) | set(STATUS_PRESERVING)
    return {name: texts for name, texts in found.items() if name in named or by_text[tuple(texts)] == name}


def _sets_status(text: str) -> bool:
    if re.search(r"\b(INSERT\s+INTO|DELETE\s+FROM)\s+tasks_task\b(?!_)", text, re.I):
        return True
    return any(_SETS_STATUS.search(m.group(1)) for m in _SET.finditer(text))


def test_every_named_statement_exists():
    for name in sorted(transitions.statements() | set(STATUS_PRESERVING)):
        if name.startswith("db:"):
            continue  # tests/db/test_transitions.py
        _resolve(name)


def test_every_status_is_reached_and_left_as_the_table_says():
    statuses = {s.value for s in TaskStatus}
    mentioned = {s for t in TRANSITIONS for s in (*t.sources, *t.targets)} - {NO_ROW}
    assert mentioned == statuses
    for t in TRANSITIONS:
        assert t.sources and t.targets and t.statements, t.event
        assert set(t.sources) <= statuses | {NO_ROW} and set(t.targets) <= statuses | {NO_ROW}, t.event
    reachable = {NO_ROW}
    while True:
        more = {target for t in TRANSITIONS if set(t.sources) & reachable for target in t.targets} - reachable
        if not more:
            break
        reachable |= more
    assert statuses <= reachable


def test_every_sql_statement_that_moves_a_task_is_in_the_table():
    named = transitions.statements()
    constants = _sql_constants()
    assert len(constants) >= 12, sorted(constants)  # the scan sees the statements at all
    unnamed = {name for name, texts in constants.items() if any(_sets_status(t) for t in texts) and name not in named}
    assert not unnamed, f"statements that move a task, missing from TRANSITIONS: {sorted(unnamed)}"
    other = {name for name, texts in constants.items() if name not in named and name not in STATUS_PRESERVING}
    assert not other, f"statements that write tasks_task, in neither table: {sorted(other)}"
    for name in STATUS_PRESERVING:
        if name in constants:
            assert not any(_sets_status(t) for t in constants[name]), f"{name} changes a status: a transition"


@pytest.mark.parametrize(
    ("text", "moves"),
    [
        ("UPDATE tasks_task SET\n    status = 'READY'\nWHERE id = 1", True),
        ("UPDATE tasks_task AS t SET expires_at = now()\nFROM tasks_worker AS w\nWHERE t.status = 'RUNNING'", False),
        ("UPDATE tasks_task AS t SET progress = 1, t.status = 'X'\nWHERE true", True),
        ("INSERT INTO tasks_task (queue) VALUES ('q')", True),
        ("DELETE FROM tasks_task WHERE id = 1", True),
        ("UPDATE tasks_taskother SET status = 'READY'", False),
    ],
)
def test_the_scan_tells_a_status_write(text, moves):
    assert _sets_status(text) is moves


def _status_sets(function: ast.AST) -> bool:
    """Whether ``function`` reads a SET list of tasks/lifecycle/transitions.py that writes ``status``
    (RERUN_SET, CANCEL_SET: expanded into an ``update(**...)``, no ``status=`` keyword to see)."""
    names = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and n.id.endswith("_SET")}
    return any("status" in getattr(transitions, name, {}) for name in names)


def _orm_status_updates() -> set[str]:
    """``Class.method`` (qualified by module) of every ``.update(status=...)`` / ``.create(status=...)``,
    and of every ``.update(**...)`` in a function that reads a transition's SET list."""
    found = set()
    for path in ROOT.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())

        def visit(node: ast.AST, scope: list[str], sets: bool = False, module: str = module) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, [*scope, child.name], _status_sets(child))
                    continue
                if (
                    isinstance(child, ast.Call)
                    and isinstance(child.func, ast.Attribute)
                    and child.func.attr in {"update", "create", "bulk_create", "update_or_create"}
                    and any(k.arg == "status" or (k.arg is None and sets) for k in child.keywords)
                ):
                    found.add(".".join([module, *scope]))
                visit(child, scope, sets)

        visit(tree, [])
    return found


def test_no_orm_delete_of_rows_outside_the_table():
    """``QuerySet.delete()`` / ``Model.delete()`` anywhere in the package: a task row deleted so (the
    admin's delete did, whatever its status, RUNNING included) would skip the table's "delete"
    transition (TaskQuerySet.delete_finished). A module that deletes another model's rows, added
    later, is named here."""
    # tasks.steps: an operator's re-run from a step deletes TaskStep rows (a task's stored steps).
    other_models: set[str] = {"tasks.steps"}
    found = set()
    for path in ROOT.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "delete":
                found.add(module)
    assert found <= other_models, sorted(found - other_models)


def test_every_orm_status_write_is_in_the_table():
    updates = _orm_status_updates()
    # The scan sees them at all, a SET list expanded too.
    assert {
        "tasks.models.task_actions.ActionOperations.cancel",
        "tasks.models.task_actions.ActionOperations.requeue",
    } <= updates
    assert updates <= transitions.statements(), sorted(updates - transitions.statements())


def test_the_docs_diagram_is_generated_from_the_table():
    assert DOCS.read_text() == transitions.page(), (
        "regenerate: python -m tasks.lifecycle.transitions > docs/explanation/state-machine.md"
    )
    assert "stateDiagram-v2" in transitions.page() and "| claim | READY | RUNNING |" in transitions.page()
