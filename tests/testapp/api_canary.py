"""Imported by nothing: a test shows that a worker refuses an API row naming this module without
importing it (the module records that it was imported)."""

from __future__ import annotations

import sys

IMPORTED_BY = sys.argv[:1]


def run(**kwargs: object) -> str:
    return "ran"
