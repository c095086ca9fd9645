"""The tests' fork server (tests/helpers/zygote.py): a child forked from it behaves as the process
``subprocess`` would have started, for everything the real-process tests read: its exit code (also
when a signal ended it), its streams, its environment, working directory and arguments, its own
settings, and an exit as the interpreter's (threads joined, atexit run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, wait_until
from tests.helpers.zygote import popen_python, run_python, server

ENV = {"PATH": os.environ.get("PATH", ""), "PYTHONUNBUFFERED": "1"}


def test_exit_code_streams_environment_cwd_and_arguments(tmp_path: Path) -> None:
    script = (
        "import os, sys\n"
        "print(os.environ['ONLY_HERE'], os.getcwd(), sys.argv[1:])\n"
        "print('oops', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    done = run_python(fork=True, argv=["-c", script, "a", "b c"], cwd=tmp_path, env={**ENV, "ONLY_HERE": "yes"})
    assert done.returncode == 3
    assert done.stdout == f"yes {tmp_path} ['a', 'b c']\n"
    assert done.stderr == "oops\n"
    assert "ONLY_HERE" not in os.environ


def test_a_signal_ends_it_as_popen_reports_and_wait_times_out_while_it_runs() -> None:
    proc = popen_python(fork=True, argv=["-c", "import time\nwhile True: time.sleep(1)"], cwd=ROOT, env=ENV)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    assert proc.poll() is None
    assert os.getpgid(proc.pid) == proc.pid  # a session (and process group) of its own
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL


def test_stdin_pipe_and_a_log_file(tmp_path: Path) -> None:
    proc = popen_python(
        fork=True,
        argv=["-c", "import sys; print(sys.stdin.read().upper())"],
        cwd=ROOT,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate("hello", timeout=60)
    assert (out, err, proc.returncode) == ("HELLO\n", "", 0)
    log = tmp_path / "log"
    with open(log, "ab") as file:
        proc = popen_python(
            fork=True,
            argv=["-c", "import sys; print('out'); print('err', file=sys.stderr)"],
            cwd=ROOT,
            env=ENV,
            stdout=file,
            stderr=subprocess.STDOUT,
        )
    assert proc.wait(60) == 0
    assert sorted(log.read_text().split()) == ["err", "out"]


def test_it_exits_as_the_interpreter_joining_threads_and_running_atexit() -> None:
    script = (
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.1), print('thread'))).start()\n"
        "raise SystemExit('a message')\n"
    )
    done = run_python(fork=True, argv=["-c", script], cwd=ROOT, env=ENV, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (1, "thread\natexit\n", "a message\n")
    raised = run_python(fork=True, argv=["-c", "raise ValueError('boom')"], cwd=ROOT, env=ENV, timeout=60)
    assert raised.returncode == 1
    assert "ValueError: boom" in raised.stderr


def test_each_child_reads_its_own_settings_none_shared_with_the_server() -> None:
    script = (
        "import django; django.setup(); from django.conf import settings; print(settings.DATABASES['default']['NAME'])"
    )
    names = []
    for name in ("first_db", "second_db"):
        env = {**ENV, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": f"postgres://u@localhost/{name}"}
        done = run_python(fork=True, argv=["-c", script], cwd=ROOT, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        names.append(done.stdout.split()[-1])
    assert names == ["first_db", "second_db"]


def test_a_manage_py_command_runs_as_its_main() -> None:
    done = run_python(
        fork=True,
        argv=["manage.py", "help", "run_worker"],
        cwd=ROOT,
        env={**ENV, "DATABASE_URL": "postgres://u@localhost/x"},
    )
    assert done.returncode == 0, done.stderr
    assert "usage: manage.py run_worker" in done.stdout


def test_the_server_ends_with_the_process_that_started_it() -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from tests.helpers import zygote\n"
        "print(zygote.server().proc.pid, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    pid = int(done.stdout.split()[-1])

    def gone() -> bool:  # no such process, or a zombie waiting for whoever adopted it
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    wait_until(gone, 60, what="the fork server of an ended process to end")
    assert server().proc.poll() is None  # this process's own is still serving
