"""The documented production environment passes ``manage.py check --deploy`` without a warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.helpers import ROOT


def documented_environment() -> dict[str, str]:
    """The variables of the "Production settings" block of docs/howto/production.md."""
    page = (ROOT / "docs" / "howto" / "production.md").read_text()
    block = re.search(r"<!-- production-env -->\s*```sh\n(.*?)```\s*<!-- /production-env -->", page, re.S)
    assert block, "docs/howto/production.md has no production-env block"
    pairs = [line.split("=", 1) for line in block.group(1).splitlines() if line and not line.startswith("#")]
    return {name: value for name, value in pairs}


def check_deploy(environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""), **environment}
    clean["DJANGO_SETTINGS_MODULE"] = "project.settings"
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_documented_production_environment_passes_check_deploy() -> None:
    environment = documented_environment()
    assert {"DEBUG", "SECRET_KEY", "ALLOWED_HOSTS", "CSRF_TRUSTED_ORIGINS", "HTTPS"} <= set(environment)
    result = check_deploy(environment)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_without_it_check_deploy_warns_about_each_setting() -> None:
    environment = {"SECRET_KEY": documented_environment()["SECRET_KEY"], "DATABASE_URL": "postgres://x@localhost/x"}
    result = check_deploy(environment)
    assert result.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in result.stderr + result.stdout, warning
    # Each can also be set on its own, without HTTPS=true.
    environment |= {
        "SECURE_SSL_REDIRECT": "true",
        "SESSION_COOKIE_SECURE": "true",
        "CSRF_COOKIE_SECURE": "true",
        "SECURE_HSTS_SECONDS": "3600",
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": "true",
        "SECURE_HSTS_PRELOAD": "true",
    }
    assert check_deploy(environment).returncode == 0
