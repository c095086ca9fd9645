"""``manage.py demo`` (the end of README.md's first command) starts everything, serves the dashboard,
and leaves nothing behind on SIGINT."""

from __future__ import annotations

import signal
import socket
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tasks.models import Task, Worker
from tests.helpers import start_manage, stop_process, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.one_stack]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def answers(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def test_demo_starts_serves_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    demo = start_manage(tmp_path / "demo.log", "demo", "--port", str(port), "--rate", "5", "--ttl", "2")
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/admin/login/") == 200, 60, what="the web server")
        wait_until(lambda: Worker.objects.filter(stopped_at__isnull=True).count() >= 3, 60, what="three workers")
        wait_until(lambda: Task.objects.filter(status="SUCCESSFUL").exists(), 60, what="generated work to be done")
        children = psutil.Process(demo.pid).children(recursive=True)
        assert len(children) >= 7  # web, 3 workers, 2 generators, recovery (and the fair queue's worker)
        # The demo prints its addresses once its own request to the web server was answered, which
        # may come after the test's: wait for the last of those lines, then read them.
        wait_until(lambda: "Login:" in (tmp_path / "demo.log").read_text(), 60, what="the demo's addresses")
        log = (tmp_path / "demo.log").read_text()
        assert "Dashboard: http://127.0.0.1:" in log
        assert "Login:     demo / " in log
        assert answers(f"http://127.0.0.1:{port}/dashboard/") == 200  # the login page, after the redirect

        demo.send_signal(signal.SIGINT)
        assert demo.wait(60) == 0
        _gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"left behind: {alive}"
        assert "demo stopped: all child processes ended" in (tmp_path / "demo.log").read_text()
    finally:
        stop_process(demo)
