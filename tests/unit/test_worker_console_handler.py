"""The handler ``run_worker`` puts on the root logger (when ``LOGGING`` gave it none) prints what no
console handler below it printed: Django's DEBUG console handler takes the ``django`` records, a file
handler below prints nothing to the console, and a record a console handler's filter refuses (Django's
console with DEBUG off) is still printed, once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.management.commands._common import not_printed_below

NAME = "tests.unit.printed_below"


@pytest.fixture
def parent() -> Iterator[logging.Logger]:
    logger = logging.getLogger(NAME)
    yield logger
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()


def record(level: int) -> logging.LogRecord:
    child = logging.getLogger(f"{NAME}.child")
    return child.makeRecord(child.name, level, __file__, 1, "a state change", (), None)


def test_a_record_a_console_handler_below_took_is_left_to_it(parent: logging.Logger) -> None:
    console = logging.StreamHandler()
    console.addFilter(lambda r: r.levelno >= logging.WARNING)  # as Django's refuses all with DEBUG off
    parent.addHandler(console)
    assert not_printed_below(record(logging.WARNING)) is False
    assert not_printed_below(record(logging.INFO)) is True  # refused below: printed by the root's handler
    console.setLevel(logging.ERROR)
    assert not_printed_below(record(logging.WARNING)) is True


def test_a_file_handler_below_prints_nothing_to_the_console(parent: logging.Logger, tmp_path: Path) -> None:
    parent.addHandler(logging.FileHandler(tmp_path / "log"))
    assert not_printed_below(record(logging.INFO)) is True


def test_a_logger_that_does_not_propagate_hides_the_handlers_above_it(parent: logging.Logger) -> None:
    parent.addHandler(logging.StreamHandler())
    child = logging.getLogger(f"{NAME}.child")
    child.propagate = False
    try:
        assert not_printed_below(record(logging.INFO)) is True
    finally:
        child.propagate = True
