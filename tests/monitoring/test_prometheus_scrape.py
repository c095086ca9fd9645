"""The shipped monitoring files against a real Prometheus (Debian's ``prometheus`` package, which
.ci/run installs for promtool): it scrapes this project's /metrics from a live server, loads
docs/monitoring/alerts.yml and evaluates every rule, and answers every query of the Grafana dashboard
(its variables filled as Grafana fills them). What promtool's static checks cannot see shows here:
a query that parses but fails on real series (a many-to-many match, a label a join expects and the
exporter does not give), a rule whose evaluation errors, a panel whose query selects nothing."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.models import Task
from tests.helpers import wait_until
from tests.helpers.monitoring import RULES, dashboard_expressions, prometheus_command, rules
from tests.helpers.pgbouncer import free_port
from tests.helpers.task_paths import NOOP

pytestmark = [pytest.mark.django_db(transaction=True)]


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> dict[str, Any]:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            return dict(json.load(response))

    def query(self, expression: str) -> dict[str, Any]:
        """The API's answer to an instant query; a query Prometheus refuses answers 400 with its error."""
        try:
            return self.get("/api/v1/query", query=expression)
        except urllib.error.HTTPError as exc:
            if exc.code not in (400, 422):
                raise
            return dict(json.load(exc))

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
                return response.status == 200
        except OSError:  # not listening yet, or 503 while it starts
            return False


@pytest.fixture
def prometheus(live_server: Any, settings: Any, tmp_path: Path) -> Iterator[Prometheus]:
    settings.LEASING_METRICS_PUBLIC = True
    address = urllib.parse.urlsplit(live_server.url)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is YAML
            {
                # A scrape may take 4 s on a loaded machine: a timeout of the interval's 1 s
                # would leave the series stale, and the dashboard's queries empty, by speed alone.
                "global": {"scrape_interval": "4s", "scrape_timeout": "4s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],
                "scrape_configs": [
                    {"job_name": "django-leasing", "static_configs": [{"targets": [address.netloc]}]},
                ],
            }
        )
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            prometheus_command("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        server = Prometheus(f"http://127.0.0.1:{port}")

        def scraped_thrice() -> bool:
            answer = server.query('count_over_time(up{job="django-leasing"}[1m]) >= 3 and up == 1')
            return bool(answer["data"]["result"])

        logged = f"(log: {tmp_path / 'prometheus.log'})"
        wait_until(server.ready, timeout=60, interval=0.2, what=f"Prometheus ready {logged}")
        wait_until(scraped_thrice, timeout=60, interval=0.2, what=f"three scrapes {logged}")
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def filled(expression: str) -> str:
    """A dashboard query as Grafana sends it: its variables at "all" and its rate window at 1m."""
    return (
        expression.replace("$__rate_interval", "1m")
        .replace('"$database"', '".*"')
        .replace('"$queue"', '".*"')
        .replace("$database", ".*")
        .replace("$queue", ".*")
    )


def test_every_rule_evaluates_and_every_dashboard_query_answers_on_real_series(prometheus: Prometheus) -> None:
    Task.objects.enqueue(NOOP, queue="default")
    Task.objects.enqueue(NOOP, queue="mail", priority=5)
    wait_until(
        lambda: len(prometheus.query("tasks_queue_depth")["data"]["result"]) == 2,
        timeout=30,
        interval=0.2,
        what="a scrape that saw both queues",
    )

    # Every alert rule is evaluated with health "ok" (an evaluation error shows as "err" with its reason).
    names = {rule["alert"] for rule in rules() if "alert" in rule}

    def all_rules_evaluated() -> list[dict[str, Any]] | None:
        groups = prometheus.get("/api/v1/rules")["data"]["groups"]
        loaded = [rule for group in groups for rule in group["rules"]]
        if {rule["name"] for rule in loaded} != names:
            return None
        if any(rule.get("health") == "unknown" for rule in loaded):
            return None  # not evaluated yet
        return loaded

    loaded = wait_until(all_rules_evaluated, timeout=60, interval=0.2, what="every rule evaluated once")
    broken = {rule["name"]: rule.get("lastError") for rule in loaded if rule.get("health") != "ok"}
    assert not broken, broken

    # Every panel's and variable's query: accepted, and selecting series (a panel that selects nothing
    # shows "No data": a wrong metric or label name, or a join that matches nothing).
    refused, empty = {}, []
    for where, expression in dashboard_expressions():
        if expression.startswith("label_values("):
            metric = expression[len("label_values(") :].split(",")[0].strip()
            expression = filled(metric)
        answer = prometheus.query(filled(expression))
        if answer["status"] != "success":
            refused[where] = answer.get("error")
        elif not answer["data"]["result"]:
            empty.append(where)
    assert not refused, refused
    assert not empty, f"queries that select nothing on a live exporter: {empty}"
