"""A real PgBouncer (Debian's ``pgbouncer`` package) in transaction pooling, in front of the test
database, for the tests that run the project through a pooler (tests/concurrency/test_pgbouncer.py).

It listens on a free loopback port, forwards every database name to the test server (its unix
socket, or its host and port), and pools in transaction mode with a small pool, as teams with many
replicas run it. PgBouncer refuses to run as root: under root it runs as the owner of the server's socket directory
(the embedded server's user, or Debian's postgres) or, for a server reached over TCP, as ``nobody``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg

from tests.helpers import wait_until

INSTALL_HINT = "PgBouncer is not installed: apt-get install pgbouncer (.ci/run installs it)"


@dataclass(frozen=True)
class Bouncer:
    port: int
    pool_size: int
    user: str
    log: Path

    def url(self, dbname: str) -> str:
        """A DATABASE_URL through the pooler."""
        return f"postgres://{quote(self.user)}@127.0.0.1:{self.port}/{quote(dbname)}"

    def conninfo(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.port} dbname={dbname} user={self.user}"

    def clients(self, dbname: str) -> tuple[int, int]:
        """The pool of ``dbname`` from the admin console's SHOW POOLS: its clients that hold a server
        connection or sit idle (``cl_active``), and those queued for one (``cl_waiting``)."""
        # The admin console speaks the simple query protocol only: a client-side cursor sends that.
        with psycopg.connect(self.conninfo("pgbouncer"), autocommit=True, cursor_factory=psycopg.ClientCursor) as admin:
            cursor = admin.execute("SHOW POOLS")
            names = [column.name for column in cursor.description or ()]
            for row in cursor.fetchall():
                pool = dict(zip(names, row, strict=True))
                if pool["database"] == dbname:
                    return int(pool["cl_active"]), int(pool["cl_waiting"])
        return 0, 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_as(server_host: str) -> pwd.struct_passwd | None:
    """Under root, the user PgBouncer runs as: the owner of the server's socket directory (which
    only its owner may reach: the embedded server's user, or Debian's postgres), else nobody."""
    if os.geteuid() != 0:
        return None
    if server_host.startswith("/"):
        owner = pwd.getpwuid(os.stat(server_host).st_uid)
        if owner.pw_uid != 0:
            return owner
    return pwd.getpwnam("nobody")


@contextmanager
def pgbouncer(settings_dict: dict[str, Any], *, pool_size: int = 4, settings: str = "") -> Iterator[Bouncer]:
    """PgBouncer in front of the server of ``settings_dict`` (a Django DATABASES entry). Its files
    live in a directory of their own under /tmp, which the user it runs as can reach (a pytest
    ``tmp_path`` under root's private directory is not). ``settings``: lines of a ``[pgbouncer]``
    section (a user's, e.g. a documented pgbouncer.ini), written as they are after the helper's own
    (where they name the same setting, PgBouncer takes the later line)."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists():
        raise RuntimeError(INSTALL_HINT)
    options = settings_dict.get("OPTIONS") or {}
    host = options.get("host") or settings_dict.get("HOST") or "127.0.0.1"
    server_port = options.get("port") or settings_dict.get("PORT")
    server = f"host={host}" + (f" port={server_port}" if server_port else "")
    if settings_dict.get("PASSWORD"):
        server += f" password={settings_dict['PASSWORD']}"
    user = settings_dict.get("USER") or "postgres"
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="leasing-pgbouncer-"))
    config = workdir / "pgbouncer.ini"
    users = workdir / "users.txt"
    log = workdir / "pgbouncer.log"
    users.write_text(f'"{user}" ""\n')
    config.write_text(
        "\n".join(
            [
                "[databases]",
                f"* = {server}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {users}",
                f"admin_users = {user}",
                "pool_mode = transaction",
                f"default_pool_size = {pool_size}",
                "max_client_conn = 500",
                # Django's psycopg connections send no startup options; keep the server's defaults.
                "ignore_startup_parameters = extra_float_digits,options",
                f"logfile = {log}",
                settings,
                "",
            ]
        )
    )
    run_as = _run_as(host)
    command = [binary, str(config)]
    if run_as is not None:
        os.chmod(workdir, 0o755)
        for path in (config, users):
            os.chmod(path, 0o644)
        log.touch()
        os.chown(log, run_as.pw_uid, run_as.pw_gid)
        os.chown(workdir, run_as.pw_uid, run_as.pw_gid)
        command = [binary, "-u", run_as.pw_name, str(config)]
    with open(workdir / "stderr.log", "wb") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:

        def accepting() -> bool:
            assert proc.poll() is None, f"pgbouncer exited ({proc.returncode}):\n{_tail(log)}{_tail(stderr.name)}"
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0

        wait_until(accepting, 20, what="pgbouncer to listen")
        yield Bouncer(port=port, pool_size=pool_size, user=user, log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _tail(path: Path | str) -> str:
    path = Path(path)
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"
