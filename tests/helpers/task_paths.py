"""Dotted paths of the test app's handlers (tests/testapp/handlers.py), as a task stores them."""

from __future__ import annotations

#: Does nothing: the task of every test that needs one to run and end.
NOOP = "tests.testapp.handlers.noop"
