"""``python manage.py demo``: the whole system on one machine, with failures injected.

Migrates, creates (or reuses) a local staff login and prints it, then starts as child processes:
the web server, three workers, two generator instances (one leads, one stands by) and the recovery
controller, all on the same database (the embedded PostgreSQL unless DATABASE_URL says otherwise).
The demo handler crashes ~5 % of its worker processes and freezes ~10 % past their lease TTL, so
the dashboard shows tasks being recovered; crashed workers are restarted. Unless ``--no-showcase``:
the generator's leader also enqueues a little of every other feature (tasks/demo/showcase.py), a
fourth worker serves the fair queue ``demo-fair``, and the previous 24 hours of the history are
backfilled as demo data (tasks/demo/backfill.py, queue ``demo-backfill``). Ctrl-C stops everything:
children get SIGTERM (then SIGKILL), and the embedded server is stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser
from django.urls import reverse

from leasing import embedded
from tasks.demo import backfill, generator, showcase
from tasks.management.commands._common import positive_float, positive_int

USERNAME = "demo"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # Linux: if the demo process is killed outright, its children get SIGTERM instead of living on.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    args: list[str]
    restart: bool
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = field(default=0)


class Command(BaseCommand):
    help = "Run the demo: web dashboard, workers, generator and recovery controller, with failures injected."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=positive_int, default=8000)
        parser.add_argument("--workers", type=positive_int, default=3)
        parser.add_argument(
            "--concurrency",
            type=positive_int,
            default=4,
            help="tasks each worker of the default queue runs at once (threads; the injected stalls hold theirs)",
        )
        parser.add_argument("--rate", type=positive_float, default=2.0, help="generated tasks per second")
        parser.add_argument("--ttl", type=positive_float, default=5.0, help="task lease TTL (seconds)")
        parser.add_argument("--no-failures", action="store_true", help="turn the failure injection off")
        parser.add_argument(
            "--no-showcase", action="store_true", help="only the generator's work: no retries, workflows, schedule, ..."
        )

    def handle(
        self,
        *,
        port: int,
        workers: int,
        concurrency: int,
        rate: float,
        ttl: float,
        no_failures: bool,
        no_showcase: bool,
        verbosity: int,
        **options: Any,
    ) -> None:
        call_command("migrate", verbosity=0)
        if not no_showcase:
            backfilled = backfill.backfill_history(24)
            self.stdout.write(
                f"History: {backfilled} earlier hour(s) backfilled with demo data (queue {backfill.QUEUE})"
            )
        password = self._staff_login()
        generator.set_state(running=True, rate=rate, max_sleep=3.0)
        env = dict(os.environ)
        env.update(
            TASKS_TTL=str(ttl),
            TASKS_RECOVERY_INTERVAL="1",
            TASKS_DEMO_CRASH_RATE="0" if no_failures else "0.05",
            TASKS_DEMO_STALL_RATE="0" if no_failures else "0.10",
            PYTHONUNBUFFERED="1",
            TASKS_DEMO_SHOWCASE="0" if no_showcase else "1",
        )
        manage = [sys.executable, str(Path(sys.argv[0]).resolve())]
        children = [
            Child("web", [*manage, "runserver", f"127.0.0.1:{port}", "--noreload", "--insecure"], restart=False),
            *[
                Child(
                    f"worker-{i + 1}",
                    [*manage, "run_worker", "--no-recovery", "--concurrency", str(concurrency)],
                    restart=True,
                )
                for i in range(workers)
            ],
            *[
                Child(f"generator-{i + 1}", [*manage, "run_generator", "--ttl", "3", "-v", "0"], restart=True)
                for i in range(2)
            ],
            # A fair queue is its worker's only queue (docs/howto/pausing-and-keys.md, "Limits").
            *(
                []
                if no_showcase
                else [
                    Child(
                        "worker-fair",
                        [*manage, "run_worker", "--no-recovery", "--queues", showcase.FAIR_QUEUE, "--concurrency", "2"],
                        restart=True,
                    )
                ]
            ),
            Child("recovery", [*manage, "recover_tasks", "--interval", "1"], restart=True),
        ]
        stopping = {"requested": False}

        def request_stop(*_: Any) -> None:
            stopping["requested"] = True

        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)
        try:
            for child in children:
                self._start(child, env)
            # Wherever the project mounts the package (tasks.site_urls under a prefix of its own).
            base = f"http://127.0.0.1:{port}"
            url = base + reverse("tasks:overview")
            self._wait_for(url, children[0])
            self.stdout.write(self.style.SUCCESS(f"\nDashboard: {url}"))
            self.stdout.write(f"Login:     {USERNAME} / {password}")
            self.stdout.write(f"API:       {base}{reverse('api-openapi')}   Metrics: {base}{reverse('metrics')}")
            self.stdout.write(
                "Failure injection is "
                + ("off." if no_failures else "on: ~5 % crashes, ~10 % stalls.")
                + (
                    ""
                    if no_showcase
                    else " Beside it: retries, failures, workflows, a schedule, a rate limit, a fair queue, snoozes"
                    " (docs/howto/demo.md)."
                )
                + " Ctrl-C stops everything.\n"
            )
            while not stopping["requested"]:
                for child in children:
                    assert child.proc is not None
                    code = child.proc.poll()
                    if code is None:
                        continue
                    if not child.restart:
                        self.stderr.write(f"{child.name} exited ({code}); stopping the demo")
                        stopping["requested"] = True
                        break
                    child.restarts += 1
                    self.stdout.write(f"{child.name} exited ({code}); restarting it (restart {child.restarts})")
                    self._start(child, env)
                time.sleep(0.25)
        finally:
            self._stop_all(children)
            self._stop_embedded_database()

    def _staff_login(self) -> str:
        secret_file = Path(getattr(settings, "BASE_DIR", Path.cwd())) / ".demo_password"
        user_model = get_user_model()
        user = user_model.objects.filter(username=USERNAME).first()
        if user is not None and secret_file.exists() and user.check_password(secret_file.read_text().strip()):
            return secret_file.read_text().strip()
        password = secrets.token_urlsafe(12)
        if user is None:
            user = user_model(username=USERNAME)
        user.is_staff = user.is_superuser = True
        user.set_password(password)
        user.save()
        secret_file.write_text(password)
        secret_file.chmod(0o600)
        return password

    def _start(self, child: Child, env: dict[str, str]) -> None:
        child.proc = subprocess.Popen(child.args, env=env, start_new_session=True, preexec_fn=_die_with_parent)

    def _wait_for(self, url: str, web: Child) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert web.proc is not None
            if web.proc.poll() is not None:
                raise SystemExit(f"the web server exited ({web.proc.returncode})")
            try:
                urllib.request.urlopen(url, timeout=1)
                return
            except OSError as exc:
                if getattr(exc, "code", None):  # an HTTP answer (a redirect to the login page) is fine
                    return
                time.sleep(0.2)
        raise SystemExit("the web server did not answer within 60 s")

    def _stop_all(self, children: list[Child]) -> None:
        running = [c for c in children if c.proc is not None and c.proc.poll() is None]
        for child in running:
            assert child.proc is not None
            try:
                os.kill(child.proc.pid, signal.SIGCONT)  # a worker frozen by the stall injection
                child.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        for child in running:
            assert child.proc is not None
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        self.stdout.write("demo stopped: all child processes ended")

    def _stop_embedded_database(self) -> None:
        # Only a server this process's settings started or reused (leasing.embedded.database_url);
        # with DATABASE_URL set there is none, and the database is not ours to stop.
        server = embedded.server_in_use()
        if server is None:
            return
        from django.db import connections

        connections.close_all()
        server.stop()
        self.stdout.write("embedded PostgreSQL stopped")
