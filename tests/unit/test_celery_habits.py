"""A Celery habit on a task of ``LeaseBackend`` says what to write instead (docs/howto/coming-from-celery.md),
and is still an AttributeError, so ``hasattr`` and ``getattr(..., default)`` behave as before."""

from __future__ import annotations

import pickle

import pytest

from tasks.backends.options import CELERY_HABITS
from tests.testapp.option_tasks import plain


@pytest.mark.parametrize("name", sorted(CELERY_HABITS))
def test_each_habit_names_its_counterpart(name: str) -> None:
    with pytest.raises(AttributeError) as raised:
        getattr(plain, name)
    message = str(raised.value)
    assert f".{name}: a django.tasks Task has no Celery {name}()" in message
    assert CELERY_HABITS[name] in message and "coming-from-celery.md" in message


def test_delay_points_at_enqueue() -> None:
    with pytest.raises(AttributeError, match=r"call \.enqueue\(\*args, \*\*kwargs\)"):
        plain.delay(2, 2)


def test_other_missing_names_are_plain_attribute_errors() -> None:
    assert not hasattr(plain, "no_such_thing")
    assert getattr(plain, "no_such_thing", "default") == "default"
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        plain.no_such_thing  # noqa: B018


def test_the_task_still_copies_and_pickles_as_before() -> None:
    assert plain.using(priority=5).priority == 5
    try:
        copy = pickle.loads(pickle.dumps(plain))
    except pickle.PicklingError:  # the backport's Task does not pickle (its conformance tests expect that)
        return
    assert copy == plain
