"""Adapters for bench/compare.py: the same workload on this project and on the peers.

Each system provides: enqueue one by one, enqueue in bulk (its own batch API, or None), count
what is still pending, and run a worker until SIGTERM. Worker processes are started as
``python bench/peers.py <system> <concurrency> [noop|io|sustained]`` and print "ready" once they are
waiting. The ``io`` workload is the I/O-bound case: tasks that each wait one second (``asyncio.sleep(1)``,
or ``time.sleep(1)`` for this project's thread executor), enqueued with ``io_enqueue``. The
``sustained`` workload is bench/sustained.py's: jobs carrying their enqueue time, each reporting its
pickup latency (bench/pickup.py) and working 1 ms, added by a ``sustained_producer``.
Everything runs against the database in DATABASE_URL, with Django settings bench.peer_settings.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])
QUEUE = "bench"
#: This project's claim batch (``--batch-size``); BENCH_BATCH_SIZE sets another, for experiments.
BATCH_SIZE = int(os.environ.get("BENCH_BATCH_SIZE", "64"))


def conninfo() -> str:
    from django.db import connection

    params = connection.get_connection_params()
    parts = [f"{key}={params[key]}" for key in ("host", "port", "user", "password", "dbname") if params.get(key)]
    return " ".join(parts)


def truncate(table: str) -> int:
    """Empty a system's table between runs; TRUNCATE leaves no dead rows to slow the next run."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {table}")
    return 0


def count(sql: str) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql)
        return int(cursor.fetchone()[0])


def any_left(rows: str) -> int:
    """1 while ``rows`` (a table and its WHERE) holds a row, else 0: what a drain polls every 20 ms.
    An existence probe, not a count: counting a 20,000-task backlog took ~5 ms of the server per poll
    (a quarter of a core at that rate), charged to whichever system was draining."""
    return count(f"SELECT count(*) FROM (SELECT 1 FROM {rows} LIMIT 1) AS left_over")


#: ``add(n, at)``: enqueue n jobs whose payload carries ``at`` (bench/sustained.py's producer).
Add = Callable[[int, float], None]


@dataclass
class System:
    name: str
    enqueue_single: Callable[[int], None]
    enqueue_bulk: Callable[[int], None] | None
    pending: Callable[[], int]
    reset: Callable[[], int]
    worker: Callable[[int], None]
    #: The I/O-bound case: enqueue n one-second waits in bulk; run a worker that serves them.
    io_enqueue: Callable[[int], None] | None = None
    io_worker: Callable[[int], None] | None = None
    #: The sustained load: a producer, open for a whole step, whose ``add(n, at)`` enqueues n jobs
    #: carrying ``at`` (their enqueue wall-clock time) in one call of the system's bulk API; a worker
    #: whose handler reports its pickup latency and end (bench/pickup.py) and works 1 ms.
    sustained_producer: Callable[[], AbstractContextManager[Add]] | None = None
    sustained_worker: Callable[[int], None] | None = None


# -- this project ---------------------------------------------------------------------------------


def ours() -> System:
    from tasks.models import Task

    def single(n: int) -> None:
        for i in range(n):
            Task.objects.enqueue("bench.handlers.noop", kwargs={"i": i}, queue=QUEUE)

    def bulk(n: int) -> None:
        Task.objects.bulk_enqueue("bench.handlers.noop", ({"i": i} for i in range(n)), queue=QUEUE)

    def worker(concurrency: int) -> None:
        from tasks.worker.process import Worker

        worker = Worker(queues=[QUEUE], concurrency=concurrency, batch_size=BATCH_SIZE, recovery=False)
        print("ready", flush=True)
        worker.run()

    def io_enqueue(n: int) -> None:
        Task.objects.bulk_enqueue("bench.handlers.sleep_async", ({"seconds": 1.0} for _ in range(n)), queue=QUEUE)

    def io_worker(concurrency: int) -> None:
        from tasks.worker.process import Worker

        # The default 4 executor threads for sync tasks; ``concurrency`` coroutines on the event loop.
        worker = Worker(queues=[QUEUE], async_concurrency=concurrency, batch_size=BATCH_SIZE, recovery=False)
        print("ready", flush=True)
        worker.run()

    sustained_producer, sustained_worker = _ours_sustained("bench.handlers.sustained", coroutines=False)

    return System(
        "django-leasing",
        single,
        bulk,
        lambda: any_left("tasks_task WHERE status IN ('READY', 'RUNNING')"),
        lambda: truncate("tasks_task, tasks_worker"),
        worker,
        io_enqueue,
        io_worker,
        sustained_producer,
        sustained_worker,
    )


def ours_threads() -> System:
    """The I/O-bound case on this project's thread executor: sync ``time.sleep(1)`` handlers, the
    default concurrency (4 threads), the event loop off."""
    from tasks.models import Task

    base = ours()

    def io_enqueue(n: int) -> None:
        Task.objects.bulk_enqueue("bench.handlers.sleep_sync", ({"seconds": 1.0} for _ in range(n)), queue=QUEUE)

    def io_worker(concurrency: int) -> None:
        from tasks.worker.process import Worker

        worker = Worker(queues=[QUEUE], async_concurrency=0, batch_size=BATCH_SIZE, recovery=False)
        print("ready", flush=True)
        worker.run()

    return System(
        "django-leasing (threads)",
        base.enqueue_single,
        base.enqueue_bulk,
        base.pending,
        base.reset,
        base.worker,
        io_enqueue,
        io_worker,
    )


def ours_async() -> System:
    """The sustained load as coroutines: ``async def`` jobs (``await asyncio.sleep(0.001)``, as the async
    peers' jobs are) on the worker's event loop at ``concurrency`` coroutines at once, the executor
    threads and everything else at their defaults (the claim's default included)."""
    producer, worker = _ours_sustained("bench.handlers.sustained_async", coroutines=True)
    return replace(ours(), name="django-leasing-async", sustained_producer=producer, sustained_worker=worker)


def _ours_sustained(
    handler: str, *, coroutines: bool
) -> tuple[Callable[[], AbstractContextManager[Add]], Callable[[int], None]]:
    """bench/sustained.py's producer and worker for this project: ``handler``'s jobs; the worker runs
    ``concurrency`` executor threads, or (``coroutines``) that many coroutines on its event loop."""
    from tasks.models import Task

    @contextmanager
    def sustained_producer() -> Iterator[Add]:
        from django.db import connection

        def add(n: int, at: float) -> None:
            Task.objects.bulk_enqueue(handler, ({"at": at} for _ in range(n)), queue=QUEUE)

        try:
            yield add
        finally:
            connection.close()

    def sustained_worker(concurrency: int) -> None:
        from tasks.worker.process import Worker

        # What ``manage.py run_worker`` runs unless told otherwise (the README's systemd unit): the
        # recovery controller (and, while it leads, every duty of the leader: retention, partitions,
        # bulk operations) and the scheduler in the worker process, at their default intervals; the
        # default claim (4 a thread or a slot of the loop: 64 at 16, tasks/worker/sizing.py).
        if coroutines:
            worker = Worker(queues=[QUEUE], async_concurrency=concurrency)
        else:
            worker = Worker(queues=[QUEUE], concurrency=concurrency)
        print("ready", flush=True)
        worker.run()

    return sustained_producer, sustained_worker


# -- PgQueuer ----------------------------------------------------------------------------------------


def pgqueuer() -> System:
    import psycopg
    from pgqueuer import PsycopgDriver, Queries, QueueManager

    from bench import pickup

    async def connect() -> Any:
        return await psycopg.AsyncConnection.connect(conninfo(), autocommit=True)

    async def _single(n: int) -> None:
        connection = await connect()
        queries = Queries(PsycopgDriver(connection))
        for _ in range(n):
            await queries.enqueue("noop", None)
        await connection.close()

    async def _bulk(n: int) -> None:
        connection = await connect()
        queries = Queries(PsycopgDriver(connection))
        for start in range(0, n, 5000):
            size = min(5000, n - start)
            await queries.enqueue(["noop"] * size, [None] * size, [0] * size)
        await connection.close()

    async def _worker(concurrency: int, cap: int | None = None) -> None:
        from datetime import timedelta

        connection = await connect()
        manager = QueueManager(Queries(PsycopgDriver(connection)))

        @manager.entrypoint("noop")
        async def noop(job: Any) -> None:
            return None

        @manager.entrypoint("sleep", concurrency_limit=concurrency)
        async def sleep(job: Any) -> None:
            await asyncio.sleep(1.0)

        @manager.entrypoint("sustained")
        async def sustained(job: Any) -> None:
            pickup.started(json.loads(job.payload)["at"])
            await asyncio.sleep(0.001)
            pickup.ended()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, manager.shutdown.set)
        print("ready", flush=True)
        # PgQueuer wants its cap at least twice its batch.
        batch = 64 if cap is None else max(1, min(64, cap // 2))
        await manager.run(batch_size=batch, dequeue_timeout=timedelta(seconds=1), max_concurrent_tasks=cap)

    async def _io_bulk(n: int) -> None:
        connection = await connect()
        queries = Queries(PsycopgDriver(connection))
        for start in range(0, n, 5000):
            size = min(5000, n - start)
            await queries.enqueue(["sleep"] * size, [None] * size, [0] * size)
        await connection.close()

    @contextmanager
    def sustained_producer() -> Iterator[Add]:
        loop = asyncio.new_event_loop()  # the producer's thread has none
        connection = loop.run_until_complete(connect())
        queries = Queries(PsycopgDriver(connection))

        def add(n: int, at: float) -> None:
            payload = json.dumps({"at": at}).encode()
            loop.run_until_complete(queries.enqueue(["sustained"] * n, [payload] * n, [0] * n))

        try:
            yield add
        finally:
            loop.run_until_complete(connection.close())
            loop.close()

    def capped_worker(concurrency: int) -> None:
        asyncio.run(_worker(concurrency, cap=concurrency))

    return System(
        "PgQueuer",
        lambda n: asyncio.run(_single(n)),
        lambda n: asyncio.run(_bulk(n)),
        lambda: any_left("pgqueuer"),
        lambda: truncate("pgqueuer, pgqueuer_log"),
        lambda concurrency: asyncio.run(_worker(concurrency)),
        lambda n: asyncio.run(_io_bulk(n)),
        capped_worker,  # serves every entrypoint, ``concurrency`` jobs at once
        sustained_producer,
        capped_worker,
    )


def install_pgqueuer() -> None:
    import psycopg
    from pgqueuer import PsycopgDriver, Queries

    async def install() -> None:
        connection = await psycopg.AsyncConnection.connect(conninfo(), autocommit=True)
        queries = Queries(PsycopgDriver(connection))
        if not await queries.schema_is_installed():
            await queries.install()
        await connection.close()

    asyncio.run(install())


# -- procrastinate -----------------------------------------------------------------------------------


def _procrastinate_app() -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo()))

    @app.task(name="noop", queue=QUEUE)
    async def noop(i: int = 0) -> None:
        return None

    @app.task(name="sleep", queue=QUEUE)
    async def sleep(i: int = 0) -> None:
        await asyncio.sleep(1.0)

    return app


def procrastinate_system() -> System:
    app = _procrastinate_app()
    task = app.tasks["noop"]

    def single(n: int) -> None:
        with app.open():
            for i in range(n):
                task.defer(i=i)

    def bulk(n: int) -> None:
        with app.open():
            for start in range(0, n, 5000):
                task.batch_defer(*({"i": i} for i in range(start, min(n, start + 5000))))

    def worker(concurrency: int) -> None:
        async def run() -> None:
            async with app.open_async():
                print("ready", flush=True)
                await app.run_worker_async(queues=[QUEUE], concurrency=concurrency, wait=True)

        asyncio.run(run())

    def io_enqueue(n: int) -> None:
        sleep = app.tasks["sleep"]
        with app.open():
            for start in range(0, n, 5000):
                sleep.batch_defer(*({"i": i} for i in range(start, min(n, start + 5000))))

    return System(
        "procrastinate",
        single,
        bulk,
        lambda: any_left("procrastinate_jobs WHERE status IN ('todo', 'doing')"),
        lambda: truncate("procrastinate_jobs CASCADE"),
        worker,
        io_enqueue,
        worker,  # the same worker serves both tasks; ``concurrency`` coroutines at once
    )


def install_procrastinate() -> None:
    app = _procrastinate_app()
    exists = count("SELECT count(*) FROM pg_tables WHERE tablename = 'procrastinate_jobs'")
    if not exists:
        with app.open():
            app.schema_manager.apply_schema()


# -- django-tasks-db -----------------------------------------------------------------------------


def django_tasks_db() -> System:
    from bench.peer_tasks import noop

    def single(n: int) -> None:
        for i in range(n):
            noop.enqueue(i)

    def worker(concurrency: int) -> None:
        from django.core.management import call_command

        print("ready", flush=True)
        call_command("db_worker", queue_name=QUEUE, interval=0.05, startup_delay=False, verbosity=0, reload=False)

    return System(
        "django-tasks-db",
        single,
        None,  # no batch enqueue API
        lambda: any_left("django_tasks_database_dbtaskresult WHERE status IN ('READY', 'RUNNING')"),
        lambda: truncate("django_tasks_database_dbtaskresult"),
        worker,
    )


# -- oban (the Python port of Oban) --------------------------------------------------------------


async def _oban_pool() -> Any:
    from psycopg_pool import AsyncConnectionPool

    # Oban.create_pool's defaults (1 to 10 connections), on this run's database.
    pool = AsyncConnectionPool(conninfo(), min_size=1, max_size=10, open=False)
    await pool.open()
    return pool


def oban_system() -> System:
    from oban import Oban

    from bench.peer_tasks import ObanNoop, ObanSleep

    async def _enqueue(worker: Any, n: int, bulk: bool) -> None:
        pool = await _oban_pool()
        client = Oban(pool=pool, name="bench-client")  # no queues: enqueue only
        if bulk:
            # enqueue_many: one transaction per call (the open-source edition inserts row by row in it).
            for start in range(0, n, 5000):
                await client.enqueue_many([worker.new({"i": i}) for i in range(start, min(n, start + 5000))])
        else:
            for i in range(n):
                await client.enqueue(worker.new({"i": i}))
        await pool.close()

    async def _worker(concurrency: int) -> None:
        pool = await _oban_pool()
        oban = Oban(pool=pool, queues={QUEUE: concurrency})
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await oban.start()
        print("ready", flush=True)
        await stop.wait()
        await oban.stop()
        await pool.close()

    def worker(concurrency: int) -> None:
        asyncio.run(_worker(concurrency))

    return System(
        "oban",
        lambda n: asyncio.run(_enqueue(ObanNoop, n, bulk=False)),
        lambda n: asyncio.run(_enqueue(ObanNoop, n, bulk=True)),
        lambda: any_left("oban_jobs WHERE state IN ('available', 'scheduled', 'executing')"),
        lambda: truncate("oban_jobs, oban_producers, oban_leaders"),
        worker,
        lambda n: asyncio.run(_enqueue(ObanSleep, n, bulk=True)),
        worker,  # one queue serves both workers; its limit is ``concurrency`` jobs at once
    )


def install_oban() -> None:
    from oban.schema import install_sql

    if not count("SELECT count(*) FROM pg_tables WHERE tablename = 'oban_jobs'"):
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(install_sql())


# -- graphile-worker (Node) ------------------------------------------------------------------------

GRAPHILE_DIR = Path(__file__).resolve().parent / "graphile"
#: graphile-worker 0.18 wants Node 22.18 or later: bench/graphile/package.json pins Node 22 from the
#: npm registry (the ``node`` package), so the machine's own Node (20 here) is not used.
GRAPHILE_NODE = GRAPHILE_DIR / "node_modules" / ".bin" / "node"


def graphile_url() -> str:
    """This run's database as a postgres:// URL for node-postgres (a socket directory as ?host=)."""
    from urllib.parse import quote

    from bench.common import psycopg_params

    params = psycopg_params()
    auth = quote(params.get("user", "postgres"), safe="")
    if params.get("password"):
        auth += ":" + quote(params["password"], safe="")
    host, port = str(params.get("host", "")), params.get("port")
    if host.startswith("/"):
        query = f"?host={quote(host, safe='')}" + (f"&port={port}" if port else "")
        return f"postgres://{auth}@/{quote(params['dbname'], safe='')}{query}"
    return f"postgres://{auth}@{host or 'localhost'}:{port or 5432}/{quote(params['dbname'], safe='')}"


def graphile_system() -> System:
    """graphile-worker 0.18 (Node), in the same harness: its worker is bench/graphile/worker.mjs;
    jobs are added through its SQL API (``graphile_worker.add_job``, and ``add_jobs`` for a batch:
    what its Node ``addJob`` / ``addJobs`` send), from one psycopg connection in autocommit."""
    import psycopg

    from bench.common import psycopg_params

    add_one = "SELECT graphile_worker.add_job('noop', %s::json)"
    add_many = (
        "SELECT graphile_worker.add_jobs(ARRAY("
        "SELECT j FROM json_populate_recordset(NULL::graphile_worker.job_spec, %s::json) AS j))"
    )

    def single(n: int) -> None:
        with psycopg.connect(**psycopg_params(), autocommit=True) as connection:
            for i in range(n):
                connection.execute(add_one, (json.dumps({"i": i}),))

    def batches(identifier: str, n: int) -> None:
        with psycopg.connect(**psycopg_params(), autocommit=True) as connection:
            for start in range(0, n, 5000):
                specs = [{"identifier": identifier, "payload": {"i": i}} for i in range(start, min(n, start + 5000))]
                connection.execute(add_many, (json.dumps(specs),))

    def worker(concurrency: int) -> None:
        script = str(GRAPHILE_DIR / "worker.mjs")
        os.execv(GRAPHILE_NODE, [str(GRAPHILE_NODE), script, graphile_url(), str(concurrency)])

    @contextmanager
    def sustained_producer() -> Iterator[Add]:
        with psycopg.connect(**psycopg_params(), autocommit=True) as connection:

            def add(n: int, at: float) -> None:
                connection.execute(add_many, (json.dumps([{"identifier": "sustained", "payload": {"at": at}}] * n),))

            yield add

    return System(
        "graphile-worker",
        single,
        lambda n: batches("noop", n),
        lambda: any_left("graphile_worker._private_jobs"),
        lambda: truncate("graphile_worker._private_jobs"),
        worker,
        lambda n: batches("sleep", n),
        worker,  # one worker serves every task; ``concurrency`` jobs at once
        sustained_producer,
        worker,
    )


def install_graphile() -> None:
    """``npm ci`` in bench/graphile (once), then graphile-worker's own migrations (--schema-only)."""
    import subprocess

    if not (GRAPHILE_DIR / "node_modules" / "graphile-worker").is_dir() or not GRAPHILE_NODE.exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--silent"], cwd=GRAPHILE_DIR, check=True)
    cli = GRAPHILE_DIR / "node_modules" / "graphile-worker" / "dist" / "cli.js"
    subprocess.run([str(GRAPHILE_NODE), str(cli), "--schema-only", "-c", graphile_url()], cwd=GRAPHILE_DIR, check=True)


def graphile_version() -> str:
    package = GRAPHILE_DIR / "node_modules" / "graphile-worker" / "package.json"
    return str(json.loads(package.read_text())["version"]) if package.is_file() else "not installed"


# -- awa (awa-pg: a Python SDK over a Rust core) -----------------------------------------------------

#: Max workers per awa worker process for ``awa-50``: QueueConfig's default ``max_workers`` (awa's
#: docs/configuration.md). ``awa`` itself gets the harness's concurrency, as every other system.
AWA_DEFAULT_MAX_WORKERS = 50

#: Is anything of the bench queue left in awa's queue storage? Its own queue_counts (the ``awa.jobs``
#: view, ``queue_stats()``) materialise every retained job: ~0.5 s a call beside 20,000 rows. So:
#: the dispatcher's claim signal (enqueue sequence ahead of claim sequence, per lane: a look-up in
#: two small head tables) first; then, once nothing is left to claim, the attempts still open (a
#: running lease, or a receipt claim with no closure, terminal, retry or DLQ row: the shape of its
#: queue_counts' ``live_running``), and any retry/scheduled row.
AWA_UNCLAIMED = """
SELECT COALESCE(sum(GREATEST(awa.sequence_next_value(qe.seq_name) - awa.sequence_next_value(qc.seq_name), 0)), 0)
FROM awa.queue_enqueue_heads AS qe
JOIN awa.queue_claim_heads AS qc USING (queue, priority, enqueue_shard)
WHERE qe.queue = %(queue)s
"""
AWA_PENDING = f"""
SELECT ({AWA_UNCLAIMED}) > 0
OR EXISTS (SELECT 1 FROM awa.leases WHERE queue = %(queue)s AND state = 'running')
OR EXISTS (SELECT 1 FROM awa.deferred_jobs WHERE queue = %(queue)s)
OR EXISTS (
    SELECT 1 FROM awa.lease_claims AS claims
    WHERE claims.queue = %(queue)s AND claims.closed_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM awa.lease_claim_closures AS closures
                      WHERE closures.claim_slot = claims.claim_slot AND closures.job_id = claims.job_id
                        AND closures.run_lease = claims.run_lease)
      AND NOT EXISTS (SELECT 1 FROM awa.lease_claim_closure_batches AS closure_batches
                      WHERE closure_batches.receipt_ranges @> claims.receipt_id)
      AND NOT EXISTS (SELECT 1 FROM awa.done_entries AS done
                      WHERE done.job_id = claims.job_id AND done.run_lease = claims.run_lease)
      AND NOT EXISTS (SELECT 1 FROM awa.dlq_entries AS dlq
                      WHERE dlq.job_id = claims.job_id AND dlq.run_lease = claims.run_lease)
)
OR EXISTS (
    SELECT 1 FROM awa.lease_claim_batches AS batches
    CROSS JOIN LATERAL unnest(batches.job_ids, batches.run_leases, batches.receipt_ids)
        AS items(job_id, run_lease, receipt_id)
    WHERE batches.queue = %(queue)s
      AND NOT EXISTS (SELECT 1 FROM awa.lease_claim_closures AS closures
                      WHERE closures.claim_slot = batches.claim_slot AND closures.job_id = items.job_id
                        AND closures.run_lease = items.run_lease)
      AND NOT EXISTS (SELECT 1 FROM awa.lease_claim_closure_batches AS closure_batches
                      WHERE closure_batches.claim_slot = batches.claim_slot
                        AND closure_batches.receipt_ranges @> items.receipt_id)
      AND NOT EXISTS (SELECT 1 FROM awa.leases AS lease
                      WHERE lease.job_id = items.job_id AND lease.run_lease = items.run_lease)
      AND NOT EXISTS (SELECT 1 FROM awa.done_entries AS done
                      WHERE done.job_id = items.job_id AND done.run_lease = items.run_lease)
      AND NOT EXISTS (SELECT 1 FROM awa.dlq_entries AS dlq
                      WHERE dlq.job_id = items.job_id AND dlq.run_lease = items.run_lease)
)
"""


def awa_url() -> str:
    """This run's database for awa (sqlx): a postgres:// URL whose socket directory is ?host=; sqlx
    wants a host name in the URL all the same (the query's host overrides it)."""
    url = graphile_url()
    return url.replace("@/", "@localhost/", 1)


def _awa_kinds() -> tuple[type, type, type]:
    """The job kinds (awa derives a kind from its args class: ``awa_noop``, ``awa_sleep``,
    ``awa_sustained``)."""
    from dataclasses import dataclass

    @dataclass
    class AwaNoop:
        i: int = 0

    @dataclass
    class AwaSleep:
        i: int = 0

    @dataclass
    class AwaSustained:
        at: float = 0.0

    return AwaNoop, AwaSleep, AwaSustained


def awa_system(max_workers: int | None = None) -> System:
    """awa through its Python SDK: the synchronous ``awa.Client`` enqueues (``insert`` one by one,
    ``enqueue_many_copy`` in calls of 5,000: its docs' producer path for bulk on queue storage), and a
    worker process is an ``AsyncClient`` with async handlers on one queue (``max_workers`` =
    the harness's concurrency, or ``max_workers`` given), every other setting its default (claim batch
    512, poll 200 ms, completion batch 512 flushed every 1 ms)."""
    import awa

    from bench import pickup

    noop_kind, sleep_kind, sustained_kind = _awa_kinds()

    def single(n: int) -> None:
        client = awa.Client(awa_url())
        for i in range(n):
            client.insert(noop_kind(i=i), queue=QUEUE)
        client.close()

    def batches(kind: type, n: int) -> None:
        client = awa.Client(awa_url())
        for start in range(0, n, 5000):
            client.enqueue_many_copy([kind(i=i) for i in range(start, min(n, start + 5000))], queue=QUEUE)
        client.close()

    async def _worker(concurrency: int) -> None:
        client = awa.AsyncClient(awa_url())

        @client.task(noop_kind, queue=QUEUE)
        async def noop(job: Any) -> None:
            return None

        @client.task(sleep_kind, queue=QUEUE)
        async def sleep(job: Any) -> None:
            await asyncio.sleep(1.0)

        @client.task(sustained_kind, queue=QUEUE)
        async def sustained(job: Any) -> None:
            pickup.started(job.args.at)
            await asyncio.sleep(0.001)
            pickup.ended()

        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await client.start([{"name": QUEUE, "max_workers": max_workers or concurrency}])
        print("ready", flush=True)
        await stop.wait()
        await client.shutdown()
        await client.close()

    probe: list[Any] = []  # the pending probe's own connection, opened at the first poll

    def pending() -> int:
        # A prepared statement: planned every time, over awa's partitioned tables, the probe cost
        # the server ~6 ms a poll (0.4 ms prepared), charged to awa's drain.
        import psycopg

        from bench.common import psycopg_params

        if not probe:
            probe.append(psycopg.connect(**psycopg_params(), autocommit=True))
        row = probe[0].execute(AWA_PENDING, {"queue": QUEUE}, prepare=True).fetchone()
        return int(bool(row[0]))

    def reset() -> int:
        while probe:
            probe.pop().close()
        return reset_awa()

    def worker(concurrency: int) -> None:
        asyncio.run(_worker(concurrency))

    @contextmanager
    def sustained_producer() -> Iterator[Add]:
        client = awa.Client(awa_url())

        def add(n: int, at: float) -> None:
            client.enqueue_many_copy([sustained_kind(at=at) for _ in range(n)], queue=QUEUE)

        try:
            yield add
        finally:
            client.close()

    return System(
        "awa" if max_workers is None else f"awa ({max_workers} workers)",
        single,
        lambda n: batches(noop_kind, n),
        pending,
        reset,
        worker,
        lambda n: batches(sleep_kind, n),
        worker,  # one queue serves every kind; ``concurrency`` handlers at once
        sustained_producer,
        worker,
    )


def reset_awa() -> int:
    """awa's own reset (what its Python benchmark runs between scenarios): drop the queue-storage
    schema, re-run its migrations, install and activate queue storage afresh (~2 to 4 s, untimed)."""
    import awa

    async def reset() -> None:
        client = awa.AsyncClient(awa_url())
        await client.install_queue_storage(reset=True)
        await client.close()

    asyncio.run(reset())
    return 0


def install_awa() -> None:
    """awa's migrations (what ``python -m awa migrate`` runs); a fresh install is on queue storage."""
    import awa

    async def install() -> None:
        client = awa.AsyncClient(awa_url())
        await client.migrate()
        await client.close()

    asyncio.run(install())


def ours_two_queues() -> System:
    """This project's worker serving two queues (its claim takes both in one statement), the tasks
    split evenly between them: for the drain beside an old snapshot (each queue resumes after its
    own positions)."""
    from tasks.models import Task

    base = ours()
    queues = [QUEUE, f"{QUEUE}-2"]

    def bulk(n: int) -> None:
        for index, queue in enumerate(queues):
            share = n // len(queues) + (1 if index < n % len(queues) else 0)
            Task.objects.bulk_enqueue("bench.handlers.noop", ({"i": i} for i in range(share)), queue=queue)

    def worker(concurrency: int) -> None:
        from tasks.worker.process import Worker

        worker = Worker(queues=queues, concurrency=concurrency, batch_size=BATCH_SIZE, recovery=False)
        print("ready", flush=True)
        worker.run()

    return System("django-leasing (2 queues)", base.enqueue_single, bulk, base.pending, base.reset, worker)


SYSTEMS: dict[str, Callable[[], System]] = {
    "django-leasing": ours,
    "django-leasing-threads": ours_threads,
    "django-leasing-async": ours_async,
    "django-leasing-2q": ours_two_queues,
    "PgQueuer": pgqueuer,
    "procrastinate": procrastinate_system,
    "django-tasks-db": django_tasks_db,
    "oban": oban_system,
    "graphile-worker": graphile_system,
    "awa": awa_system,
    "awa-50": lambda: awa_system(AWA_DEFAULT_MAX_WORKERS),
}


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.peer_settings")
    import django

    django.setup()


if __name__ == "__main__":
    setup_django()
    name, concurrency = sys.argv[1], int(sys.argv[2])
    workload = sys.argv[3] if len(sys.argv) > 3 else "noop"
    system = SYSTEMS[name]()
    serve = {"io": system.io_worker, "sustained": system.sustained_worker}.get(workload, system.worker)
    if serve is None:
        raise SystemExit(f"{name} has no {workload} worker")
    serve(concurrency)
