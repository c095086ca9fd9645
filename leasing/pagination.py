"""Admin pagination that never counts a whole table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.utils.functional import cached_property

#: Rows an admin list counts at most; more are shown as "10,000+" and paged up to this many.
COUNT_CAP = 10_000


class CappedPaginator(Paginator):
    """Counts at most ``COUNT_CAP + 1`` rows (``SELECT count(*) FROM (… LIMIT 10001)``): exact for
    small results; beyond, ``count`` is the cap and ``capped`` is true (the templates show
    "10,000+"), so pages stop after the cap and no page reads past it with OFFSET."""

    cap = COUNT_CAP

    @cached_property
    def _counted(self) -> int:
        queryset = cast("QuerySet[Any]", self.object_list)
        return queryset[: self.cap + 1].count()

    @cached_property
    def count(self) -> int:
        return min(self._counted, self.cap)

    @property
    def capped(self) -> bool:
        return self._counted > self.cap


@dataclass(frozen=True)
class Count:
    """A count that stopped at a cap: printed "10,000+" when it did; false when nothing was counted."""

    value: int
    capped: bool

    def __str__(self) -> str:
        return f"{self.value:,}+" if self.capped else f"{self.value:,}"

    def __bool__(self) -> bool:
        return self.value > 0


def bounded_count(queryset: QuerySet[Any], cap: int = COUNT_CAP) -> Count:
    """COUNT over at most ``cap + 1`` rows: exact when small, "10,000+" when not. A queryset with an
    ordering keeps it inside the limit, so the rows counted are the first ``cap + 1`` of that order:
    an index in that order bounds what is read."""
    value = queryset[: cap + 1].count()
    return Count(min(value, cap), value > cap)
