"""Every block of the README and docs/howto is run by a test or says why not (tests/helpers/doc_blocks.py).

A ``tested:`` marker must name a test file (or ``.ci/run``) that exists and reads that page, so the
claim cannot outlive the test it names."""

from __future__ import annotations

import re

from tests.helpers import ROOT
from tests.helpers.doc_blocks import KINDS, all_blocks, blocks


def test_every_block_is_tested_or_says_why_not() -> None:
    unmarked = [block.where for block in all_blocks() if not any(kind in KINDS for kind, _ in block.markers)]
    assert unmarked == [], "add <!-- tested: tests/... -->, <!-- excerpt: why --> or <!-- output: what -->"


def test_every_tested_marker_names_a_test_that_reads_the_page() -> None:
    wrong = []
    for block in all_blocks():
        for kind, rest in block.markers:
            if kind != "tested":
                continue
            path = rest.split()[0].split("::")[0]
            test = ROOT / path
            if not path.startswith(("tests/", ".ci/")) or not test.is_file():
                wrong.append(f"{block.where}: {path} is not a test file")
            elif block.page.name not in test.read_text():
                wrong.append(f"{block.where}: {path} does not read {block.page.name}")
    assert wrong == []


def test_excerpts_say_why() -> None:
    assert [b.where for b in all_blocks() if b.marked("excerpt") == "" or b.marked("output") == ""] == []


def test_no_block_a_user_copies_names_this_repository_s_tests() -> None:
    # A user's project has no `tests.testapp`: a block naming one of its handlers enqueues a task that
    # fails with ModuleNotFoundError there. Blocks name the user's own modules (billing.tasks, …).
    named = re.compile(r"\btests\.(?:testapp|helpers|db|unit|concurrency)\b|\bfrom tests\b")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    every = [block for page in pages for block in blocks(page)]
    wrong = [b.where for b in every if b.marked("output") is None and named.search(b.text)]
    assert wrong == []
