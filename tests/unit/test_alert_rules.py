"""The Prometheus alert rules and the Grafana dashboard shipped in docs/monitoring/: promtool finds the
rules valid and their unit tests (alerts.test.yml) pass, every alert has a case there in which it
fires, the dashboard is well formed, and the parser that the metric-name checks
(tests/db/test_monitoring_names.py) rely on reads PromQL right.

promtool comes with Debian's ``prometheus`` package (Debian ships it in no smaller package); .ci/run
installs it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from tests.helpers import ROOT
from tests.helpers.monitoring import DASHBOARD, RULE_TESTS, RULES, metric_names, prometheus_command, rules


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [prometheus_command("promtool"), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_promtool_finds_the_rules_valid() -> None:
    checked = run_promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_the_rules_pass_their_promtool_unit_tests() -> None:
    tested = run_promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_promtool_fails_a_rule_test_that_expects_the_wrong_alert(tmp_path: Path) -> None:
    """The run above can fail: the same tests with one expectation changed do."""
    document = yaml.safe_load(RULE_TESTS.read_text())
    document["rule_files"] = [str(RULES)]
    firing = next(case for test in document["tests"] for case in test["alert_rule_test"] if case["exp_alerts"])
    firing["exp_alerts"][0]["exp_labels"]["severity"] = "page-someone"
    broken = tmp_path / "broken.test.yml"
    broken.write_text(yaml.safe_dump(document))
    tested = run_promtool("test", "rules", str(broken))
    assert tested.returncode != 0
    assert "page-someone" in tested.stdout + tested.stderr


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


def test_the_prometheus_configuration_of_the_monitoring_guide_loads_the_rules(tmp_path: Path) -> None:
    """docs/howto/monitoring.md's prometheus.yml, as written, with the rules copied where it says and
    a token file: promtool checks the configuration and the rule file it names."""
    page = (ROOT / "docs" / "howto" / "monitoring.md").read_text()
    block = re.search(r"<!-- prometheus-config -->\s*```yaml\n(.*?)```\s*<!-- /prometheus-config -->", page, re.S)
    assert block, "docs/howto/monitoring.md has no prometheus-config block"
    config = tmp_path / "prometheus.yml"
    config.write_text(block.group(1))
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "django-leasing.yml").write_text(RULES.read_text())
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "leasing-metrics-token").write_text("a-token-from-LEASING_METRICS_TOKENS\n")
    checked = run_promtool("check", "config", str(config))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout
