"""tasks/sql/schema.sql is the text of every function and trigger the migrations leave behind, and each
migration carries its own SQL (issue 39: a migration that imported another and ``.replace()``d a line
of its text hid the function that runs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from django.db import connection

from tasks.management.commands.tasks_schema import REGENERATE, SCHEMA_FILE, render_schema

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = sorted([*(ROOT / "tasks" / "migrations").glob("*.py"), *(ROOT / "leasing" / "migrations").glob("*.py")])


@pytest.mark.django_db
def test_schema_file_is_what_the_migrations_create() -> None:
    # The test database is migrated to the latest migration by the test set-up.
    assert render_schema(connection) == SCHEMA_FILE.read_text(), (
        f"{SCHEMA_FILE.relative_to(ROOT)} is not what the migrations create: regenerate it on a migrated"
        f" database with `{REGENERATE}` and review the diff"
    )


def imports_of_other_migrations(path: Path) -> list[str]:
    source = path.read_text()
    found = [word for word in ("importlib", "import_module", "__import__", "from .00") if word in source]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.level or ".migrations" in (node.module or "")):
            found.append(f"from {'.' * node.level}{node.module or ''} import ...")
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if ".migrations" in alias.name]
    return found


@pytest.mark.parametrize("path", MIGRATIONS, ids=lambda path: f"{path.parent.parent.name}/{path.name}")
def test_migration_carries_its_own_sql(path: Path) -> None:
    assert not imports_of_other_migrations(path), (
        f"{path.name} imports another migration ({imports_of_other_migrations(path)}): write its SQL out in full"
    )
