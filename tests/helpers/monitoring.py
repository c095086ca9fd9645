"""What the shipped monitoring files (docs/monitoring/) refer to: the PromQL expressions of the alert
rules and of the Grafana dashboard, and the metric names each expression reads. For
tests/unit/test_alert_rules.py, tests/monitoring/ and tests/db/test_monitoring_names.py."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.helpers import ROOT

MONITORING = ROOT / "docs" / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = MONITORING / "alerts.test.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"

# PromQL words that are not metric names: binary operators, modifiers, the literals.
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE)
_OFFSET = re.compile(r"\boffset\s+-?(?:\d+[a-z]+)+", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-f]+|\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+(?:e[+-]?\d+)?)", re.IGNORECASE)
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# Grafana's template queries: label_values(metric, label) names a metric and then a label.
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{[^}]*\})?\s*,)?")


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, labels or keywords)."""
    label_values = _LABEL_VALUES.match(expression)
    if label_values:
        return {label_values.group(1)} if label_values.group(1) else set()
    text = _STRING.sub('""', expression)
    text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _NAME.finditer(text):
        word = match.group()
        if word.lower() in _KEYWORDS or text[match.end() :].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def rules() -> list[dict[str, Any]]:
    """Every rule of alerts.yml."""
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_expressions() -> Iterator[tuple[str, str]]:
    """(where, expression) for every PromQL expression of the Grafana dashboard: each panel's targets
    and each template variable's query."""
    dashboard = json.loads(DASHBOARD.read_text())

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            yield f"variable {variable['name']!r}", query["query"] if isinstance(query, dict) else query


def prometheus_command(name: str) -> str:
    """The path of Debian's ``prometheus`` package's ``name`` (``promtool``, ``prometheus``), or the
    one the environment variable ``name.upper()`` names; the test fails saying how to get it."""
    path = os.environ.get(name.upper()) or shutil.which(name)
    if not path:
        pytest.fail(
            f"this test needs {name}: `apt-get install --no-install-recommends prometheus` (what .ci/run does; "
            f"Debian ships both programs in that package only) or set {name.upper()}=/path",
            pytrace=False,
        )
    return path
