"""The documented production settings pass ``manage.py check --deploy`` without a warning
(docs/howto/production.md): the settings block in a new ``startproject`` project set up as the README
says, and the environment block in the bundled ``project/``."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT
from tests.helpers.doc_blocks import block_of


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


def startproject_with(tmp_path: Path, *blocks: str) -> Path:
    """A project made by ``django-admin startproject mysite`` whose settings end with ``blocks``."""
    subprocess.run([sys.executable, "-m", "django", "startproject", "mysite", str(tmp_path)], check=True, timeout=60)
    settings_file = tmp_path / "mysite" / "settings.py"
    with settings_file.open("a") as out:
        for block in blocks:
            out.write("\n" + block)
    return tmp_path


def check_deploy_in(project: Path, environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", ""), **environment}
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=project,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


def readme_settings() -> list[str]:
    """The README's step 2 (the apps, TASKS, the database), as a new project appends them."""
    apps = block_of("README.md", "# settings.py\nimport django\n\nINSTALLED_APPS").text  # the backport's app on 5.2
    return [apps, block_of("README.md", "# settings.py\nimport environ").text]


def test_the_documented_project_settings_pass_check_deploy_in_a_new_project(tmp_path: Path) -> None:
    production = block_of("docs/howto/production.md", "# settings.py, at the end: production behind HTTPS").text
    environment = {
        "SECRET_KEY": secrets.token_urlsafe(50),
        "ALLOWED_HOSTS": "leasing.example.com",
        # check does not connect: the URL keeps the README's settings from starting an embedded server
        "DATABASE_URL": "postgres://leasing@db.example.com/leasing",
    }
    project = startproject_with(tmp_path, *readme_settings(), production)
    result = check_deploy_in(project, environment)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_a_new_project_without_the_block_fails_check_deploy(tmp_path: Path) -> None:
    project = startproject_with(tmp_path, *readme_settings())
    result = check_deploy_in(project, {"DATABASE_URL": "postgres://leasing@db.example.com/leasing"})
    assert result.returncode != 0
    for warning in (
        "security.W004",
        "security.W008",
        "security.W009",
        "security.W012",
        "security.W016",
        "security.W018",
    ):
        assert warning in result.stderr + result.stdout, warning
