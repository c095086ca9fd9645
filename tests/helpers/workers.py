"""Named ``manage.py run_worker`` processes for the worker-process tests, each logging to a file."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tasks.models import Worker
from tests.helpers import start_manage, wait_until

#: Short lease, recovery and poll intervals: faults show within seconds.
FAST = ("--ttl", "2", "--recovery-interval", "0.2", "--poll-interval", "0.2", "-v", "2")
#: A hang guard, not a deadline: a SIGTERMed worker still running this many seconds later is hung (a
#: test fails instead of hanging). What a stop must not wait for (a handler that never ends, a poll
#: of an hour, a lease's TTL) each test makes far longer; how soon it stops is the machine's load.
STOP_WITHIN = 60.0


@dataclass
class Workers:
    """Starts named worker processes, each logging to ``<logs>/<name>.log``."""

    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ids: dict[str, str] = field(default_factory=dict)  # name -> the id its process holds leases under

    def start(self, name: str, *args: str, may_die: bool = False, **env: str) -> subprocess.Popen[bytes]:
        earlier = list(Worker.objects.filter(name=name).values_list("id", flat=True))
        proc = start_manage(self.logs / f"{name}.log", "run_worker", "--worker-id", name, *FAST, *args, **env)
        self.procs[name] = proc
        mine = Worker.objects.filter(name=name).exclude(id__in=earlier)
        wait_until(lambda: mine.exists() or proc.poll() is not None, 30, what=f"{name} to register")
        self.ids[name] = mine.values_list("id", flat=True).first() or ""
        assert may_die or proc.poll() is None, f"{name} exited ({proc.returncode}) at start:\n{self.log(name)}"
        return proc

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""
