"""The README and docs/ hold together: every relative link points at a file that exists (and at a
heading of it when it names one), every page under docs/ is linked from docs/index.md, and the
layout page answers "where is X?" with paths that exist."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    found = set()
    fence = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        m = re.match(r"^#+ (.*)$", line)
        if m and not fence:
            found.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return found


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_index_links_every_page() -> None:
    index = ROOT / "docs" / "index.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in _LINK.findall(index.read_text())}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")} - {index.resolve()}
    assert sorted(str(p.relative_to(ROOT)) for p in pages - linked) == []


def test_the_layout_page_names_only_paths_that_exist() -> None:
    text = (ROOT / "docs" / "explanation" / "layout.md").read_text()
    paths = set(re.findall(r"`((?:tasks|leasing)/[\w/]+(?:\.py)?)`", text))
    assert len(paths) > 20
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []
