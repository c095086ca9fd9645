"""What an API allow-list pattern could match in one module; only module-level public functions
(and django.tasks tasks) defined here may run."""

from __future__ import annotations

import json  # noqa: F401  (a module attribute a pattern could name)
from os import getcwd  # noqa: F401  (a function defined elsewhere)
from typing import Any

from tasks.compat import task


def public(**kwargs: Any) -> str:
    return "public"


async def coroutine(**kwargs: Any) -> str:
    return "coroutine"


@task()
def django_task() -> str:
    return "django task"


def _private(**kwargs: Any) -> str:
    return "private"


class Job:
    def __call__(self, **kwargs: Any) -> str:
        return "class"

    @staticmethod
    def method(**kwargs: Any) -> str:
        return "method"


alias = public
instance = Job()
lambda_handler = lambda **kwargs: "lambda"  # noqa: E731
CONSTANT = 3
