"""Hostile concurrency key templates and hostile arguments for the django.tasks backend
(tasks/backends/option_checks.py): a template that can only ever fail, or whose output size the call's arguments
choose, is system check tasks.E012 at startup; a call whose arguments do not fit raises ValueError
(never another exception) and writes nothing."""

from __future__ import annotations

import resource
from typing import Any

import pytest

from tasks.models import ConcurrencyKey, Task

pytestmark = pytest.mark.django_db(transaction=True)


def backend_with(settings: Any, template: str, limit: int = 1) -> Any:
    from tasks.compat import task_backends
    from tests.conformance.tasks import noop_task

    settings.TASKS = {
        "default": {
            "BACKEND": "tasks.backends.LeaseBackend",
            "OPTIONS": {"concurrency": {noop_task.module_path: {"key": template, "limit": limit}}},
        }
    }
    return task_backends["default"]


@pytest.mark.parametrize(
    "template",
    [
        "k:{}{0}",  # automatic then manual numbering: every call fails
        "k:{0}{}",  # manual then automatic
        "k:{0[a]b}",  # text after an item
        "k:{0[a]]}",
        "k:{0:{1:{2}}}",  # nested past str.format's one level
        # The call's arguments would choose the width: one integer argument makes the key a gigabyte.
        "k:{0:>{1}}",
        "k:{0:.{1}f}",
        "k:{0:{1}}",
        # A key is at most 255 characters: a wider field or a longer precision never fits.
        "k:{0:>1000000000}",
        "k:{0:.100000f}",
        "k:{0:0256}",
        "k:{0:x>٣٠٠}",  # Unicode digits are widths too (300)
        # Text the database cannot store in any key.
        "k\x00{0}",
        "k\ud800{0}",
    ],
)
def test_a_template_that_cannot_fit_any_call_or_lets_the_call_pick_its_size_is_refused(
    settings: Any, template: str
) -> None:
    backend = backend_with(settings, template)
    assert [e.id for e in backend.check()] == ["tasks.E012"], template
    assert backend.concurrency == {}  # and it limits nothing rather than fail every call


@pytest.mark.parametrize(
    "template", ["k:{0}", "k:{customer}", "k:{0[id]}", "k:{0[a][b]}", "k:{0!r:>20}", "k:{0:08.3f}", "k:{0:9>255}"]
)
def test_ordinary_templates_pass_the_check(settings: Any, template: str) -> None:
    assert backend_with(settings, template).check() == []


@pytest.mark.parametrize(
    ("template", "args", "why"),
    [
        ("k:{0:c}", [0], "NUL"),  # a character from a number: NUL
        ("k:{0:c}", [0xD800], "surrogate"),  # ... a lone surrogate
        ("k:{0:c}", [0x110000], "does not fit"),  # ... none at all (OverflowError)
        ("k:{0:c}", [-1], "does not fit"),
        ("k:{0:e}", [10**400], "does not fit"),  # an integer no float can hold (OverflowError)
        ("k:{0:f}", [10**400], "does not fit"),
        ("k:{0}", [10**5000], "does not fit"),  # more digits than int -> str converts
        ("k:{0[__class__]}", [{"a": 1}], "does not fit"),  # an item lookup reads items only
        ("k:{0[__class__]}", [[1]], "does not fit"),
        ("k:{0}", ["x" * 10_000_000], "at most 255"),  # a huge argument: refused after one copy
    ],
)
def test_hostile_arguments_raise_value_error_and_write_nothing(
    settings: Any, template: str, args: list[Any], why: str
) -> None:
    from tests.conformance.tasks import noop_task

    backend_with(settings, template)
    with pytest.raises(ValueError, match=why):
        noop_task.enqueue(*args)
    assert not Task.objects.exists() and not ConcurrencyKey.objects.exists()


def test_an_argument_cannot_make_the_key_allocate_more_than_it_holds(settings: Any) -> None:
    """A nested width would be filled from the call: the check refuses the template, so the backend
    limits nothing with it, and a call with a width of 500,000,000 enqueues at once, unkeyed, without
    building a 500 MB string (peak memory barely moves)."""
    from tests.conformance.tasks import noop_task

    backend_with(settings, "k:{0:>{1}}")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = noop_task.enqueue("x", 500_000_000)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200_000, grown_kib
    task = Task.objects.get(pk=int(result.id))
    assert task.concurrency_key is None


@pytest.mark.parametrize("limit", [2**31, 10**30, 0, -1, True, 1.5, "2"])
def test_a_limit_no_enqueue_accepts_is_refused_at_startup(settings: Any, limit: Any) -> None:
    """The column is a PostgreSQL integer: a limit past 2**31 - 1 made every call fail."""
    assert [e.id for e in backend_with(settings, "k:{0}", limit).check()] == ["tasks.E012"]


def test_the_largest_limit_passes_the_check_and_enqueues(settings: Any) -> None:
    from tests.conformance.tasks import noop_task

    assert backend_with(settings, "k:{0}", 2**31 - 1).check() == []
    noop_task.enqueue(7)
    assert Task.objects.get().concurrency_key == "k:7"
