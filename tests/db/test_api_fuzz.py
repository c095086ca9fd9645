"""Fuzzed input on every route: random JSON bodies, ids and query strings, salted with exactly what
broke the edge before (lone surrogates, numbers that overflow to infinity, NaN and Infinity literals,
NUL, non-ASCII digits, 5,000-digit numbers, dates pushed out of range by their offset). Never a 5xx,
and a rejected request changes nothing."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import pytest
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leasing.models import Lease
from tasks.models import Task
from tests.factories import StaffFactory
from tests.helpers.api import TOKEN, check_answer
from tests.helpers.db_state import database_state

pytestmark = [pytest.mark.django_db, pytest.mark.one_stack, pytest.mark.usefixtures("api_token")]

HEADERS = {"Authorization": f"Bearer {TOKEN}"}
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Raw:
    """A JSON fragment written as is: what json.dumps cannot produce (1e400) or would refuse."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r})"


def dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return json.dumps(value)  # ensure_ascii: a lone surrogate becomes a \\udXXX escape, NUL \\u0000


non_ascii_digits = st.sampled_from(["\u00b2", "\u0663", "\uff11", "\u0967", "\U0001d7d9", "\u2460"])
hostile_text = st.one_of(
    # Lone surrogates, kept apart: a high one followed by a low one is a valid pair in JSON ("\\ud800\\udc00").
    st.lists(st.characters(categories=["Cs"]), min_size=1, max_size=3).map("x".join),
    st.text(max_size=8).map(lambda s: s + "\x00"),
    st.lists(non_ascii_digits, min_size=1, max_size=4).map("".join),
    st.integers(min_value=20, max_value=6000).map(lambda n: "9" * n),
)
offsets = st.builds(
    lambda sign, hours, minutes: f"{sign}{hours:02d}:{minutes:02d}",
    st.sampled_from("+-"),
    st.integers(0, 30),
    st.integers(0, 59),
)
extreme_dates = st.builds(
    lambda year, month, day, hour, offset: f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:00:00{offset}",
    st.sampled_from([1, 2, 1969, 1970, 2999, 3000, 9998, 9999]) | st.integers(1, 9999),
    st.integers(1, 13),
    st.integers(1, 31),
    st.integers(0, 24),
    offsets | st.sampled_from(["Z", ""]),
)
raw_numbers = st.sampled_from(
    ["1e400", "-1e400", "1E999", "NaN", "Infinity", "-Infinity", "1" + "0" * 5000, "-" + "9" * 4400, "1" * 400 + ".5"]
).map(Raw)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | hostile_text
    | extreme_dates
    | raw_numbers
    | st.sampled_from(["tasks.demo.sleep", "tasks.demo.os.system", "tasks.demo.sleep\n", "r", "w1", "default"])
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10) | hostile_text, children, max_size=4)
    ),
    max_leaves=15,
)
FIELDS = [
    "resource", "holder", "ttl", "token", "metadata", "worker", "queues", "limit", "task_path", "args", "kwargs",
    "payload", "queue", "priority", "run_after", "max_attempts", "timeout", "dedup_key", "progress", "output",
    "error", "retry", "running", "rate", "max_sleep",
]  # fmt: skip
bodies = json_values | st.fixed_dictionaries({}, optional=dict.fromkeys(FIELDS, json_values))
BODY_ROUTES = [
    ("post", "/api/leases"),
    ("put", "/api/leases/renew"),
    ("delete", "/api/leases/{id}"),
    ("post", "/api/tasks"),
    ("post", "/api/tasks/next"),
    ("put", "/api/tasks/{id}/heartbeat"),
    ("put", "/api/tasks/{id}/complete"),
    ("put", "/api/tasks/{id}/fail"),
    ("post", "/api/tasks/{id}/cancel"),
    ("post", "/api/tasks/{id}/requeue"),
    ("put", "/api/generator"),
]
#: Read routes and the query parameters each reads (plus one it does not).
API_PARAMS = ["limit", "before", "other"]
GET_ROUTES = {
    "/api/leases": [*API_PARAMS, "state"],
    "/api/leases/active": API_PARAMS,
    "/api/leases/released": API_PARAMS,
    "/api/leases/{id}": ["other"],
    "/api/tasks": [*API_PARAMS, "status", "queue"],
    "/api/tasks/processed": [*API_PARAMS, "status", "queue"],
    "/api/tasks/started": [*API_PARAMS, "queue"],
    "/api/tasks/stuck": [*API_PARAMS, "queue"],
    "/api/tasks/{id}": ["other"],
    "/api/generator": ["other"],
}
TASK_LIST = ["q", "queue", "before", "other"]
ADMIN = ["q", "queue__exact", "status__exact", "lease", "state", "holder", "p", "o", "run_after__year", "other"]
PAGE_ROUTES = {
    "/dashboard/": ["other"],
    "/dashboard/tasks/pending/": TASK_LIST,
    "/dashboard/tasks/stuck/": TASK_LIST,
    "/dashboard/tasks/failed/": TASK_LIST,
    "/dashboard/tasks/{id}/": ["other"],
    "/dashboard/workers/": ["other"],
    "/dashboard/generator/": ["other"],
    "/leases/": ["page", "other"],
    "/leases/released/": ["page", "other"],
    "/metrics": ["other"],
    "/admin/tasks/task/": ADMIN,
    "/admin/leasing/lease/": ADMIN,
    "/admin/tasks/worker/": ADMIN,
}
ids = st.integers(min_value=-5, max_value=2**64).map(str) | hostile_text.map(
    lambda s: quote(s.encode("utf-8", "surrogatepass"), safe="")
)
query_values = (
    st.text(max_size=10)
    | hostile_text
    | extreme_dates
    | st.sampled_from(["1e400", "NaN", "inf", "-1", "0", "READY", "active", "default"])
)


def queries(params: list[str]) -> st.SearchStrategy[dict[str, str]]:
    return st.dictionaries(st.sampled_from(params), hostile_text | extreme_dates | query_values, min_size=1, max_size=3)


def encode_pairs(pairs: list[tuple[str, str]]) -> str:
    # errors="surrogatepass": a lone surrogate goes on the wire as its (invalid) UTF-8 bytes.
    return "&".join(f"{k}={quote(v.encode('utf-8', 'surrogatepass'), safe='')}" for k, v in pairs)


def encode(query: dict[str, str]) -> str:
    return encode_pairs(list(query.items()))


@pytest.fixture
def seeded() -> dict[str, int]:
    """Rows for ids to hit: a lease, a running task, a waiting one."""
    grant = Lease.objects.acquire("fuzz", "h", ttl=600)
    assert grant is not None
    Task.objects.enqueue("tasks.demo.sleep", priority=5)
    claim = Task.objects.claim("w1", limit=1, ttl=600, start=True)[0]
    Task.objects.enqueue("tasks.demo.sleep", dedup_key="fuzz")
    return {"lease": Lease.objects.get(resource="fuzz").pk, "lease_token": grant.token, "task": claim.id,
            "token": claim.token}  # fmt: skip


def valid_body(method: str, template: str, seeded: dict[str, int]) -> dict[str, Any]:
    """A body the route would accept, for the mutations to break one field at a time."""
    mine: dict[str, Any] = {"worker": "w1", "token": seeded["token"]}
    bodies: dict[str, dict[str, Any]] = {
        "/api/leases": {"resource": "fuzz-2", "holder": "h", "ttl": 30, "metadata": {"a": 1}},
        "/api/leases/renew": {"resource": "fuzz", "holder": "h", "token": seeded["lease_token"], "ttl": 30},
        "/api/leases/{id}": {"holder": "h", "token": seeded["lease_token"]},
        "/api/tasks": {
            "task_path": "tasks.demo.sleep", "args": [], "kwargs": {"n": 1}, "queue": "q", "priority": 1,
            "run_after": "2030-01-01T00:00:00+00:00", "max_attempts": 3, "timeout": 5, "dedup_key": "d",
        },
        "/api/tasks/next": {"worker": "w2", "queues": ["none"], "ttl": 30, "limit": 1},
        "/api/tasks/{id}/heartbeat": {**mine, "ttl": 600, "progress": {"p": 1}},
        "/api/tasks/{id}/complete": {**mine, "output": {"ok": True}},
        "/api/tasks/{id}/fail": {**mine, "error": {"type": "E", "message": "m", "traceback": "t"}, "retry": True},
        "/api/tasks/{id}/cancel": {},
        "/api/tasks/{id}/requeue": {},
        "/api/generator": {"running": False, "rate": 2, "max_sleep": 3},
    }  # fmt: skip
    return bodies[template]


#: What broke the edge before, as JSON values: each is refused wherever it appears in a body.
hostile_values = (
    raw_numbers
    | hostile_text.filter(lambda s: "\x00" in s or any(0xD800 <= ord(c) <= 0xDFFF for c in s))
    | st.builds(lambda v: {"k": [v]}, raw_numbers | hostile_text.filter(lambda s: "\x00" in s))
    | st.builds(lambda v: {v: 1}, st.characters(categories=["Cs"]))
)


def hits_the_id(template: str, seeded: dict[str, int]) -> str:
    return template.replace("{id}", str(seeded["lease"] if "leases" in template else seeded["task"]))


def assert_rejections_change_nothing(response: Any, before: Any, what: Any) -> None:
    assert response.status_code < 500, (what, response.content[:500])
    if response.status_code >= 400:
        assert database_state() == before, f"a rejected request changed something: {what}"


@settings(FUZZ, max_examples=200)
@given(route=st.sampled_from([r for r in BODY_ROUTES if not r[1].endswith(("/cancel", "/requeue"))]), data=st.data())
def test_a_valid_body_with_hostile_fields_is_400_and_changes_nothing(
    client: Client, seeded: dict[str, int], route: tuple[str, str], data: st.DataObject
) -> None:
    method, template = route
    body = valid_body(method, template, seeded)
    fields = sorted(body) or ["anything"]
    broken = data.draw(st.dictionaries(st.sampled_from(fields), hostile_values, min_size=1, max_size=2))
    url = hits_the_id(template, seeded)
    before = database_state()
    raw = dumps({**body, **broken})
    response = getattr(client, method)(url, data=raw, content_type="application/json", headers=HEADERS)
    assert response.status_code == 400, (url, raw[:300], response.content[:300])
    check_answer(response)
    assert database_state() == before, f"a rejected request changed something: {url} {raw[:300]}"


@settings(FUZZ, max_examples=80)
@given(run_after=extreme_dates)
def test_enqueue_with_any_date_is_stored_readably_or_refused(client: Client, run_after: str) -> None:
    before = database_state()
    raw = json.dumps({"task_path": "tasks.demo.sleep", "run_after": run_after})
    response = client.post("/api/tasks", data=raw, content_type="application/json", headers=HEADERS)
    assert response.status_code in (201, 400), (run_after, response.content[:300])
    check_answer(response)
    if response.status_code == 400:
        assert json.loads(response.content)["field"] == "run_after"
        assert database_state() == before
    else:
        database_state()  # every stored timestamp reads back
        assert client.get("/api/tasks?limit=500", headers=HEADERS).status_code == 200


@settings(FUZZ, max_examples=120)
@given(route=st.sampled_from(BODY_ROUTES), body=bodies, ident=ids)
def test_no_body_or_id_causes_a_server_error(
    client: Client, seeded: dict[str, int], route: tuple[str, str], body: Any, ident: str
) -> None:
    method, template = route
    url = template.replace("{id}", ident)
    before = database_state()
    raw = dumps(body)
    response = getattr(client, method)(url, data=raw, content_type="application/json", headers=HEADERS)
    assert_rejections_change_nothing(response, before, (url, raw[:300]))
    check_answer(response)


@settings(FUZZ, max_examples=120)
@given(route=st.sampled_from(sorted(GET_ROUTES)), ident=ids, data=st.data())
def test_no_query_string_causes_a_server_error_in_the_api(
    client: Client, seeded: dict[str, int], route: str, ident: str, data: st.DataObject
) -> None:
    query = data.draw(queries(GET_ROUTES[route]))
    url = route.replace("{id}", ident) + "?" + encode(query)
    before = database_state()
    response = client.get(url, headers=HEADERS)
    assert_rejections_change_nothing(response, before, url)
    check_answer(response)


@settings(FUZZ, max_examples=120)
@given(route=st.sampled_from(sorted(PAGE_ROUTES)), ident=ids, data=st.data())
def test_no_query_string_causes_a_server_error_on_pages_or_in_the_admin(
    client: Client, seeded: dict[str, int], route: str, ident: str, data: st.DataObject
) -> None:
    client.force_login(StaffFactory.create(username="fuzz-staff"))
    query = data.draw(queries(PAGE_ROUTES[route]))
    url = route.replace("{id}", ident) + "?" + encode(query)
    before = database_state()
    response = client.get(url)
    assert_rejections_change_nothing(response, before, url)


@settings(FUZZ, max_examples=80)
@given(
    form=st.fixed_dictionaries(
        {},
        optional={
            "action": st.sampled_from(["cancel", "retry", "start", "stop", "rate", "explode"]) | hostile_text,
            "ids": st.lists(ids, max_size=3),
            "rate": query_values | raw_numbers.map(lambda r: r.text),
            "next": st.sampled_from(["/dashboard/", "//evil.example/x", "https://evil.example/"]) | hostile_text,
            "_selected_action": st.lists(ids, max_size=3),
        },
    ),
    url=st.sampled_from(["/dashboard/tasks/action/", "/dashboard/generator/", "/admin/tasks/task/"]),
)
def test_no_form_causes_a_server_error_or_an_off_site_redirect(
    client: Client, seeded: dict[str, int], form: dict[str, Any], url: str
) -> None:
    client.force_login(StaffFactory.create(username="fuzz-staff"))
    before = database_state()
    # Encoded by hand: a lone surrogate goes on the wire as its (invalid) UTF-8 bytes.
    pairs = [(key, v) for key, value in form.items() for v in (value if isinstance(value, list) else [value])]
    body = encode_pairs(pairs)
    response = client.post(url, body, content_type="application/x-www-form-urlencoded")
    assert_rejections_change_nothing(response, before, (url, form))
    if response.status_code == 302:
        assert response["Location"].startswith("/"), response["Location"]
        assert not response["Location"].startswith("//"), response["Location"]


@settings(FUZZ, max_examples=80)
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_raw_garbage_bodies_are_400(client: Client, raw: bytes) -> None:
    before = database_state()
    response = client.post("/api/tasks", data=raw, content_type="application/json", headers=HEADERS)
    assert response.status_code in (200, 201, 400), response.content[:300]
    if response.status_code == 400:
        assert database_state() == before
