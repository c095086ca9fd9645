"""The alert rules and the Grafana dashboard of docs/monitoring/ read only metrics that /metrics
emits: each expression's metric names, against a scrape of a real database (every family the
collectors yield, with or without samples, under the names its samples take)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from tasks.models import Task
from tests.helpers.monitoring import dashboard_expressions, metric_names, rules

pytestmark = pytest.mark.django_db

# The sample names a family of each type has in the text format (prometheus-client).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}


def exported(client: Client) -> set[str]:
    response = client.get("/metrics")
    assert response.status_code == 200
    names = set()
    for family in text_string_to_metric_families(response.content.decode()):
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
        names |= {sample.name for sample in family.samples}
    return names


@pytest.fixture
def names(client: Client, settings: Any) -> set[str]:
    settings.LEASING_METRICS_PUBLIC = True
    Task.objects.enqueue("tasks.demo.sleep", queue="mail")
    found = exported(client)
    assert {"tasks_queue_depth", "tasks_table_dead_tuples", "tasks_heartbeats_total"} <= found
    return found


def test_every_metric_the_alert_rules_read_is_exported(names: set[str]) -> None:
    used = {rule.get("alert") or rule.get("record"): metric_names(rule["expr"]) for rule in rules()}
    assert all(used.values()), used
    unknown = {rule: sorted(found - names) for rule, found in used.items() if found - names}
    assert unknown == {}


def test_every_metric_the_grafana_dashboard_reads_is_exported(names: set[str]) -> None:
    used = list(dashboard_expressions())
    assert len(used) > 15
    assert [where for where, expression in used if not metric_names(expression)] == []
    unknown = [(where, sorted(metric_names(expression) - names)) for where, expression in used]
    assert [entry for entry in unknown if entry[1]] == []
