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

A plain ``save()`` of an existing row (the admin's, a form's) never lowers the token either: it
writes ``fence_token = GREATEST(fence_token, <the instance's value>)``. Without that, saving an
instance loaded before a newer holder wrote would put the old token back, and the deposed
holder's next fenced write would be accepted again. (``QuerySet.update()`` and ``bulk_update()``
write what they are given: use :func:`fenced_update`.)
"""

from __future__ import annotations

from typing import Any

import django
from django.db import models
from django.db.models.functions import Greatest

from leasing.exceptions import StaleTokenError

DEFAULT_TOKEN_FIELD = "fence_token"


class FenceTokenField(models.BigIntegerField):
    """The largest fencing token that has written to this row (0: none yet)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        kwargs.setdefault("help_text", "Largest fencing token that has written to this row.")
        super().__init__(*args, **kwargs)

    def pre_save(self, model_instance: models.Model, add: bool) -> Any:
        value = super().pre_save(model_instance, add)
        if add:
            return value
        # The UPDATE of save() keeps the larger of the stored and the instance's token, in one
        # statement: the row lock the UPDATE takes orders it after any concurrent fenced write, so
        # no read-then-write window is left. Because the value is an expression, Model.save()
        # reads the resulting token back with RETURNING and sets it on the instance.
        if not hasattr(value, "resolve_expression"):
            value = models.Value(value, output_field=models.BigIntegerField())
        return Greatest(models.F(self.attname), value)


#: Django 6.0 reads a field saved as an expression back with RETURNING; 5.2 leaves the instance's value.
SAVE_RETURNS_EXPRESSIONS = django.VERSION >= (6, 0)


class FencedModel(models.Model):
    fence_token = FenceTokenField()

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        updating = not self._state.adding and not kwargs.get("force_insert")
        super().save(*args, **kwargs)
        if updating and not SAVE_RETURNS_EXPRESSIONS:
            # Django 5.2: read the kept token back (one more statement), so the instance never
            # carries a lower token than its row. The row itself was never lowered either way.
            names = [f.attname for f in self._meta.concrete_fields if isinstance(f, FenceTokenField)]
            update_fields = kwargs.get("update_fields")
            if update_fields is not None:
                names = [name for name in names if name in set(update_fields)]
            if names:
                self.refresh_from_db(using=kwargs.get("using") or self._state.db, fields=names)


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
