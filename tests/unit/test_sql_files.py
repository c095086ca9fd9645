"""The statement files (tasks/sql/<package>/<module>.sql, leasing/sql/) hold exactly the text each
module's statement constants send: a reviewer reads what runs (tasks/management/sql_files.py)."""

from __future__ import annotations

import pytest

from tasks.management import sql_files

REGENERATE = "python manage.py tasks_schema --write"


def test_every_statement_file_holds_the_text_its_module_sends() -> None:
    rendered = sql_files.render()
    assert rendered, "no statement constant found"
    differ = [str(path) for path, text in rendered.items() if not path.exists() or path.read_text() != text]
    assert not differ, f"statement files out of date with their modules: {differ}; regenerate: {REGENERATE}"
    assert not sql_files.stale(rendered), f"statement files no module renders: regenerate: {REGENERATE}"


def test_the_state_machine_s_statements_are_all_in_the_files() -> None:
    from tasks.lifecycle import transitions

    text = "\n".join(sql_files.render().values())
    constants = {
        name.rsplit(".", 1)[1]
        for name in (*transitions.statements(), *transitions.STATUS_PRESERVING)
        if not name.startswith("db:") and name.rsplit(".", 1)[1].isupper()
    }
    missing = sorted(c for c in constants if f"-- name: {c}\n" not in text and f"-- name: {c}[" not in text)
    assert not missing, f"statements of the state machine with no file: {missing}"


def test_a_changed_constant_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.lifecycle import finish

    monkeypatch.setattr(finish, "HEARTBEAT_SQL", finish.HEARTBEAT_SQL + " -- changed")
    rendered = sql_files.render()
    changed = [path for path, text in rendered.items() if path.read_text() != text]
    assert [p.name for p in changed] == ["finish.sql"]


def test_every_statement_carries_its_why() -> None:
    """Each statement's block opens with the comment above its constant: what it does and why it is
    written so, read where the SQL is (a ``-- (the same text as ...)`` line alone does not count)."""
    bare = []
    for path, text in sql_files.render().items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("-- name: "):
                after = lines[i + 1] if i + 1 < len(lines) else ""
                if not after.startswith("-- ") or after.startswith(("-- name: ", "-- (the same text as ")):
                    bare.append(f"{path.parent.name}/{path.name}: {line.removeprefix('-- name: ')}")
    assert not bare, f"statements with no comment above their constant: {bare}"


def test_every_statement_in_the_files_is_sent_or_built_on_by_code() -> None:
    """No dead statement: each constant of the files is read (a name or an attribute loaded, not only
    imported or re-exported) somewhere in the packages' code, migrations aside."""
    import ast
    import re

    loaded: set[str] = set()
    for root in sql_files.ROOTS.values():
        for path in root.rglob("*.py"):
            if "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                    loaded.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    loaded.add(node.attr)
    text = "\n".join(sql_files.render().values())
    names = set(re.findall(r"^-- name: ([A-Z][A-Z0-9_]*)", text, re.MULTILINE))
    assert len(names) > 100
    assert not sorted(names - loaded), f"statements no code sends or builds on: {sorted(names - loaded)}"
