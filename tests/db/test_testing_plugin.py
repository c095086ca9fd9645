"""The pytest plugin as a user's pytest meets it: a pytest of its own (a new process, in a directory
of its own, nothing of this repository's configuration) finds it through the package's ``pytest11``
entry point, stays harmless in a project without Django, and in a Django project gives the fixtures
whose assertion fails a test when the task was not enqueued."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def run_pytest(directory: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error", "-q", *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_project_without_django_loads_the_plugin_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "test_plain.py").write_text(
        textwrap.dedent(
            """
            import sys

            def test_plain(request):
                assert request.config.pluginmanager.has_plugin("django_leasing")
                # The plugin imported neither the task models nor Django's settings machinery.
                assert "tasks.models" not in sys.modules and "django.conf" not in sys.modules
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH")}
    # pytest-django is installed here too: it stays idle without settings; so must this plugin.
    plain = run_pytest(tmp_path, "-p", "no:django", env=env)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "1 passed" in plain.stdout
    listed = run_pytest(tmp_path, "--fixtures", env=env)  # pytest-django loaded, without settings
    assert listed.returncode == 0, listed.stdout + listed.stderr
    for fixture in ("enqueued_tasks", "run_tasks", "eager_tasks"):
        assert fixture in listed.stdout


USER_TESTS = """
import pytest
from django.test import TestCase

from tasks.testing import TaskTestMixin
from tests.testapp.testing_handlers import send_welcome, sign_up


@pytest.mark.django_db
def test_enqueued(enqueued_tasks, run_tasks):
    sign_up("a@example.com")
    enqueued_tasks.assert_enqueued(send_welcome, args=["a@example.com"])
    assert run_tasks().succeeded == 1


@pytest.mark.django_db
def test_forgot_to_enqueue(enqueued_tasks):
    sign_up("b@example.com", send=False)
    enqueued_tasks.assert_enqueued(send_welcome, args=["b@example.com"])


class MixinTests(TaskTestMixin, TestCase):
    def test_enqueued(self):
        sign_up("c@example.com")
        self.assertEnqueued(send_welcome, kwargs={"lang": "fr"})

    def test_forgot_to_enqueue(self):
        sign_up("d@example.com", send=False)
        self.assertEnqueued(send_welcome)
"""


def test_a_django_project_gets_fixtures_whose_assertions_fail_a_test(tmp_path: Path, django_db_setup: None) -> None:
    (tmp_path / "test_users.py").write_text(USER_TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DJANGO_SETTINGS_MODULE": "tests.settings"}
    # The test database this session made (and migrated) is reused, and left to it: each user test
    # runs in a transaction that is rolled back.
    result = run_pytest(tmp_path, "--reuse-db", env=env)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "2 failed, 2 passed" in out, out
    assert "FAILED test_users.py::test_forgot_to_enqueue" in out
    assert "FAILED test_users.py::MixinTests::test_forgot_to_enqueue" in out
    assert "expected at least one enqueued tests.testapp.testing_handlers.send_welcome" in out
    assert "Nothing was enqueued since the capture began." in out
