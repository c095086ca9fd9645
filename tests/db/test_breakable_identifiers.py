"""Identifiers in narrow columns break at their separators (issue 56, item 11: ``defaul|t``, task paths
and worker ids cut mid-word): task paths, queues and worker ids are written with a line-break
opportunity (``<wbr>``) after each ``.``, ``:``, ``_``, ``-`` and ``/``, escaped, and read the same."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tasks.models import Task
from tasks.templatetags.task_states import breakable

PATH = "tests.testapp.handlers.noop"
WBR_PATH = "tests.<wbr>testapp.<wbr>handlers.<wbr>noop"


def test_the_filter_escapes_first_and_breaks_after_separators_only() -> None:
    assert breakable(PATH) == WBR_PATH
    assert breakable("default") == "default"
    assert breakable("w-1:4f2a") == "w-<wbr>1:<wbr>4f2a"
    assert breakable('<script>alert("x")</script>&') == ("&lt;script&gt;alert(&quot;x&quot;)&lt;/<wbr>script&gt;&amp;")
    assert breakable(None) == ""
    # What a reader copies is the identifier: the markup adds no character.
    assert re.sub(r"<wbr>", "", breakable("a.b:c_d-e/f")) == "a.b:c_d-e/f"


@pytest.mark.django_db
def test_the_lists_write_task_paths_queues_and_workers_breakable(staff: Client) -> None:
    Task.objects.enqueue(PATH, queue="bulk-mail_eu")
    Task.objects.claim("worker-a:12ab", limit=1, queues=["bulk-mail_eu"], ttl=300)
    running = staff.get("/dashboard/tasks/running/").content.decode()
    assert WBR_PATH in running
    assert "bulk-<wbr>mail_<wbr>eu" in running
    assert "worker-<wbr>a:<wbr>12ab" in running
    every = staff.get("/dashboard/tasks/").content.decode()
    assert WBR_PATH in every
