"""The hot path stays followable (docs/CONTRIBUTING.md, "Size"): no module of the packages over 600
lines, and no function over 60 in the modules a task goes through from its claim to its finish (the
claim, the dispatcher's round, the finish, the heartbeat, recovery). A module that outgrows this
gives a part that holds no state of its own a module named for it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("leasing", "tasks")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60

#: The modules of the hot path: the statements, what sends them, and the worker's thread that writes.
HOT_PATH = (
    "tasks/lifecycle/claim.py",
    "tasks/lifecycle/rounds.py",
    "tasks/lifecycle/finish.py",
    "tasks/lifecycle/fragments.py",
    "tasks/lifecycle/policy.py",
    "tasks/lifecycle/ratelimits.py",
    "tasks/lifecycle/recover.py",
    "tasks/models/task_attempts.py",
    "tasks/maintenance/recovery.py",
    "tasks/worker/dispatcher.py",
    "tasks/worker/endings.py",
    "tasks/worker/handoff.py",
    "tasks/worker/heartbeat.py",
    "tasks/worker/positions.py",
    "tasks/worker/threads.py",
    "tasks/worker/aio.py",
    "tasks/worker/timeouts.py",
    "tasks/worker/writer.py",
    "leasing/models.py",
    "leasing/holder.py",
)


def _modules() -> list[Path]:
    return [
        path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts
    ]


def test_no_module_is_over_the_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_on_the_hot_path_is_over_the_limit() -> None:
    long = {}
    for name in HOT_PATH:
        tree = ast.parse((ROOT / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{name}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions on the hot path over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_hot_path_list_names_modules_that_exist() -> None:
    missing = [name for name in HOT_PATH if not (ROOT / name).is_file()]
    assert not missing, f"the hot path names modules that are gone: {missing}"
