"""The fenced blocks of the README and docs/howto, each with the marker that says how it is held to
the code.

A block a user is told to copy either runs in a test or says it is not meant to run as it stands.
The marker is an HTML comment on the lines just above the fence (blank lines and other comments may
sit between them):

- ``<!-- tested: tests/path/test_file.py ... -->``: that file runs the block as written (it reads the
  page and finds the block by its text), with only the names the block leaves to the reader defined;
- ``<!-- excerpt: why -->``: a fragment, or a command that only makes sense on the reader's machine;
- ``<!-- output: what -->``: what a program prints, shown to be recognised.

``tests/unit/test_doc_blocks.py`` holds every block to this; ``tests/db/test_howto_blocks.py`` runs the
blocks no other test runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "howto").glob("*.md"))]
KINDS = ("tested", "excerpt", "output")
_MARKER = re.compile(r"<!--\s*(\w+)\s*:\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    markers: tuple[tuple[str, str], ...]  # (kind, rest) of each ``<!-- kind: rest -->`` above it

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def marked(self, kind: str) -> str | None:
        return next((rest for found, rest in self.markers if found == kind), None)


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.startswith("```"):
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
        markers: list[tuple[str, str]] = []
        above = index - 1
        while above >= 0 and (not lines[above].strip() or lines[above].lstrip().startswith("<!--")):
            markers.extend((m.group(1), m.group(2)) for m in _MARKER.finditer(lines[above]))
            above -= 1
        found.append(Block(page, index + 1, line[3:].strip(), "\n".join(lines[index + 1 : end]) + "\n", tuple(markers)))
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def block_of(page: str, starting: str) -> Block:
    """The one block of ``page`` (a path under the repository root) whose text starts with ``starting``."""
    matches = [b for b in blocks(ROOT / page) if b.text.startswith(starting)]
    assert len(matches) == 1, f"{page}: {len(matches)} blocks start with {starting!r}"
    return matches[0]
