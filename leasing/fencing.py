"""Fenced writes: storage that rejects a stale lease holder by itself.

A holder that was paused (GC, SIGSTOP, a slow disk) can wake up after its lease expired and
another holder took over. Its late writes must not land. Give the rows it writes a
``fence_token`` column and write through :func:`fenced_update`: the update applies only where the
stored token is not newer than the writer's, so once the new holder has written with its larger
token, the stale holder's write matches no row and raises :class:`StaleTokenError`.

    class Report(FencedModel):
        day = models.DateField(unique=True)
        body = models.TextField()

    with lease(f"report:{day}") as held:
        fenced_update(Report.objects.filter(day=day), held.token, body=render(day))
"""

from __future__ import annotations

from typing import Any

from django.db import models

from leasing.exceptions import StaleTokenError

DEFAULT_TOKEN_FIELD = "fence_token"


class FenceTokenField(models.BigIntegerField):
    """The largest fencing token that has written to this row (0: none yet)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        kwargs.setdefault("help_text", "Largest fencing token that has written to this row.")
        super().__init__(*args, **kwargs)


class FencedModel(models.Model):
    fence_token = FenceTokenField()

    class Meta:
        abstract = True


def fenced_update(
    queryset: models.QuerySet[Any], token: int, *, token_field: str = DEFAULT_TOKEN_FIELD, **values: Any
) -> int:
    """One ``UPDATE … SET …, fence_token = :token WHERE … AND fence_token <= :token``.

    Returns the number of rows written; raises :class:`StaleTokenError` when none accepted the write.
    """
    updated = queryset.filter(**{f"{token_field}__lte": token}).update(**{token_field: token}, **values)
    if updated == 0:
        # Only on the failure path: say whether a newer token won or the rows do not exist.
        newest = queryset.aggregate(newest=models.Max(token_field))["newest"]
        if newest is None:
            raise StaleTokenError(f"no row matched the fenced write with token {token}")
        raise StaleTokenError(f"token {token} is stale: the row was written with token {newest}")
    return updated
