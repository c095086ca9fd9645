"""The all-tasks page's one box on its own (no database): which words are filters and which the
search, what the redirect's query string holds, and what each chip links to."""

from __future__ import annotations

import pytest
from django.http import QueryDict

from leasing.validation import InvalidInput
from tasks.web import filter_box
from tasks.web.all_tasks import TEXT_FILTERS
from tasks.web.filter_box import box_text, filter_chips, lift, split, status_chips

PATH = "/dashboard/tasks/"
LABELS = ["Awaiting", "Blocked", "Ready", "Running", "Successful", "Failed", "Cancelled"]


def test_the_box_takes_every_filter_the_page_takes_and_no_other() -> None:
    assert set(filter_box.FILTERS) == {"status", "workflow", "enqueued_after", "enqueued_before", *TEXT_FILTERS}


@pytest.mark.parametrize(
    ("text", "tokens", "search"),
    [
        ("send_email", [], "send_email"),
        ("queue:mail", [("queue", "mail")], ""),
        ("queue:mail send_email", [("queue", "mail")], "send_email"),
        ("send_email queue:mail", [("queue", "mail")], "send_email"),
        # Only the first colon splits: dates and keys hold colons.
        (
            "enqueued_after:2026-01-31T09:30:00+00:00 rate_key:acme:eu",
            [("enqueued_after", "2026-01-31T09:30:00+00:00"), ("rate_key", "acme:eu")],
            "",
        ),
        ('queue:"a b" x', [("queue", "a b")], "x"),
        ('queue:"say \\"hi\\" \\\\ there"', [("queue", 'say "hi" \\ there')], ""),
        ('queue:""', [("queue", "")], ""),
        ("queue:", [("queue", "")], ""),
        ('queue:a"b', [("queue", 'a"b')], ""),  # a quote inside a bare value is the value's
        (
            "status:Failed status:cancelled,Ready",
            [("status", "Failed"), ("status", "cancelled,Ready")],
            "",
        ),
        # A word that names no filter is search text: a worker id, a name in another case, a quote first.
        ("vm:4242:demo", [], "vm:4242:demo"),
        ("foo:bar queue:mail", [("queue", "mail")], "foo:bar"),
        ("Queue:mail", [], "Queue:mail"),
        ('"queue:mail"', [], '"queue:mail"'),
        ("xqueue:mail", [], "xqueue:mail"),
        # An argument search and everything after it is search, whatever its JSON holds.
        ('kwargs:{"customer": 7}', [], 'kwargs:{"customer": 7}'),
        (
            'queue:mail kwargs:{"note": "status:Failed queue:x"}',
            [("queue", "mail")],
            'kwargs:{"note": "status:Failed queue:x"}',
        ),
        ("args:[7, 8] status:Failed", [], "args:[7, 8] status:Failed"),
        ('KWARGS:{"a": 1}', [], 'KWARGS:{"a": 1}'),
        # The search keeps its own spacing (an exact dedup key may hold two spaces).
        ("order  7 queue:mail", [("queue", "mail")], "order  7"),
        ("  a queue:x  b  ", [("queue", "x")], "a b"),
    ],
)
def test_split_reads_tokens_and_leaves_the_rest_as_the_search(
    text: str, tokens: list[tuple[str, str]], search: str
) -> None:
    assert split(text) == (tokens, search)


@pytest.mark.parametrize("text", ['queue:"a b', 'queue:"a"b', 'x task_path:"', 'queue:"a\\"'])
def test_a_quote_left_open_is_refused_with_its_reason(text: str) -> None:
    with pytest.raises(InvalidInput, match=r'the quoted value of \w+: needs its closing "') as raised:
        split(text)
    assert raised.value.field == "q"


def test_lift_moves_the_tokens_to_their_parameters_and_keeps_the_others() -> None:
    params = QueryDict("db=second&status=Running&queue=old&before=99&q=queue:mail+status:Failed,Cancelled+send_email")
    lifted = lift(params)
    assert lifted is not None
    assert lifted.getlist("status") == ["Running", "Failed", "Cancelled"]  # status adds
    assert lifted["queue"] == "mail"  # any other filter replaces
    assert lifted["q"] == "send_email"
    assert lifted["db"] == "second" and lifted["before"] == "99"
    assert params["queue"] == "old"  # the request's own is left alone

    lifted = lift(QueryDict("queue=mail&q=queue:+status:Failed+status:Failed"))
    assert lifted is not None
    assert "queue" not in lifted and "q" not in lifted  # an empty value removes; nothing left to search
    assert lifted.getlist("status") == ["Failed"]

    assert lift(QueryDict("q=send_email&db=second")) is None
    assert lift(QueryDict('q=kwargs:{"queue":"x"}')) is None
    assert lift(QueryDict("queue=mail")) is None


def test_the_box_shows_the_filters_as_tokens_that_read_back_the_same() -> None:
    params = QueryDict("", mutable=True)
    params.update({"queue": "a b", "rate_key": 'acme:"eu"', "task_path": "app.x", "q": "send_email"})
    params["workflow"] = "12"
    params["enqueued_after"] = "2026-01-31T09:30:00+00:00"
    params["debounce_key"] = '"quoted'
    text = box_text(params, ["Failed", "Cancelled"])
    assert text == (
        'status:Failed status:Cancelled queue:"a b" task_path:app.x workflow:12 rate_key:acme:"eu"'
        ' debounce_key:"\\"quoted" enqueued_after:2026-01-31T09:30:00+00:00 send_email'
    )
    submitted = QueryDict("", mutable=True)
    submitted["q"] = text
    lifted = lift(submitted)
    assert lifted is not None
    for name in ("queue", "rate_key", "task_path", "workflow", "enqueued_after", "debounce_key", "q"):
        assert lifted[name] == params[name], name
    assert lifted.getlist("status") == ["Failed", "Cancelled"]
    assert box_text(QueryDict(""), []) == ""


def test_each_status_chip_adds_or_removes_its_status_and_keeps_the_rest() -> None:
    params = QueryDict("db=second&status=failed&queue=mail&before=12")
    chips = {chip.key: chip for chip in status_chips(PATH, params, ["Failed"], LABELS)}
    assert [chip.key for chip in chips.values()] == LABELS
    assert chips["Failed"].on and not chips["Ready"].on
    assert chips["Failed"].href == PATH + "?db=second&queue=mail"  # removed (and the pager's cursor)
    assert chips["Ready"].href == PATH + "?db=second&status=Failed&status=Ready&queue=mail"
    none = {chip.key: chip for chip in status_chips(PATH, QueryDict(""), [], LABELS)}
    assert none["Cancelled"].href == PATH + "?status=Cancelled" and not none["Cancelled"].on


def test_each_filter_chip_removes_its_filter_only() -> None:
    params = QueryDict("status=Failed&queue=mail&enqueued_before=2026-01-31T00:00:00Z&q=send_email&db=second&before=5")
    chips = filter_chips(PATH, params)
    assert [(chip.key, chip.text) for chip in chips] == [
        ("queue", "queue:mail"),
        ("enqueued_before", "enqueued_before:2026-01-31T00:00:00Z"),
        ("q", "search: send_email"),
    ]
    hrefs = {chip.key: QueryDict(chip.href.partition("?")[2]) for chip in chips}
    assert "queue" not in hrefs["queue"] and hrefs["queue"]["q"] == "send_email"
    assert hrefs["queue"].getlist("status") == ["Failed"] and hrefs["queue"]["db"] == "second"
    assert "enqueued_before" not in hrefs["enqueued_before"] and hrefs["enqueued_before"]["queue"] == "mail"
    assert "q" not in hrefs["q"] and hrefs["q"]["enqueued_before"] == "2026-01-31T00:00:00Z"
    assert all("before" not in query for query in hrefs.values())
    assert filter_chips(PATH, QueryDict("status=Failed&queue=")) == []
