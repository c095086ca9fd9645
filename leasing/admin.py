from __future__ import annotations

import datetime as dt
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import BadRequest
from django.db import DEFAULT_DB_ALIAS, transaction
from django.db.models import IntegerField, Model, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, QueryDict
from django.urls import NoReverseMatch, reverse
from django.utils import timezone
from django.utils.html import format_html

from leasing.bounds import without_jit
from leasing.models import HELD_STATES, RESOURCE_VALUE, Lease
from leasing.pagination import COUNT_CAP, CappedPaginator
from leasing.routing import database_param, known_databases, parse_database, using_database
from leasing.validation import MAX_BIGINT, MAX_PARAM_LENGTH, InvalidInput, bad_params, check_text, parse_whole


class DatabaseFilter(admin.SimpleListFilter):
    """Which database the list shows (``?db=``), offered when more than one holds our tables. The
    selection itself is applied by :class:`CheckedInputAdmin` (every query of the view, actions
    included, runs on it); the filter keeps ``db`` an accepted parameter that the admin carries into
    the change pages it links (``_changelist_filters``)."""

    title = "database"
    parameter_name = "db"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(alias, alias) for alias in known_databases()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset

    def choices(self, changelist: Any) -> Any:
        current = self.value() or DEFAULT_DB_ALIAS
        for alias, title in self.lookup_choices:
            yield {
                "selected": alias == current,
                "query_string": changelist.get_query_string({self.parameter_name: alias}),
                "display": title,
            }


def admin_database(request: HttpRequest) -> str:
    """The ``?db=`` of an admin page, or of the list it was opened from; raises InvalidInput."""
    value = database_param(request.GET)
    if value is None and "_changelist_filters" in request.GET:
        value = database_param(QueryDict(request.GET["_changelist_filters"]))
    return parse_database(value)


class CheckedInputAdmin(admin.ModelAdmin):
    """An admin whose list filters, search terms, action selections and object ids are checked
    before any query uses them (:mod:`leasing.validation`): a value PostgreSQL cannot take (NUL) or
    an absurdly long one is dropped with a message instead of failing the page with a 500.

    Several databases: ``?db=alias`` (a list filter when more than one database holds our tables)
    selects the database every query of the page reads and every action writes
    (leasing/routing.py); the change pages opened from the list keep it."""

    def get_list_filter(self, request: HttpRequest) -> Any:
        filters = super().get_list_filter(request)
        return (*filters, DatabaseFilter) if len(known_databases()) > 1 else filters

    def _on_database(self, request: HttpRequest, view: Any, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            alias = admin_database(request)
        except InvalidInput as exc:
            raise BadRequest(exc.message) from None
        # Django's change and delete views open their transaction on the model's default database:
        # one on the database shown as well, so that a save that fails halfway there is rolled back.
        with using_database(alias), without_jit(), transaction.atomic(using=alias):
            response: HttpResponse = view(request, *args, **kwargs)
            if hasattr(response, "render") and not getattr(response, "is_rendered", True):
                response.render()  # the template reads querysets: render while the database is selected
            return response

    def changeform_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return self._on_database(request, super().changeform_view, *args, **kwargs)

    def delete_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return self._on_database(request, super().delete_view, *args, **kwargs)

    def history_view(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        return self._on_database(request, super().history_view, *args, **kwargs)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        refused = bad_params(request.GET)
        if "db" not in refused:
            try:
                parse_database(database_param(request.GET))
            except InvalidInput as exc:
                refused["db"] = exc.message
        if "o" in request.GET and "o" not in refused:
            # Django's admin honours ?o= for every column, sortable_by or not: an order no index
            # gives sorts the whole table (invariant 12).
            sortable = set(self.get_sortable_by(request))
            columns = list(self.get_list_display(request))
            if self.get_actions(request):
                columns.insert(0, "action_checkbox")  # as the changelist numbers them
            for part in request.GET["o"].split("."):
                index = part.removeprefix("-")
                known = index.isascii() and index.isdigit() and int(index) < len(columns)
                if not known or columns[int(index)] not in sortable:
                    refused["o"] = f"this list sorts only by {', '.join(sorted(map(str, sortable))) or 'its own order'}"
        if request.method == "POST":
            refused |= bad_params(request.POST)
            if isinstance(self.model._meta.pk, IntegerField):
                # int() takes "²" and "٣": the selection of an action is ids in ASCII digits.
                try:
                    for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                        parse_whole(value, "selected id", low=1, high=MAX_BIGINT)
                except InvalidInput as exc:
                    refused[helpers.ACTION_CHECKBOX_NAME] = exc.message
        if refused:
            for name, reason in refused.items():
                self.message_user(request, f"Ignored {name[:40]!r}: {reason}.", messages.ERROR)
            kept = request.GET.copy()
            for name in refused:
                kept.pop(name, None)
            query = kept.urlencode()
            return HttpResponseRedirect(f"{request.path}?{query}" if query else request.path)
        return self._on_database(request, super().changelist_view, extra_context)

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        """Only the lookups this admin's own filters make. Django admits any lookup on a local field
        (``?run_after__year=99999`` then fails with a 500); refused ones get Django's 400."""
        offered: set[str] = set()
        for item in self.get_list_filter(request):
            if isinstance(item, type) and issubclass(item, admin.SimpleListFilter):
                name = item.parameter_name or ""
                offered |= {name, name.removesuffix("__exact")}  # ?queue= as well as ?queue__exact=
            else:
                field = item if isinstance(item, str) else item[0]  # (field, filter class)
                offered |= {f"{field}", f"{field}__exact", f"{field}__isnull"}
        return lookup in offered and super().lookup_allowed(lookup, value, request)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Model | None:
        try:
            check_text(object_id, "id")
        except InvalidInput:
            return None  # the admin answers "does not exist", as for any unknown id
        if len(object_id) > MAX_PARAM_LENGTH:
            return None
        return super().get_object(request, object_id, from_field)


class LeaseStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("active", "Active"), ("renewed", "Renewed"), ("expired", "Expired"), ("released", "Released")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value in HELD_STATES:  # sorted by the resource as a value (LeaseSearchList)
            return queryset.held(renewed=value == "renewed")  # type: ignore[attr-defined]
        if value in {"expired", "released"}:
            return getattr(queryset, value)()
        return queryset


class LeaseSearchList(ChangeList):
    """A search's rows (at most 2 x (COUNT_CAP + 1), found by id: LeaseAdmin.get_search_results)
    and the held leases (LeaseQuerySet.held: found from the expiry range) sorted by resource as a
    value. Sorted by the column, the planner walks the resource key from its
    start and filters the ids, reading every lease that sorts before the first match (200,220 rows
    behind 200,000 expired leases); sorted by the value, it fetches the ids and sorts them."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset = super().get_queryset(request, exclude_parameters)
        if not self.query.strip() and request.GET.get("state") not in HELD_STATES:
            return queryset
        by_value = {"resource": RESOURCE_VALUE.asc(), "-resource": RESOURCE_VALUE.desc()}
        return queryset.order_by(
            *[by_value.get(term, term) if isinstance(term, str) else term for term in queryset.query.order_by]
        )


@admin.register(Lease)
class LeaseAdmin(CheckedInputAdmin):
    list_display = (
        "resource",
        "holder_tasks",
        "holder",
        "token",
        "state_display",
        "expires_in",
        "renewals",
        "transitions",
        "acquired_at",
    )
    list_filter = (LeaseStateFilter,)
    # Search uses the indexes (get_search_results): a resource prefix or an exact holder.
    search_fields = ("^resource", "=holder")
    search_help_text = "Resource prefix (case-sensitive) or exact holder."
    ordering = ("resource",)
    # The one order an index gives under every state filter: resource. Any other sorted every lease
    # of the state (renewals, acquired_at: all 1,200,000; expiry: 200,000 expired, or every lease for
    # the released; holder, tied across thousands of leases: 45,453 rows, 30,249 buffers).
    sortable_by = ("resource",)
    paginator = CappedPaginator  # no COUNT over the whole table: "10000+"
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    actions = ("revoke",)
    readonly_fields = (
        "resource",
        "holder",
        "token",
        "created_at",
        "acquired_at",
        "renewed_at",
        "released_at",
        "expires_at",
        "renewals",
        "transitions",
        "metadata",
    )

    def has_add_permission(self, request: HttpRequest) -> bool:
        # Leases are granted by the acquire statement only; a hand-made row would bypass the sequence.
        return False

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return LeaseSearchList

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Lease], search_term: str
    ) -> tuple[QuerySet[Lease], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        if "\x00" in term:
            return queryset.none(), False
        # Each kind of match is read apart, from its own index, at most as many as the list counts
        # (COUNT_CAP + 1): a resource prefix (LIKE 'x%' on the resource's varchar_pattern_ops index,
        # in its order) and an exact holder. One statement with the OR, ordered by resource, was
        # planned as a walk of the resource key from its start, filtering: 200,220 rows read for a
        # prefix behind 200,000 expired leases. The list then shows these rows in its own order and
        # filters; beyond the cap a prefix's matches are its first COUNT_CAP + 1 in byte order.
        base = self.model.objects.using(queryset.db)
        limit = COUNT_CAP + 1
        ids = list(base.filter(resource__startswith=term).values_list("pk", flat=True)[:limit])
        ids += base.filter(holder=term).values_list("pk", flat=True)[:limit]
        return queryset.filter(pk__in=sorted(set(ids))), False

    @admin.display(description="holder's tasks")
    def holder_tasks(self, obj: Lease) -> str:
        # Task leases are held by workers; link to whatever tasks this holder runs.
        try:
            url = reverse("admin:tasks_task_changelist") + f"?q={obj.holder}"
        except NoReverseMatch:  # the tasks app is not installed
            return "-"
        return format_html('<a href="{}">tasks of {}</a>', url, obj.holder)

    @admin.display(description="state")
    def state_display(self, obj: Lease) -> str:
        return obj.state

    @admin.display(description="expires in", ordering="expires_at")
    def expires_in(self, obj: Lease) -> str:
        if obj.released_at is not None:
            return "released"
        remaining = obj.expires_at - timezone.now()
        if remaining <= dt.timedelta(0):
            return f"expired {int(-remaining.total_seconds())} s ago"
        return f"{remaining.total_seconds():.1f} s"

    @admin.action(
        permissions=["change"], description="Revoke selected leases (they end now; the next acquire gets a new token)"
    )
    def revoke(self, request: HttpRequest, queryset: QuerySet[Lease]) -> None:
        count = Lease.objects.filter(pk__in=queryset.values("pk")).revoke()
        self.message_user(request, f"Revoked {count} active lease(s).", messages.SUCCESS)
