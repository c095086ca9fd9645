"""argparse ``type=`` validators, logging set-up and the long-running command base shared by the commands."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.core.management.base import BaseCommand


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be at least 1")
    return number


def non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} must not be negative")
    return number


def positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value!r} must be positive")
    return number


def non_negative_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"{value!r} must not be negative")
    return number


def database_alias(value: str) -> str:
    """A database alias from DATABASES."""
    from django.db import connections

    if value not in connections:
        raise argparse.ArgumentTypeError(f"no database {value!r} in DATABASES (known: {', '.join(connections)})")
    return value


def queue_names(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one queue name")
    return names


def configure_logging(verbosity: int) -> None:
    """The level of the ``tasks`` and ``leasing`` loggers; and, when ``LOGGING`` gave the root logger
    no handler (a ``startproject`` project has no ``LOGGING``), one on the root that prints to stderr
    what no console handler below it printed already (:func:`not_printed_below`)."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    for name in ("tasks", "leasing"):
        logging.getLogger(name).setLevel(level)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        handler.addFilter(not_printed_below)
        root.addHandler(handler)


def _prints_to_console(handler: logging.Handler) -> bool:
    stream = getattr(handler, "stream", None)
    return (
        isinstance(handler, logging.StreamHandler)
        and not isinstance(handler, logging.FileHandler)
        and stream is not None
        and stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    )


def not_printed_below(record: logging.LogRecord) -> bool:
    """False for a record that a console handler of a logger between its own and the root accepted.

    Django's DEFAULT_LOGGING prints the ``django`` loggers' INFO records to the console while DEBUG is
    on, and Django 6 logs every django.tasks Task's start and end under ``django.tasks``: the root
    handler the worker adds printed each of them (with its traceback) a second time. The worker's own
    handler leaves those to the handler that took them, whatever ``LOGGING`` says (and prints them
    itself when that handler's filters refuse them, as Django's console does with DEBUG off); it
    changes no logger's configuration, Django's or the project's."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger.parent is not None:  # the root's own handlers are not "below"
        for handler in logger.handlers:
            if _prints_to_console(handler) and record.levelno >= handler.level and handler.filter(record):
                return False
        if not logger.propagate:
            break
        logger = logger.parent
    return True


class LongRunningCommand(BaseCommand):
    """A command that runs until it is stopped (a worker, the scheduler, recovery, the generator).

    ``main_program`` is true only when the command is the process's own program (``manage.py …``,
    which goes through :meth:`run_from_argv`); ``call_command()`` from a test or a user's code leaves
    it false. What may end the whole process (a hard exit past the drain) is allowed only then:
    ``call_command("run_worker", "--max-tasks", "5")`` returns to its caller like any function.
    """

    main_program = False

    def run_from_argv(self, argv: list[str]) -> None:
        self.main_program = True
        super().run_from_argv(argv)


@contextmanager
def stop_on_signals(stop: Callable[[], Any]) -> Iterator[None]:
    """SIGTERM and SIGINT call ``stop`` while the block runs; the handlers the process had before
    are put back afterwards, so a command called in-process leaves its caller's signals as it found
    them. Off the main thread (where Python allows no handler) the block runs without them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, lambda *_: stop()) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
