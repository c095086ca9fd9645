"""The embedded PostgreSQL (leasing.embedded) lets in its own user and root, and no other local user.

Each test starts its own throwaway server. "Another local user" is a real one: a system user made
with ``useradd`` for the test (so these need root, as CI has; as anyone else the stat checks run
and the cross-user ones are skipped, saying why), whose process tries a PostgreSQL start-up on the
server's socket with nothing but the standard library.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from leasing import embedded
from leasing.embedded import EmbeddedServer, discard, ensure_server, temporary_server
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as another local user (useradd, setuid) needs root; CI runs as root"
)

# A PostgreSQL start-up over the unix socket, standard library only (the probe user may not be able
# to read this virtual environment): prints whether the socket accepted the connection and how
# the server answered the start-up (R0 = authenticated, E = refused, with the server's message).
PROBE = r"""
import json, socket, struct, sys
sock = socket.socket(socket.AF_UNIX)
sock.settimeout(10)
try:
    sock.connect(sys.argv[1])
except OSError as exc:
    print(json.dumps({"connected": False, "error": exc.strerror}))
    raise SystemExit
params = b"user\0postgres\0database\0postgres\0\0"
sock.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)
def read(n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data
kind = read(1).decode()
body = read(struct.unpack("!i", read(4))[0] - 4)
if kind == "R":
    reply = "R%d" % struct.unpack("!i", body[:4])
else:
    fields = {f[:1].decode(): f[1:].decode() for f in body.split(b"\0") if f}
    reply = kind
print(json.dumps({"connected": True, "reply": reply, "message": fields.get("M", "") if kind == "E" else ""}))
"""


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A server whose socket lives in its data directory (a short path)."""
    started = temporary_server()
    try:
        yield started
    finally:
        discard(started)


@pytest.fixture
def long_path_server() -> Iterator[EmbeddedServer]:
    """A server whose data directory path is too long for a unix socket: the socket goes under /tmp."""
    base = Path(tempfile.mkdtemp(prefix="leasing-pg-long-"))
    started = ensure_server(base / ("d" * 90) / "pgdata", options=embedded.FAST_OPTIONS)
    try:
        assert started.socket_dir != started.pgdata
        yield started
    finally:
        discard(started)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def other_user() -> Iterator[pwd.struct_passwd]:
    name = f"leasing-probe-{secrets.token_hex(4)}"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def _interpreter_for(user: pwd.struct_passwd) -> str:
    """A Python the other user can run (this virtual environment may sit under root's home)."""
    candidates = [getattr(sys, "_base_executable", sys.executable), "/usr/bin/python3", shutil.which("python3")]
    for candidate in dict.fromkeys(c for c in candidates if c):
        try:
            probe = subprocess.run(
                [candidate, "-I", "-c", "pass"], user=user.pw_uid, group=user.pw_gid, capture_output=True, check=False
            )
        except PermissionError:  # exec refused: a parent directory is closed to that user
            continue
        if probe.returncode == 0:
            return candidate
    raise AssertionError(f"no Python interpreter among {candidates} is executable by {user.pw_name}")


def connect_as(user: pwd.struct_passwd, server: EmbeddedServer) -> dict[str, Any]:
    result = subprocess.run(
        [_interpreter_for(user), "-I", "-c", PROBE, str(server.socket_path)],
        user=user.pw_uid,
        group=user.pw_gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd="/",
    )
    return dict(json.loads(result.stdout))


def connects_as_root(server: EmbeddedServer) -> bool:
    with psycopg.connect(server.conninfo("postgres"), connect_timeout=10) as conn:
        return conn.execute("SELECT current_user = 'postgres'").fetchone() == (True,)


def assert_private(server: EmbeddedServer) -> None:
    owner = embedded.server_user()
    assert owner is not None
    directory = os.lstat(server.socket_dir)
    assert stat.S_ISDIR(directory.st_mode)
    assert stat.S_IMODE(directory.st_mode) == 0o700, oct(directory.st_mode)
    assert (directory.st_uid, directory.st_gid) == (owner.pw_uid, owner.pw_gid)
    socket_file = os.lstat(server.socket_path)
    assert stat.S_ISSOCK(socket_file.st_mode)
    assert stat.S_IMODE(socket_file.st_mode) & 0o077 == 0, oct(socket_file.st_mode)
    hba = (server.pgdata / "pg_hba.conf").read_text()
    rules = [line.split() for line in hba.splitlines() if line.strip() and not line.startswith("#")]
    assert rules == [["local", "all", "all", "peer", f"map={embedded.IDENT_MAP}"]]
    with psycopg.connect(server.conninfo("postgres")) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)  # no TCP listener at all


def test_socket_directory_is_private_to_the_servers_user(
    server: EmbeddedServer, long_path_server: EmbeddedServer
) -> None:
    for chosen in (server, long_path_server):  # socket in the data directory; socket directory under /tmp
        assert_private(chosen)
        assert connects_as_root(chosen)  # the Django process (root in CI) still gets in


def test_parent_directories_are_not_opened_to_everyone() -> None:
    # A private directory (0700, as mkdtemp makes it) above the data directory. Not pytest's
    # tmp_path: a pytest session starting meanwhile chmods its base directory, which would take
    # the service user's ACL entry on it out of effect.
    base = Path(tempfile.mkdtemp(prefix="leasing-pg-private-"))
    started = ensure_server(base / "pgdata", options=embedded.FAST_OPTIONS)
    try:
        assert stat.S_IMODE(base.stat().st_mode) & 0o007 == 0, "others gained access to a parent directory"
        assert connects_as_root(started)
    finally:
        discard(started)


@needs_root
def test_another_local_user_cannot_connect(
    server: EmbeddedServer, long_path_server: EmbeddedServer, other_user: pwd.struct_passwd
) -> None:
    for chosen in (server, long_path_server):
        attempt = connect_as(other_user, chosen)
        assert attempt == {"connected": False, "error": "Permission denied"}, attempt


@needs_root
def test_peer_authentication_still_refuses_when_the_socket_is_opened_up(
    long_path_server: EmbeddedServer, other_user: pwd.struct_passwd
) -> None:
    # Someone loosens the permissions by hand: the socket is reachable, the log-in is still refused.
    server = long_path_server
    server.socket_dir.chmod(0o755)
    server.socket_path.chmod(0o777)
    attempt = connect_as(other_user, server)
    assert attempt["connected"] is True
    assert attempt["reply"] == "E", attempt
    assert "authentication failed" in attempt["message"], attempt
    assert connects_as_root(server)


@needs_root
def test_a_reused_server_is_locked_down_again(long_path_server: EmbeddedServer, other_user: pwd.struct_passwd) -> None:
    # What an older version left behind: a world-writable socket directory under /tmp and trust
    # authentication.
    server = long_path_server
    server.socket_dir.chmod(0o1777)
    server.socket_path.chmod(0o777)
    (server.pgdata / "pg_hba.conf").write_text("local all all trust\n")
    with psycopg.connect(server.conninfo("postgres"), autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")
    opened = connect_as(other_user, server)
    assert (opened["connected"], opened["reply"]) == (True, "R0"), "the set-up did not reproduce the old hole"

    again = ensure_server(server.pgdata)  # a second process of the project starts up and reuses it
    assert again == server
    assert_private(server)
    server.socket_path.chmod(0o777)  # even with the socket file reachable, trust is gone
    server.socket_dir.chmod(0o755)
    refused = connect_as(other_user, server)
    assert refused["reply"] == "E", refused
    assert connects_as_root(server)


@needs_root
def test_a_socket_directory_owned_by_someone_else_is_refused(other_user: pwd.struct_passwd) -> None:
    base = Path(tempfile.mkdtemp(prefix="leasing-pg-long-"))
    pgdata = base / ("d" * 90) / "pgdata"
    planted = EmbeddedServer.at(pgdata).socket_dir
    planted.mkdir(mode=0o777)
    os.chown(planted, other_user.pw_uid, other_user.pw_gid)
    try:
        with pytest.raises(RuntimeError, match="refusing to put the server's socket there"):
            ensure_server(pgdata, options=embedded.FAST_OPTIONS)
        assert planted.stat().st_uid == other_user.pw_uid  # not adopted
        assert EmbeddedServer.at(pgdata).pid is None
    finally:
        EmbeddedServer.at(pgdata).stop("immediate")
        shutil.rmtree(planted, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


# -- manage.py embedded_postgres ----------------------------------------------------------------------


def manage_embedded_postgres(line: str, server: EmbeddedServer) -> str:
    """A ``python manage.py embedded_postgres …`` line of docs/howto/demo.md, run as written in the demo
    project on ``server``'s data directory (LEASING_PGDATA; no DATABASE_URL: the embedded server)."""
    words = shlex.split(line, comments=True)
    assert words[:3] == ["python", "manage.py", "embedded_postgres"], line
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "DJANGO_SETTINGS_MODULE"}}
    env.update(LEASING_PGDATA=str(server.pgdata), SECRET_KEY="embedded-command-test", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, *words[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_manage_py_embedded_postgres_says_whether_it_runs_and_stops_it(server: EmbeddedServer) -> None:
    from tests.helpers.doc_blocks import block_of

    block = block_of("docs/howto/demo.md", "python manage.py embedded_postgres status")
    status, stop = block.text.splitlines()
    pid = server.pid
    assert pid is not None
    assert f"running (pid {pid})" in manage_embedded_postgres(status, server)
    assert "stopped" in manage_embedded_postgres(stop, server)
    assert server.pid is None and (server.pgdata / "PG_VERSION").exists()  # stopped, its data kept
    # Asking does not start it again (the settings of any other command would).
    assert "stopped" in manage_embedded_postgres(status, server)
    assert server.pid is None
    assert "not running" in manage_embedded_postgres(stop, server)
    # The next command of the project starts it again, on the same data.
    assert ensure_server(server.pgdata).pid is not None
