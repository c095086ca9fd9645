"""The Prometheus alert rules and the Prometheus configuration of the monitoring guide, checked by
promtool (Debian's ``prometheus`` package, which .ci/run installs; Debian ships promtool in no smaller
package): the rules are valid, pass their own unit tests, and a wrong expectation fails them. Apart
from tests/unit so that the unit lane needs no system package (tests/unit/test_alert_rules.py checks
what needs no promtool)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

from tests.helpers import ROOT
from tests.helpers.monitoring import RULE_TESTS, RULES, prometheus_command, rules


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
