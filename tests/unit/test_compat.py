"""One module chooses Django's task framework (tasks/compat.py); the system check names what is missing."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import django
import pytest
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured

from tasks import compat
from tasks.checks import check_task_framework
from tests.helpers import ROOT

# An import of either framework: `from django.tasks… import`, `import django_tasks…`, and the like.
FRAMEWORK_IMPORT = re.compile(r"^\s*(from|import)\s+(django\.tasks|django_tasks)\b", re.MULTILINE)


def test_nothing_but_the_compat_module_imports_the_framework() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("leasing", "tasks", "tests", "bench", "project")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != ROOT / "tasks" / "compat.py" and FRAMEWORK_IMPORT.search(path.read_text())
    ]
    assert offenders == []


def test_the_framework_of_this_django() -> None:
    expected = "django.tasks" if django.VERSION >= (6, 0) else "django_tasks"
    assert expected == compat.FRAMEWORK
    assert f"{expected}.backends.immediate.ImmediateBackend" == compat.IMMEDIATE_BACKEND
    assert compat.TaskResultStatus.SUCCESSFUL == "SUCCESSFUL"
    assert issubclass(compat.InvalidTaskBackend, ImproperlyConfigured)
    assert check_task_framework() == []  # the project's own settings are complete on either


def test_django_5_2_without_the_backport_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(django, "VERSION", (5, 2, 8, "final", 0))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "django_tasks" else real_find_spec(name, *a)
    )
    with pytest.raises(ImproperlyConfigured, match=r'pip install "django-leasing\[django52\]"'):
        compat._framework()


def test_an_old_backport_or_one_not_installed_as_an_app_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "FRAMEWORK", "django_tasks")
    monkeypatch.setattr(compat, "backport_version", lambda: (0, 11, 0))
    found: dict[str | None, Any] = {message.id: message.msg for message in check_task_framework()}
    assert "django-tasks 0.11.0 is installed" in found.pop("tasks.E107")
    if not apps.is_installed("django_tasks"):  # Django 6 settings: the backport's app is not there
        assert "INSTALLED_APPS" in found.pop("tasks.E108")
    assert found == {}


def test_the_readme_s_settings_block_installs_the_backport_s_app_on_django_5_2() -> None:
    """README "Add it to your project", step 2: the block a user copies is right on either Django, not
    only with the prose above it read (tests/install/test_add_to_project.py applies it as written, on
    the Django 5.2 leg too)."""
    from tests.helpers.doc_blocks import block_of

    block = block_of("README.md", "# settings.py\nimport django\n\nINSTALLED_APPS +=")
    startproject = ["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes"]
    namespace: dict[str, Any] = {"INSTALLED_APPS": list(startproject)}
    exec(compile(block.text, block.where, "exec"), namespace)
    added = namespace["INSTALLED_APPS"][len(startproject) :]
    assert added == ["leasing", "tasks", *(["django_tasks"] if django.VERSION < (6, 0) else [])]
    # On this machine's Django 6 the line for 5.2 does not run: the block must still carry it.
    assert re.search(r'^if django\.VERSION < \(6, 0\):.*\n +INSTALLED_APPS \+= \["django_tasks"\]', block.text, re.M)
