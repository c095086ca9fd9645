"""Every statement the package sends from a named constant, as the exact text that runs: one ``.sql`` file
per Python module, beside the package (``tasks/sql/<package>/<module>.sql``, ``leasing/sql/<module>.sql``).

The constants stay the source (their fragments are shared: the claim's SET, the compare-and-set guards,
the recovery CTEs, so that a variant cannot drift from its twin); the files are what a reviewer reads:
each statement whole, its fragments spliced in, every variant (a tuple's or a dict's items) spelled
out, under the comment that precedes its constant in the module. ``manage.py tasks_schema --write``
writes them with ``tasks/sql/schema.sql``; ``tests/unit/test_sql_files.py`` fails while a file and
its module differ.

A constant is a module-level name ending in ``_SQL`` or ``_CTES`` (a ``_CTES`` constant is the WITH
list the recovery statements share) assigned in that module, holding a string, or a tuple or dict of
strings. Statements the ORM builds (``TaskQuerySet.cancel``, ``requeue``) are Django's: not here.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

ROOTS = {"tasks": Path(__file__).resolve().parents[1], "leasing": Path(__file__).resolve().parents[2] / "leasing"}
#: Modules never scanned: the migrations carry their own SQL (tasks/sql/schema.sql shows the result),
#: and the commands print or check these files.
SKIP = re.compile(r"(^|\.)(migrations|management|testing)(\.|$)")
NAME = re.compile(r"^([A-Z][A-Z0-9_]*_(?:SQL|CTES))\b\s*(?::[^=]*)?=", re.MULTILINE)

HEADER = """\
-- {module}: every statement of this module, as the text psycopg sends (its %(name)s parameters
-- included). Generated from the module's constants by `python manage.py tasks_schema --write`; do
-- not edit: change the module, then regenerate (tests/unit/test_sql_files.py compares them).
"""


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root).with_suffix("")
            parts = [package, *relative.parts]
            if parts[-1] == "__init__":
                parts.pop()
            module = ".".join(parts)
            if not SKIP.search(module):
                found.append((module, path))
    return found


def _comment_above(lines: list[str], index: int) -> list[str]:
    """The ``#`` lines right above line ``index``, as SQL comments."""
    comment: list[str] = []
    i = index - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        text = lines[i].strip()[1:].strip()
        if not text.startswith(("noqa", "type:")):
            comment.insert(0, f"-- {text}".rstrip())
        i -= 1
    return comment


def _variants(name: str, value: Any) -> list[tuple[str, str]] | None:
    if isinstance(value, str):
        return [(name, value)]
    if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
        return [(f"{name}[{key!r}]", v) for key, v in value.items()]
    return None


def _block(label: str, comment: list[str], text: str, same_as: str | None) -> str:
    lines = [f"-- name: {label}", *comment]
    if same_as is not None:
        return "\n".join([*lines, f"-- (the same text as {same_as})"]) + "\n"
    body = text.strip("\n")
    return "\n".join([*lines, body.rstrip() + ";"]) + "\n"


def render() -> dict[Path, str]:
    """File -> text, for every module that defines a statement constant."""
    files: dict[Path, str] = {}
    for module, path in _modules():
        source = path.read_text()
        names = [(m.group(1), source.count("\n", 0, m.start())) for m in NAME.finditer(source)]
        if not names:
            continue
        loaded = importlib.import_module(module)
        lines = source.splitlines()
        seen: dict[str, str] = {}
        blocks = []
        for name, line in names:
            if name in {n for n, _ in names[: names.index((name, line))]}:
                continue  # assigned twice: the module's final value, once
            variants = _variants(name, getattr(loaded, name))
            if variants is None:
                continue
            comment = _comment_above(lines, line)
            for label, text in variants:
                blocks.append(_block(label, comment, text, seen.get(text)))
                seen.setdefault(text, label)
        if not blocks:
            continue
        package, *rest = module.split(".")
        target = ROOTS[package] / "sql" / Path(*rest[:-1]) / f"{rest[-1] if rest else package}.sql"
        files[target] = HEADER.format(module=module) + "\n" + "\n".join(blocks)
    return files


def stale(files: dict[Path, str]) -> list[Path]:
    """Generated files on disk that no module renders any more."""
    on_disk = [
        p
        for root in ROOTS.values()
        for p in (root / "sql").rglob("*.sql")
        if p.name != "schema.sql" and p.read_text().startswith("-- ") and "tasks_schema --write" in p.read_text()
    ]
    return sorted(set(on_disk) - set(files))
