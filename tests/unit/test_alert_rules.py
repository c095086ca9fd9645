"""The Prometheus alert rules and the Grafana dashboard shipped in docs/monitoring/: every alert has a
case in its unit tests (alerts.test.yml) in which it fires, the dashboard is well formed, and the
parser that the metric-name checks (tests/db/test_monitoring_names.py) rely on reads PromQL right.
What needs promtool (the rules valid, their unit tests passing) is tests/monitoring/test_promtool.py's:
the unit lane needs no system package."""

from __future__ import annotations

import json

import yaml

from tests.helpers.monitoring import DASHBOARD, RULE_TESTS, metric_names, rules


def test_every_alert_fires_in_a_test_and_has_a_severity_and_a_summary() -> None:
    document = yaml.safe_load(RULE_TESTS.read_text())
    fired = {case["alertname"] for test in document["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    alerts = [rule for rule in rules() if "alert" in rule]
    assert len(alerts) >= 10
    assert sorted(rule["alert"] for rule in alerts if rule["alert"] not in fired) == []
    assert [rule["alert"] for rule in alerts if rule["labels"].get("severity") not in ("warning", "critical")] == []
    assert [rule["alert"] for rule in alerts if not rule["annotations"].get("summary")] == []


def test_metric_names_are_read_from_promql() -> None:
    assert metric_names(
        'sum by (database) (rate(tasks_worker_events_total{event=~"a|b"}[15m]))'
        " / on (database, queue) group_left (x) tasks_queue_depth offset 5m > 1e6 and bool 0.5"
    ) == {"tasks_worker_events_total", "tasks_queue_depth"}
    assert metric_names("min_over_time(tasks_table_dead_tuples[5m:1m]) > tasks_table_live_tuples") == {
        "tasks_table_dead_tuples",
        "tasks_table_live_tuples",
    }
    assert metric_names(
        "histogram_quantile(0.9, sum by (le) (rate(leasing_acquisition_seconds_bucket[$__rate_interval])))"
    ) == {"leasing_acquisition_seconds_bucket"}
    assert metric_names('tasks_queue_depth{database=~"$database", queue=~"${queue:regex}"} > Inf') == {
        "tasks_queue_depth"
    }
    assert metric_names('label_values(tasks_queue_depth{database="$database"}, queue)') == {"tasks_queue_depth"}
    assert metric_names("label_values(database)") == set()


def test_the_grafana_dashboard_is_well_formed() -> None:
    """What Grafana needs to import it (a uid, unique panel ids, panels that do not overlap) and what
    makes it portable: every query goes to the data source the importer picks (${datasource})."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, panel["title"]
        for row in range(box["y"], box["y"] + box["h"]):
            for column in range(box["x"], box["x"] + box["w"]):
                assert (row, column) not in cells, f"{panel['title']} overlaps {cells[(row, column)]}"
                cells[(row, column)] = panel["title"]
    queried = [panel for panel in panels if panel["type"] != "row"]
    assert all(panel["targets"] for panel in queried)
    sources = {json.dumps(s) for p in queried for s in [p["datasource"], *(t["datasource"] for t in p["targets"])]}
    assert sources == {json.dumps({"type": "prometheus", "uid": "${datasource}"})}
    variables = {variable["name"]: variable["type"] for variable in dashboard["templating"]["list"]}
    assert variables == {"datasource": "datasource", "database": "query", "queue": "query"}
    # Each part the monitoring guide names has its panels: queues, throughput, workers, recovery, the table.
    rows = [panel["title"] for panel in panels if panel["type"] == "row"]
    assert rows == [
        "Overview",
        "Queues",
        "Throughput and failures",
        "Workers and leases",
        "Recovery",
        "Queue table health",
    ]
