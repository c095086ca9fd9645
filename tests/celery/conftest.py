"""A real Redis (Debian's redis-server on a unix socket in a temporary directory) and real Celery
worker processes (``celery -A project worker``), started by the tests themselves."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, child_env, stop_process, wait_until


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("the Celery tests need Debian's redis-server (`apt-get install redis-server`; .ci/run does it)")
    directory = tmp_path_factory.mktemp("redis")
    socket_path = directory / "redis.sock"
    proc = subprocess.Popen(
        [server, "--port", "0", "--unixsocket", str(socket_path), "--unixsocketperm", "700", "--save", "",
         "--appendonly", "no", "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(socket_path.exists, 20, what="redis-server")
        yield f"redis+socket://{socket_path}"
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[Any]:
    import redis

    client = redis.Redis(unix_socket_path=redis_url.removeprefix("redis+socket://"))
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def celery_app(redis_url: str) -> Any:
    from project.celery import app

    app.conf.broker_url = redis_url
    return app


@pytest.fixture
def celery_workers(redis_url: str, redis_client: Any, tmp_path: Path) -> Iterator[Any]:
    started: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(name: str) -> subprocess.Popen[bytes]:
        log_path = tmp_path / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "project", "worker", "--pool=solo", "-n", f"{name}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
            cwd=ROOT,
            env=child_env(
                CELERY_BROKER_URL=redis_url,
                CELERY_VISIBILITY_TIMEOUT="2",
                CELERY_UNACKED_RESTORE_INTERVAL="1",
                CELERY_UNACKED_RESTORE_THROTTLE="1",
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        started.append((proc, log_path))
        wait_until(lambda: " ready." in log_path.read_text(), 60, what=f"celery worker {name}")
        return proc

    start.logs = tmp_path  # type: ignore[attr-defined]
    yield start
    for proc, _ in started:
        stop_process(proc)


def settled(redis_client: Any) -> bool:
    """No message waiting, none delivered and unacknowledged (retries with an ETA count as delivered)."""
    return not redis_client.llen("celery") and not redis_client.hlen("unacked")
