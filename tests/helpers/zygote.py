"""A fork server for the tests' Python children: ``manage.py`` commands and ``tests.helpers.child``.

A new interpreter spends about 1.2 s of CPU before a worker runs (Django, psycopg, the admin, the
forms and templates it imports): the real-process tests start hundreds, on a machine whose CPU is
the suite's limit. This server imports those libraries once, configures nothing (no settings, no
connection: each child reads its own environment, as a process started with ``exec`` does), and
forks a child per request. The child is a real process, in a session of its own, with the standard
streams the test passed and the environment, working directory and ``sys.argv`` of the command it
runs; it runs ``manage.py`` (or the module) as ``__main__`` and exits as the interpreter would (the
non-daemon threads joined, the ``atexit`` functions run, the exit code of ``SystemExit``).

Protocol, one connection per child over a unix socket: the test sends one JSON line (``argv`` after
the interpreter, ``env``, ``cwd``) with three descriptors (stdin, stdout, stderr; SCM_RIGHTS); the
server answers ``{"pid": N}`` once forked, then ``{"code": C}`` when the child ended (C as
``Popen.returncode``: minus the signal's number when a signal ended it), and closes.
:class:`ForkedProcess` is the test's side: a ``subprocess.Popen`` in every way the tests use one.

On by default (:func:`enabled`): :func:`tests.helpers.start_manage`, ``start_child``,
:func:`popen_python` and :func:`run_python` fork; ``LEASING_TEST_FORK_SERVER=0`` makes them exec a new
interpreter (as on a platform without ``os.pidfd_open``).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib
import io
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any

#: What a worker or a child imports before its first line of work, importable before settings are
#: configured (a module that reads settings as it loads is not among them: the child loads those).
WARM = (
    "asyncio",
    "concurrent.futures",
    "decimal",
    "uuid",
    "json",
    "logging.config",
    "psycopg",
    "psycopg_pool",
    "django.db.models",
    "django.db.backends.postgresql.base",
    "django.http",
    "django.urls",
    "django.forms",
    "django.template",
    "django.template.defaulttags",
    "django.template.defaultfilters",
    "django.core.serializers.json",
    "django.core.management",
    "django.core.management.base",
    "django.contrib.admin.options",
    "django.views.generic",
    "prometheus_client",
)


def serve(path: str) -> None:
    """Listen on ``path`` until stdin (a pipe from the test process) closes."""
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)  # a module that reads settings as it loads fails to warm
    for name in WARM:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    from django.conf import settings

    assert not settings.configured, "the fork server configured settings: its children would share them"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "parent")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if key.data == "parent":
                if not os.read(sys.stdin.fileno(), 4096):
                    return  # the test process is gone: its children live on, reaped by init
            elif key.data == "accept":
                conn, _ = listener.accept()
                pid = fork_one(conn, listener, selector, children)
                if pid is None:
                    conn.close()
                    continue
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, conn)
                selector.register(pidfd, selectors.EVENT_READ, "child")
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:
                pidfd = key.fd
                pid, conn = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                conn.close()


def fork_one(
    conn: socket.socket,
    listener: socket.socket,
    selector: selectors.BaseSelector,
    children: dict[int, tuple[int, socket.socket]],
) -> int | None:
    """Read one request from ``conn`` and fork its child; the child's pid (None: a broken request)."""
    data = b""
    fds: list[int] = []
    while not data.endswith(b"\n"):
        chunk, more, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
        if not chunk:
            for fd in fds + more:
                os.close(fd)
            return None
        data += chunk
        fds += more
    request = json.loads(data)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    # The child: none of the server's descriptors, closed through their objects (a descriptor
    # closed by number could be one the command opened by the time a stale object closed it again).
    code = 1
    try:
        selector.close()
        listener.close()
        for pidfd, (_pid, other) in children.items():
            os.close(pidfd)
            other.close()
        conn.close()
        code = run_child(request, fds)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def run_child(request: dict[str, Any], fds: list[int]) -> int:
    """Become the command ``request`` names, with ``fds`` as stdin, stdout and stderr; its exit code."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    argv: list[str] = request["argv"]
    sys.path[0] = request["cwd"]
    # Unbuffered, as PYTHONUNBUFFERED (set by child_env) makes a new interpreter's streams.
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True, errors="backslashreplace"
    )
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
    code: int = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")  # not the server's own __main__, which runs this
            main.__dict__["__builtins__"] = builtins
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_code(exit_.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does on its way out: join the threads that are not daemons, run atexit.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def exit_code(code: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into an exit status."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class ForkServer:
    """The test process's fork server, started at its first use, ended with the test process."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="leasing-fork-")
        self.path = os.path.join(self.directory, "socket")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.zygote", self.path],
            cwd=Path(__file__).resolve().parents[2],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == b"ready\n", f"the fork server did not start: {line!r}"
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.directory)

    def spawn(self, argv: list[str], *, cwd: Path, env: dict[str, str], streams: tuple[int, int, int]) -> ForkedProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode() + b"\n"
        socket.send_fds(conn, [request], list(streams))
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = conn.recv(1)  # a byte at a time: the exit code may follow on the same connection
            if not chunk:
                conn.close()
                raise RuntimeError(f"the fork server did not fork {argv}")
            answer += chunk
        return ForkedProcess([sys.executable, *argv], json.loads(answer)["pid"], conn)


def popen_python(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    stdin: Any = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    fork: bool | None = None,
) -> subprocess.Popen[Any]:
    """``subprocess.Popen([sys.executable, *argv], start_new_session=True, ...)`` for ``manage.py …``,
    ``-m module …`` or ``-c script …``, forked from the fork server when it is enabled. Each stream is
    None (the test process's own), ``subprocess.PIPE``, ``subprocess.DEVNULL``, ``subprocess.STDOUT``
    (stderr only) or a file object. ``fork``: forked or exec'd whatever :func:`enabled` says."""
    if not (enabled() if fork is None else fork):
        return started(
            subprocess.Popen(
                [sys.executable, *argv],
                cwd=cwd,
                env=env,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                text=text,
                start_new_session=True,
            )
        )
    child_ends: list[int] = []
    opened: list[int] = []  # descriptors this function opened for the child: closed once it has them
    ours: list[Any] = [None, None, None]  # the test's ends of the pipes
    for index, how in enumerate((stdin, stdout, stderr)):
        if how is None:
            child_ends.append(index)
        elif how == subprocess.PIPE:
            read, write = os.pipe()
            child, mine = (read, write) if index == 0 else (write, read)
            child_ends.append(child)
            opened.append(child)
            if index == 0:
                ours[0] = io.TextIOWrapper(open(mine, "wb"), write_through=True) if text else open(mine, "wb")  # noqa: SIM115
            else:
                ours[index] = open(mine, "r" if text else "rb")  # noqa: SIM115
        elif how == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            child_ends.append(fd)
            opened.append(fd)
        elif how == subprocess.STDOUT:
            assert index == 2, "STDOUT is for stderr"
            child_ends.append(child_ends[1])
        else:
            child_ends.append(how.fileno())
    try:
        proc = server().spawn(argv, cwd=cwd, env=env, streams=(child_ends[0], child_ends[1], child_ends[2]))
    finally:
        for fd in opened:
            os.close(fd)
    proc.attach(ours[0], ours[1], ours[2], text=text)
    return started(proc)


#: Every child :func:`popen_python` started in this process, in order (tests/conftest.py ends, after each
#: test, those of its own still running: a test that failed before its ``finally`` left a worker
#: claiming the next tests' tasks, and one of them waited for a task that worker had taken).
_started: list[subprocess.Popen[Any]] = []


def started(proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    _started.append(proc)
    return proc


def mark() -> int:
    """A place in the list of started children: :func:`end_started_since` takes it."""
    return len(_started)


def end_started_since(place: int) -> list[str]:
    """Kill (SIGKILL to its session, after a SIGCONT) each child started since ``place`` that is still
    running, wait for it, and forget them all; the command lines of those that were running."""
    left = []
    for proc in _started[place:]:
        with contextlib.suppress(RuntimeError):  # the fork server lost it: nothing to end
            if proc.poll() is not None:
                continue
        if proc.returncode is not None:
            continue
        left.append(str(proc.args))
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # its own session: the worker's children go with it
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            proc.wait(30)
    del _started[place:]
    return left


def run_python(
    argv: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float | None = None,
    check: bool = False,
    fork: bool | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)`` through
    :func:`popen_python`; the child is killed when ``timeout`` passes, as ``run`` kills it."""
    proc = popen_python(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, fork=fork)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        raise
    done = subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


_server: ForkServer | None = None
_server_pid: int | None = None


def server() -> ForkServer:
    """This process's fork server (a new one in a process forked from one that had it)."""
    global _server, _server_pid
    if _server is None or _server_pid != os.getpid():
        _server, _server_pid = ForkServer(), os.getpid()
    return _server


def enabled() -> bool:
    """Whether the tests' children are forked: unless ``LEASING_TEST_FORK_SERVER=0``, where the
    platform has ``os.pidfd_open`` (Linux 5.3+). The two failures its faster starts first brought
    out were a real fair-queue bug and a pooler test waiting on the wrong thing, both fixed; a clean-
    clone ``.ci/run`` with it on passed its Django 5.2 leg in 24 min 25 s (27 min 16 s without)."""
    return os.environ.get("LEASING_TEST_FORK_SERVER", "1") != "0" and hasattr(os, "pidfd_open")


class ForkedProcess(subprocess.Popen):
    """A child of the fork server, seen from the test process as the ``Popen`` it would have had: its
    pid (signals go to it directly), ``poll``, ``wait`` and ``communicate`` (its exit code comes from
    the server, its parent), and the test's ends of its pipes, if any."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket) -> None:
        # Not Popen.__init__: the process exists already. The attributes Popen's methods and
        # __del__ read are set here; the methods that reach the child are overridden below.
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None
        self.text_mode = False
        self._child_created = False  # Popen.__del__: no child of this process to reap
        self._conn = conn
        self._buffer = b""

    def attach(self, stdin: Any, stdout: Any, stderr: Any, *, text: bool) -> None:
        self.stdin, self.stdout, self.stderr, self.text_mode = stdin, stdout, stderr, text

    def _read_code(self, timeout: float | None) -> None:
        """Take the exit code from the server if it came within ``timeout`` seconds (None: wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if not self._buffer.endswith(b"\n"):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([self._conn], [], [], left)
                if not ready:
                    return
                chunk = self._conn.recv(4096)
                if not chunk:
                    self._conn.close()
                    raise RuntimeError(f"the fork server lost child {self.pid}")
                self._buffer += chunk
                continue
            self.returncode = int(json.loads(self._buffer)["code"])
            self._conn.close()

    def poll(self) -> int | None:
        self._read_code(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read_code(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Popen's: write ``input``, read stdout and stderr to their ends, wait; TimeoutExpired
        after ``timeout`` (what was read is kept for the next call, as Popen keeps it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None and not self.stdin.closed:
            if input:
                with contextlib.suppress(BrokenPipeError):
                    self.stdin.write(input)
            with contextlib.suppress(BrokenPipeError):
                self.stdin.close()
        if not hasattr(self, "_read_so_far"):
            self._read_so_far: dict[int, list[bytes]] = {}
        pipes = {
            stream.fileno(): stream for stream in (self.stdout, self.stderr) if stream is not None and not stream.closed
        }
        with selectors.DefaultSelector() as selector:
            for fd in pipes:
                self._read_so_far.setdefault(fd, [])
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        self._read_so_far[key.fd].append(chunk)
                    else:
                        selector.unregister(key.fd)
        outputs: list[Any] = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                outputs.append(None)
                continue
            if stream.closed:
                outputs.append(None)
                continue
            data = b"".join(self._read_so_far.get(stream.fileno(), []))
            stream.close()
            outputs.append(data.decode() if self.text_mode else data)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        return outputs[0], outputs[1]

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.close()
        self.wait()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()  # a child never waited for: its exit code is not wanted


if __name__ == "__main__":
    serve(sys.argv[1])
