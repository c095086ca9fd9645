"""Entry point of child processes: ``python -m tests.helpers.child MODULE ARGS...``.

Sets Django up first (models cannot be imported before), then runs ``tests.helpers.MODULE.main``.
"""

from __future__ import annotations

import importlib
import sys

import django

if __name__ == "__main__":
    django.setup()
    module = importlib.import_module(f"tests.helpers.{sys.argv[1]}")
    sys.exit(module.main(sys.argv[2:]))
