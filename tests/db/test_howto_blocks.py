"""The blocks of docs/howto that no other test runs, run here as written (tests/helpers/doc_blocks.py).

Only the names a block leaves to the reader are defined (the modules its task paths name, the data it
loops over); everything else is the block's own text, run against the test database:

- Python blocks are executed; a settings block is then applied and the project's system checks must
  accept it (and its values must reach what reads them);
- every ``python manage.py`` line of a shell block is parsed by the real command's parser, and those
  that end by themselves are run against the test database;
- the ``curl`` blocks of api-clients.md and operations.md run in bash against a live server, each
  request answered without a server error.

Pages read here: leases.md, tasks.md, workflows.md, django-tasks.md, celery.md, pausing-and-keys.md,
periodic-tasks.md, pgbouncer.md, recovery-and-retention.md, retries.md, monitoring.md, workers.md,
operations.md, api-clients.md, several-databases.md.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shlex
import subprocess
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.core import checks
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError
from django.db import connection, models
from django.test.utils import isolate_apps

from leasing.models import Lease
from tasks.compat import task as django_task
from tasks.models import Task
from tests.helpers import ROOT
from tests.helpers.doc_blocks import Block, block_of, blocks

pytestmark = pytest.mark.django_db(transaction=True)


def run(block: Block, **names: Any) -> dict[str, Any]:
    """Execute ``block`` with ``names`` defined beforehand; its namespace afterwards."""
    namespace: dict[str, Any] = {"__name__": "howto_block", **names}
    exec(compile(block.text, block.where, "exec"), namespace)
    return namespace


@contextmanager
def modules(**contents: dict[str, Any]) -> Iterator[dict[str, types.ModuleType]]:
    """Modules named by a block's task paths (``reports.jobs``), holding ``contents``, for its duration."""
    made: dict[str, types.ModuleType] = {}
    for dotted, attributes in contents.items():
        dotted = dotted.replace("__", ".")
        parts = dotted.split(".")
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            if name not in sys.modules:
                made[name] = sys.modules[name] = types.ModuleType(name)
        module = sys.modules[dotted]
        for attribute, value in attributes.items():
            if callable(value) and hasattr(value, "__module__") and not isinstance(value, type):
                try:
                    value.__module__ = dotted
                    value.__qualname__ = attribute
                except (AttributeError, TypeError):
                    pass
            setattr(module, attribute, value)
    try:
        yield made
    finally:
        for name in made:
            sys.modules.pop(name, None)


def check_errors() -> list[str]:
    """The project's own system-check messages (warnings and worse) under the current settings."""
    return [
        f"{m.id}: {m.msg}"
        for m in checks.run_checks()
        if m.level >= checks.WARNING and (m.id or "").startswith(("tasks.", "leasing."))
    ]


# --- leases.md --------------------------------------------------------------------------------------


def test_leases_the_context_manager() -> None:
    done: list[tuple[int, int]] = []
    run(
        block_of("docs/howto/leases.md", "from leasing import lease, LeaseAcquisitionError"),
        chunks=[1, 2, 3],
        process=lambda chunk, fence: done.append((chunk, fence)),
    )
    assert [chunk for chunk, _ in done] == [1, 2, 3]
    assert len({fence for _, fence in done}) == 1  # one fencing token for the whole run
    assert Lease.objects.filter(resource="reports:daily").released().count() == 1


def test_leases_the_manager_statements() -> None:
    namespace = run(block_of("docs/howto/leases.md", "from leasing.models import Lease"))
    assert namespace["grant"].token > 0
    row = Lease.objects.get(resource="jobs:sync")
    assert row.released_at is not None  # released, then revoked: ended either way
    assert not Lease.objects.is_current("jobs:sync", namespace["grant"].token)


def test_leases_fenced_writes() -> None:
    from leasing import lease

    block = block_of("docs/howto/leases.md", "from leasing.fencing import FencedModel, fenced_update")
    definition, _, use = block.text.partition("\nwith lease(")
    with isolate_apps("tests.testapp"):
        namespace = run(
            Block(block.page, block.line, block.lang, definition, block.markers),
            models=models,
            __name__="tests.testapp.models",
        )
        report = namespace["Report"]
        with connection.schema_editor() as editor:
            editor.create_model(report)
        try:
            day = dt.date(2026, 11, 25)
            report.objects.create(day=day, body="")
            run(
                Block(block.page, block.line, block.lang, "with lease(" + use, block.markers),
                **namespace,
                lease=lease,
                day=day,
                render=lambda day: f"report of {day}",
            )
            written = report.objects.get(day=day)
            assert written.body == "report of 2026-11-25"
            assert written.fence_token > 0
            # A stale token is refused, as the block's comment says.
            with pytest.raises(namespace["StaleTokenError"]):
                namespace["fenced_update"](report.objects.filter(day=day), written.fence_token - 1, body="late")
        finally:
            with connection.schema_editor() as editor:
                editor.delete_model(report)


def test_leases_leader_election() -> None:
    terms: list[int] = []
    namespace: dict[str, Any] = {"__name__": "howto_block"}

    def run_due_jobs(fence: int) -> None:
        terms.append(fence)
        if len(terms) == 2:
            namespace["election"].stop()  # the block's own election: its run() returns once stopped

    namespace["run_due_jobs"] = run_due_jobs
    block = block_of("docs/howto/leases.md", "from leasing.election import LeaderElection")
    exec(compile(block.text, block.where, "exec"), namespace)
    assert len(terms) == 2 and terms[0] == terms[1] > 0  # led one term, with its token, then stepped down
    assert Lease.objects.filter(resource="scheduler").active().count() == 0


def test_leases_counting_semaphore() -> None:
    slots: list[int] = []
    from leasing import lease  # imported by the page's first block

    run(
        block_of("docs/howto/leases.md", 'with lease("pdf-renderer", limit=3'),
        lease=lease,
        render=lambda fence: slots.append(fence),
    )
    assert len(slots) == 1
    assert {row.resource for row in Lease.objects.slots("pdf-renderer")} <= {
        "pdf-renderer#0",
        "pdf-renderer#1",
        "pdf-renderer#2",
    }


# --- tasks.md, workflows.md -------------------------------------------------------------------------


def test_tasks_enqueue_and_checkpointed_handler_run_on_the_test_connection() -> None:
    from tasks.testing import run_until_empty

    written: list[tuple[str, int]] = []
    days = ["2026-11-01", "2026-11-02"]

    def send_invoice(invoice_id: int) -> None:
        pass

    handler = run(
        block_of("docs/howto/tasks.md", "from tasks.runtime import current_task"),
        pages=lambda day: 3,
        write_page=lambda day, page, fence: written.append((day, page)),
    )["render"]
    with modules(billing__jobs={"send_invoice": send_invoice}, reports__jobs={"render": handler}):
        run(block_of("docs/howto/tasks.md", "from tasks.models import Task"), days=days)
        invoice = Task.objects.get(task_path="billing.jobs.send_invoice")
        assert (invoice.queue, invoice.priority, invoice.max_attempts) == ("mail", 10, 5)
        assert Task.objects.filter(task_path="reports.jobs.render").count() == 2
        drained = run_until_empty(["default"])
    assert drained.attempts == 2
    assert sorted(written) == [(day, page) for day in days for page in range(3)]
    rendered = Task.objects.filter(task_path="reports.jobs.render")
    assert {t.status for t in rendered} == {"SUCCESSFUL"}
    assert {str(t.progress) for t in rendered} == {"{'page': 3}"}


def test_workflows_the_three_shapes_enqueue_and_run() -> None:
    from tasks.testing import run_until_empty

    calls: list[str] = []

    def fetch(url: str) -> str:
        calls.append("fetch")
        return f"<html>{url}</html>"

    def parse(page: str) -> int:
        calls.append("parse")
        return len(page)

    def store(size: int) -> int:
        calls.append("store")
        return size

    def resize(image_id: int) -> int:
        calls.append("resize")
        return image_id

    def load(kind: str) -> str:
        calls.append(f"load {kind}")
        return kind

    def merge(loaded: list[str]) -> str:
        calls.append(f"merge {loaded}")
        return "+".join(loaded)

    with modules(docs_flow__steps={}, reports__jobs={"load": load, "merge": merge}) as made:
        steps = made["docs_flow.steps"]
        notify = run(
            block_of("docs/howto/workflows.md", "def notify(album):"),
            parent_results=__import__("tasks.workflows").workflows.parent_results,
        )["notify"]
        as_tasks = {
            name: task_in(steps, name, fn)
            for name, fn in [
                ("fetch", fetch),
                ("parse", parse),
                ("store", store),
                ("resize", resize),
                ("notify", notify),
            ]
        }
        namespace = run(
            block_of("docs/howto/workflows.md", "from tasks.workflows import Workflow, chain"),
            **as_tasks,
            url="https://example.com",
            ids=[1, 2, 3],
        )
        done = namespace["done"]
        assert len(done.task_ids) == 3
        run_until_empty(with_scheduled=True)
    assert calls.count("resize") == 3
    assert calls[calls.index("fetch") :].index("store") > calls[calls.index("fetch") :].index("parse")
    assert "merge ['sales', 'costs']" in calls
    assert set(Task.objects.values_list("status", flat=True)) == {"SUCCESSFUL"}


# --- settings blocks --------------------------------------------------------------------------------


def test_django_tasks_backend_settings_and_task(settings: Any) -> None:
    block = block_of("docs/howto/django-tasks.md", 'TASKS = {"default": {"BACKEND": "tasks.backends.LeaseBackend",')
    configuration, _, use = block.text.partition("from django.tasks import task")
    settings.TASKS = run(Block(block.page, block.line, block.lang, configuration, block.markers))["TASKS"]
    assert check_errors() == []

    def send_invoice(invoice_id: int) -> None: ...

    with modules(docs_billing__tasks={}) as made:
        namespace = run(
            Block(
                block.page,
                block.line,
                block.lang,
                use.replace("@task(priority=10)\ndef send_invoice(invoice_id): ...\n", ""),
                block.markers,
            ),
            send_invoice=task_in(made["docs_billing.tasks"], "send_invoice", send_invoice, priority=10),
            tomorrow=dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1),
        )
    assert "@task(priority=10)\ndef send_invoice(invoice_id): ...\n" in use  # the part defined above, as written
    result = namespace["result"]
    row = Task.objects.get(pk=int(result.id))
    assert (row.priority, row.max_attempts, row.status) == (10, 3, "READY")
    assert row.run_after is not None and row.run_after > dt.datetime.now(dt.timezone.utc)


def _in(module: types.ModuleType, name: str, function: Any) -> Any:
    function.__module__, function.__qualname__ = module.__name__, name
    setattr(module, name, function)
    return function


def task_in(module: types.ModuleType, name: str, function: Any, **options: Any) -> Any:
    """``function`` as a django.tasks Task defined at the top of ``module`` (as a reader's would be)."""
    _in(module, name, function)
    task = django_task(**options)(function) if options else django_task(function)
    setattr(module, name, task)
    return task


def test_celery_beat_schedule_names_real_tasks() -> None:
    schedule = run(block_of("docs/howto/celery.md", "CELERY_BEAT_SCHEDULE = {"))["CELERY_BEAT_SCHEDULE"]
    from celery import current_app

    import tasks.celery  # noqa: F401 - registers the shared tasks the schedule names

    current_app.loader.import_default_modules()
    names = {entry["task"] for entry in schedule.values()}
    assert names <= set(current_app.tasks), names - set(current_app.tasks)


def test_pausing_and_keys_blocks(settings: Any) -> None:
    batch = [{"customer": 7, "n": n} for n in range(3)]
    run(block_of("docs/howto/pausing-and-keys.md", "# At most 2 invoice tasks"), Task=Task, batch=batch)
    keyed = Task.objects.filter(concurrency_key="invoice:7")
    assert keyed.count() == 4 and {t.concurrency_limit for t in keyed} == {2}

    windows = block_of(
        "docs/howto/pausing-and-keys.md",
        'TASKS = {"default": {"BACKEND": "tasks.backends.LeaseBackend",\n                     "OPTIONS": {"unique"',
    )
    settings.TASKS = run(windows)["TASKS"]
    assert check_errors() == []

    fair = block_of("docs/howto/pausing-and-keys.md", '# settings.py\nLEASING_TASKS = {"FAIR_QUEUES"')
    configuration, _, use = fair.text.partition("# each task names its key (tenant) at enqueue\n")
    settings.LEASING_TASKS = run(Block(fair.page, fair.line, fair.lang, configuration, fair.markers))["LEASING_TASKS"]
    assert check_errors() == []
    run(
        Block(fair.page, fair.line, fair.lang, use, fair.markers),
        Task=Task,
        to="ada@example.com",
        tenant_id=3,
        batch=batch,
    )
    assert set(Task.objects.filter(queue="emails").values_list("fair_key", flat=True)) == {"tenant:3"}
    assert Task.objects.filter(queue="emails").count() == 4


def test_periodic_tasks_settings_are_valid(settings: Any) -> None:
    from tasks.maintenance.schedule_specs import load_schedules

    def sync_invoices() -> None: ...

    def render(kind: str) -> None: ...

    def ping() -> None: ...

    with modules(billing__tasks={}, reports__jobs={}, ops__jobs={}) as made:
        task_in(made["billing.tasks"], "sync_invoices", sync_invoices)
        task_in(made["reports.jobs"], "render", render)
        task_in(made["ops.jobs"], "ping", ping)
        settings.LEASING_TASKS = run(
            block_of("docs/howto/periodic-tasks.md", "from billing.tasks import sync_invoices")
        )["LEASING_TASKS"]
        assert check_errors() == []
        specs = load_schedules()
    assert set(specs) >= {"nightly-report", "sync-invoices", "heartbeat"}
    assert specs["nightly-report"].cron == "30 2 * * *" and specs["sync-invoices"].interval == 300


def test_pgbouncer_settings_block(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgres://app@pgbouncer.example.com:6432/app")
    monkeypatch.setenv("DIRECT_DATABASE_URL", "postgres://app@db.example.com:5432/app")
    namespace = run(block_of("docs/howto/pgbouncer.md", "# settings.py: DATABASE_URL names PgBouncer"))
    database = namespace["DATABASES"]["default"]
    assert (database["HOST"], database["PORT"], database["DISABLE_SERVER_SIDE_CURSORS"]) == (
        "pgbouncer.example.com",
        6432,
        True,
    )
    settings.LEASING_TASKS = namespace["LEASING_TASKS"]
    # Its DATABASES option, on the test database's own entry (whose server is not PgBouncer).
    monkeypatch.setitem(settings.DATABASES["default"], "DISABLE_SERVER_SIDE_CURSORS", True)
    assert check_errors() == []


def test_retention_and_retry_settings(settings: Any) -> None:
    from tasks.maintenance.retention import retention_policy

    settings.LEASING_TASKS = run(block_of("docs/howto/recovery-and-retention.md", 'LEASING_TASKS = {"RETENTION"'))[
        "LEASING_TASKS"
    ]
    assert check_errors() == []
    policy = retention_policy()
    assert policy is not None and policy["FAILED"] == dt.timedelta(days=30)

    def sync_account(account: int) -> None: ...

    class RateLimited(Exception):
        pass

    def linear(attempt: int) -> float:
        return float(attempt)

    def slow(attempt: int) -> float:
        return 60.0 * attempt

    with modules(
        crm__tasks={"sync_account": sync_account},
        crm__errors={"RateLimited": RateLimited},
        crm__backoff={"linear": linear},
        mail__backoff={"slow": slow},
    ):
        run(block_of("docs/howto/retries.md", 'Task.objects.enqueue("crm.tasks.sync_account"'), Task=Task)
        assert Task.objects.get(task_path="crm.tasks.sync_account").max_attempts == 3
        settings.TASKS = run(
            block_of(
                "docs/howto/retries.md",
                'TASKS = {"default": {"BACKEND": "tasks.backends.LeaseBackend",\n' + 21 * " " + '"OPTIONS": {"retry"',
            )
        )["TASKS"]
        settings.LEASING_TASKS = run(block_of("docs/howto/retries.md", 'LEASING_TASKS = {"RETRY_POLICIES"'))[
            "LEASING_TASKS"
        ]
        assert check_errors() == []


# --- monitoring.md's SQL ----------------------------------------------------------------------------


def test_monitoring_sql_runs() -> None:
    for starting in ("SELECT pid, usename, application_name", "ALTER TABLE tasks_task SET"):
        block = block_of("docs/howto/monitoring.md", starting)
        with connection.cursor() as cursor:
            cursor.execute(block.text)
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'tasks_task'")
        (options,) = cursor.fetchone()
        cursor.execute("ALTER TABLE tasks_task RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_cost_delay)")
    assert "autovacuum_vacuum_scale_factor=0.01" in options


# --- manage.py lines of every shell block -----------------------------------------------------------

#: Commands that serve until stopped: their lines are parsed, not run.
SERVES = {"run_worker", "recover_tasks", "runserver", "demo", "createsuperuser"}
#: Lines run against the test database when they do not serve; their pages are listed above.
SHELL_PAGES = [
    "docs/howto/operations.md",
    "docs/howto/pausing-and-keys.md",
    "docs/howto/recovery-and-retention.md",
    "docs/howto/workers.md",
    "docs/howto/django-tasks.md",
]


def manage_lines() -> list[tuple[Block, list[str]]]:
    found = []
    for page in SHELL_PAGES:
        for block in blocks(ROOT / page):
            if block.lang not in ("sh", "bash"):
                continue
            for line in block.text.splitlines():
                if not line.startswith("python manage.py "):
                    continue
                words = shlex.split(line, comments=True)
                if words[:2] == ["python", "manage.py"]:
                    found.append((block, words[2:]))
    return found


def test_every_manage_line_parses_and_the_finite_ones_run() -> None:
    lines = manage_lines()
    assert len(lines) >= 10
    ran = []
    for block, (name, *args) in lines:
        command = load_command_class("tasks" if name != "check" else "django.core", name)
        parser = command.create_parser("manage.py", name)
        try:
            parser.parse_args(args)
        except (SystemExit, CommandError) as exc:  # pragma: no cover - the failure message is the point
            raise AssertionError(f"{block.where}: manage.py {name} {' '.join(args)} does not parse") from exc
        if name in SERVES and "--once" not in args:
            continue
        call_command(name, *args)
        ran.append(name)
    assert {"tasks_queue", "prune_tasks", "tasks_search_index"} <= set(ran)


# --- curl blocks ------------------------------------------------------------------------------------

CURL_PAGES = ["docs/howto/api-clients.md", "docs/howto/operations.md"]


def test_curl_blocks_run_against_a_live_server(live_server: Any, settings: Any) -> None:
    setup = block_of("docs/howto/api-clients.md", "export LEASING_API_TOKENS=s3cret")
    token = re.search(r"LEASING_API_TOKENS=(\S+)", setup.text)
    assert token is not None
    settings.LEASING_API_TOKENS = [token.group(1)]
    curl_blocks = [b for page in CURL_PAGES for b in blocks(ROOT / page) if b.lang == "sh" and "curl " in b.text]
    assert len(curl_blocks) >= 3
    # Each curl of the blocks prints its status on a line of its own; the blocks run as written after
    # the first one's variables, with API pointed at the live server.
    wrapper = 'curl() { command curl --max-time 20 -w "\\nstatus=%{http_code}\\n" "$@"; }\n'
    script = wrapper + setup.text.replace("http://127.0.0.1:8000/api", f"{live_server.url}/api")
    script += "".join(block.text for block in curl_blocks if block != setup)
    result = subprocess.run(
        ["bash", "-e", "-c", script], capture_output=True, text=True, timeout=120, env=os.environ.copy()
    )
    assert result.returncode == 0, result.stdout + result.stderr
    statuses = [int(code) for code in re.findall(r"^status=(\d+)$", result.stdout, re.M)]
    assert len(statuses) == sum(len(re.findall(r"^curl ", b.text, re.M)) for b in curl_blocks)
    assert all(code < 500 for code in statuses), result.stdout
    assert statuses.count(401) == 0 and statuses.count(403) == 0, result.stdout
    assert 200 in statuses and 201 in statuses and 202 in statuses
