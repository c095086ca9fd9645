"""A release is one command away (docs/CONTRIBUTING.md, "Releasing"): the documented command builds
the sdist and the wheel and ``twine check --strict`` passes them; the version of the files is the one
at the top of docs/changelog.md; the sdist alone builds a wheel with the same contents."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.helpers.doc_blocks import block_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # tomllib is 3.11+; its original, tomli, is a dev dependency below 3.11 (pytest needs it too)
    import tomli as tomllib

pytestmark = pytest.mark.slow


def release_command() -> str:
    return block_of("docs/CONTRIBUTING.md", "rm -rf dist && ").text.strip()


def test_the_changelog_leads_with_the_packaged_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    first = re.search(r"^## (\S+)", (ROOT / "docs" / "changelog.md").read_text(), re.M)
    assert first is not None and first.group(1) == version


def test_the_release_command_builds_checked_files(tmp_path: Path) -> None:
    # The command as written, in a copy of the sources (it empties dist/), with .venv/bin/ as this venv.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(".venv*", ".git", "dist", "build", ".pgdata*", "__pycache__", ".*_cache"),
    )
    (source / ".venv").symlink_to(Path(sys.prefix))
    result = subprocess.run(
        ["bash", "-e", "-c", release_command()], cwd=source, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    (sdist,) = (source / "dist").glob("*.tar.gz")
    (wheel,) = (source / "dist").glob("*.whl")
    assert sdist.name == f"django_leasing-{version}.tar.gz" and wheel.name.startswith(f"django_leasing-{version}-")

    # The sdist alone rebuilds the same wheel (what pip does when it falls back to the sdist).
    rebuilt = tmp_path / "rebuilt"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(rebuilt), str(sdist)],
        check=True,
        timeout=600,
    )
    (again,) = rebuilt.glob("*.whl")
    assert sorted(zipfile.ZipFile(again).namelist()) == sorted(zipfile.ZipFile(wheel).namelist())
