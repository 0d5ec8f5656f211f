"""tether through a real PgBouncer (tests/pgbouncer.py) in transaction pooling mode.

Producers, workers and the dashboard connect to PgBouncer, set up as docs/pgbouncer.md says:
TETHER_POOLER=transaction, and TETHER_LISTEN_URL a direct URL for LISTEN (or none: polling).
Every setting is given through the environment, as a deployment gives it, so this module
also runs against a tether that does not know them: there it shows what breaks (psycopg's
own prepared statements met on another server session, the `options` startup parameter
PgBouncer refuses, a session advisory lock left on a pooled server session).

What is checked is what a user relies on: tasks sent (plain, many, unique, in the caller's
transaction) all stored once; workers claim, run, retry and record them; a killed worker's
task is recovered; handles get results; the dashboard answers; LISTEN works through the
direct URL and, without one, polling works and the worker says so once at start.
"""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

from tests.apps.support import attempt_rows, runs, task_row
from tests.conftest import PgBouncers, WorkerFactory, wait_until
from tests.pgbouncer import PgBouncer
from tether import AppConfig, PostgresConfig, RecoveryConfig, Tether
from tether.broker import PostgresBroker
from tether.db.connection import connect
from tether.db.migrate import MIGRATION_LOCK_KEY, available, migrate
from tether.health import HealthStatus, HealthThresholds, check_health
from tether.web.dashboard import DashboardServer
from tether.worker.work_listener import listener_role

APP = "tests.apps.basic:app"
WAIT = 30.0
# Recovery in seconds: heartbeats every second, stale after two, the reaper every second.
FAST = {
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "2000",
    "TETHER_RUNNING_STALE_THRESHOLD_MS": "2000",
    "TETHER_CHECK_INTERVAL_MS": "1000",
}
POLLING_LINE = "no LISTEN connection (pooler=transaction and no listen_url)"
Conn = psycopg.Connection[Any]


def dbname(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


@pytest.fixture
def pooled_url(pgbouncer: PgBouncer, direct_url: str) -> str:
    """The test database through PgBouncer in transaction mode."""
    return pgbouncer.url(dbname(direct_url))


@pytest.fixture
def through_pgbouncer(
    monkeypatch: pytest.MonkeyPatch, pooled_url: str, direct_url: str
) -> Callable[..., dict[str, str]]:
    """configure(listen=True): this process's environment (which the workers it starts inherit)
    set as docs/pgbouncer.md says, with or without a direct URL for LISTEN; returns it."""

    def configure(
        *, listen: bool = True, pooler: str = "transaction", url: str | None = None
    ) -> dict[str, str]:
        settings = {"TETHER_DATABASE_URL": url or pooled_url, "TETHER_POOLER": pooler}
        for name, value in settings.items():
            monkeypatch.setenv(name, value)
        if listen:
            monkeypatch.setenv("TETHER_LISTEN_URL", direct_url)
            settings["TETHER_LISTEN_URL"] = direct_url
        else:
            monkeypatch.delenv("TETHER_LISTEN_URL", raising=False)
        return settings

    return configure


@pytest.fixture
def producers(basic: ModuleType) -> Iterator[Callable[[], Tether]]:
    """make(): an app with tests/apps/basic.py's tasks, configured from the environment as it
    is then (through_pgbouncer), as a producer process of the deployment would be."""
    made: list[Tether] = []

    def make() -> Tether:
        app = Tether(AppConfig(queues=basic.app.config.queues))
        for name, task in basic.app.tasks.items():
            app.task(
                name,
                queue=task.options.queue,
                priority=task.options.priority,
                retry_policy=task.retry_policy,
                time_limit=task.time_limit,
            )(task.fn)
        made.append(app)
        return app

    yield make
    for app in made:
        app.close()


def statuses(db: Conn) -> Counter[str]:
    return Counter(r["status"] for r in db.execute("SELECT status FROM tether_tasks").fetchall())


def advisory_locks(db: Conn) -> int:
    """Advisory locks held on the test database by any session (a leaked session lock shows here)."""
    row = db.execute(
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchone()
    return int(row["n"])


def listening_sessions(db: Conn) -> list[str]:
    """The application_name of every session on the test database whose last statement was a LISTEN."""
    rows = db.execute(
        "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
        " AND query ILIKE 'LISTEN %%' ORDER BY 1"
    ).fetchall()
    return [r["application_name"] for r in rows]


def in_threads(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """``work(i)`` in ``count`` threads at once; the exceptions they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def run(i: int) -> None:
        try:
            start.wait(WAIT)
            work(i)
        except BaseException as exc:  # reported by the test, whatever it is
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 2)
    assert not any(t.is_alive() for t in threads), "a thread was still running after a minute"
    return errors


def test_the_fixture_is_a_pgbouncer_in_transaction_mode(pgbouncer: PgBouncer, pooled_url: str) -> None:
    with psycopg.connect(pooled_url, autocommit=True, prepare_threshold=None) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    [pool] = [p for p in pgbouncer.show("POOLS") if p["database"] == dbname(pooled_url)]
    assert pool["pool_mode"] == "transaction"
    config = {row["key"]: row["value"] for row in pgbouncer.show("CONFIG")}
    assert (config["pool_mode"], config["default_pool_size"]) == ("transaction", "20")
    assert config["ignore_startup_parameters"] == ""  # nothing a client sends is ignored quietly


def test_producers_send_through_pgbouncer(
    db: Conn, through_pgbouncer: Callable[..., dict[str, str]], producers: Callable[[], Tether]
) -> None:
    """send, send_many, unique sends and sends in the caller's transaction, from 4 threads at once
    on one app's pool: every statement repeated often enough for psycopg to prepare it."""
    through_pgbouncer()
    app = producers()
    record = app.tasks["record"]
    per_thread = 25

    def send_all(i: int) -> None:
        for n in range(per_thread):
            record.send(f"one-{i}-{n}")
        record.send_many([(f"many-{i}-{n}",) for n in range(per_thread)])
        for n in range(per_thread):  # each key twice: the second send creates nothing
            for _ in range(2):
                record.with_options(unique_key=f"key-{i}-{n}").send(f"unique-{i}-{n}")
        # The caller's own connection, through PgBouncer with psycopg's defaults (it prepares
        # what it repeats): tether's statements run unprepared on it, and its own go on.
        with psycopg.connect(app.config.broker.database_url or "", prepare_threshold=None) as mine:
            for n in range(per_thread):
                with mine.transaction():
                    mine.execute("SELECT 1")
                    record.with_options(connection=mine).send(f"caller-{i}-{n}")
            with mine.transaction():  # rolled back: sends nothing
                record.with_options(connection=mine).send(f"rolled-back-{i}")
                raise psycopg.Rollback()

    errors = in_threads(4, send_all)
    assert not errors, errors
    rows = db.execute("SELECT args::text AS args FROM tether_tasks").fetchall()
    kinds = Counter(r["args"].split("-")[0].strip('["') for r in rows)
    assert kinds == {"one": 100, "many": 100, "unique": 100, "caller": 100}
    assert db.execute("SELECT count(*) AS n FROM tether_unique_keys").fetchone()["n"] == 100
    assert statuses(db) == {"PENDING": 400}
    assert advisory_locks(db) == 0


def test_a_lent_connection_that_prepares_keeps_its_setting(
    db: Conn,
    through_pgbouncer: Callable[..., dict[str, str]],
    producers: Callable[[], Tether],
    pooled_url: str,
) -> None:
    """A caller's connection with psycopg's default prepare_threshold: tether's statements on it
    run unprepared (behind a transaction pooler), and the caller's setting is as it was after."""
    through_pgbouncer()
    record = producers().tasks["record"]
    with psycopg.connect(pooled_url) as mine:
        assert mine.prepare_threshold == 5
        for n in range(12):
            record.with_options(connection=mine).send(f"lent-{n}")
            mine.commit()
        assert mine.prepare_threshold == 5
    assert statuses(db) == {"PENDING": 12}


def test_workers_claim_run_retry_and_record_through_pgbouncer(
    db: Conn,
    through_pgbouncer: Callable[..., dict[str, str]],
    producers: Callable[[], Tether],
    workers: WorkerFactory,
) -> None:
    settings = through_pgbouncer()
    app = producers()
    first = workers.start(APP, "--processes", "2", env=settings)
    second = workers.start(APP, "--processes", "2", env=settings)
    handles = [app.tasks["add"].send(i, i) for i in range(60)]
    handles += app.tasks["add"].send_many([(i, 1000) for i in range(60)])
    flaky = app.tasks["flaky"].send("flaky-1", 2)  # fails twice (TRANSIENT), retried, then works
    crashy = app.tasks["always_crashy"].send("crashy-1")  # raises; retried once; FAILED
    results = [h.get(timeout=WAIT) for h in handles]
    assert [r.ok for r in results] == [i + i for i in range(60)] + [i + 1000 for i in range(60)]
    assert flaky.get(timeout=WAIT).ok == 3
    assert [a["outcome"] for a in attempt_rows(db, flaky.id)] == ["FAILED", "FAILED", "COMPLETED"]
    assert crashy.get(timeout=WAIT).err.code == "UNHANDLED_EXCEPTION"
    assert runs(db, "crashy-1") == 2 and task_row(db, crashy.id)["status"] == "FAILED"
    assert statuses(db) == {"COMPLETED": 121, "FAILED": 1}
    done_by = {r["claimed_by_worker_id"] for r in db.execute("SELECT claimed_by_worker_id FROM tether_tasks")}
    assert done_by <= {first.worker_id, second.worker_id}
    # Nothing of either worker's logs a database error, and no session lock was left behind.
    for worker in (first, second):
        log = worker.log()
        assert "prepared statement" not in log and "unsupported startup parameter" not in log, log
        assert "Traceback" not in log, log
    assert advisory_locks(db) == 0
    # The worker LISTENs on the direct URL: its listener is a session of its own there.
    named = {f"tether-{listener_role(w.worker_id or '')}" for w in (first, second)}
    assert named <= set(listening_sessions(db))
    for worker in (first, second):
        assert worker.stop() == 0


@pytest.mark.timing
def test_with_a_listen_url_an_idle_worker_is_woken_at_once(
    db: Conn,
    through_pgbouncer: Callable[..., dict[str, str]],
    producers: Callable[[], Tether],
    workers: WorkerFactory,
) -> None:
    """The poll is a minute away: a task picked up within a second was notified (sent through
    PgBouncer, NOTIFY at its commit, heard on the direct LISTEN connection)."""
    settings = through_pgbouncer() | {"TETHER_WORKER_POLL_INTERVAL_MS": "60000"}
    app = producers()
    workers.start(APP, "--processes", "1", env=settings)
    # A first task warms the child up (its start-up is not what is measured here).
    assert app.tasks["add"].send(0, 0).get(timeout=WAIT).ok == 0
    for n in range(3):
        wait_until(
            lambda: db.execute("SELECT count(*) AS n FROM tether_queue_waiters").fetchone()["n"],
            message="the idle worker to wait for work",
        )
        sent = time.monotonic()
        handle = app.tasks["add"].send(n, 1)
        assert handle.get(timeout=10).ok == n + 1
        assert time.monotonic() - sent < 1.0
    # And the producer's own wait was notified: its result listener LISTENs on the direct URL.
    assert "tether" in listening_sessions(db)


def test_without_a_listen_url_workers_and_handles_poll_and_say_so(
    db: Conn,
    through_pgbouncer: Callable[..., dict[str, str]],
    producers: Callable[[], Tether],
    workers: WorkerFactory,
) -> None:
    settings = through_pgbouncer(listen=False) | {"TETHER_WORKER_POLL_INTERVAL_MS": "200"}
    app = producers()
    worker = workers.start(APP, "--processes", "2", env=settings)
    handles = [app.tasks["add"].send(i, 1) for i in range(20)]
    assert [h.get(timeout=WAIT).ok for h in handles] == [i + 1 for i in range(20)]
    # Idle now (its claims came back empty): it did not ask senders to notify it, since
    # nothing of it listens; and nothing LISTENs anywhere, the producer's waits included.
    late = app.tasks["add"].send(100, 1)
    assert late.get(timeout=WAIT).ok == 101
    assert db.execute("SELECT count(*) AS n FROM tether_queue_waiters").fetchone()["n"] == 0
    assert listening_sessions(db) == []
    log = worker.log()
    assert log.count(POLLING_LINE) == 1, log
    [line] = [line for line in log.splitlines() if POLLING_LINE in line]
    assert "WARNING" in line and "polling every 200 ms" in line and "TETHER_LISTEN_URL" in line
    # `tether health`, configured alike, takes the missing listener for what it is.
    [check] = [
        c
        for c in check_health(app.broker, HealthThresholds()).checks
        if (c.check, c.subject) == ("worker_listener", worker.worker_id)
    ]
    assert check.status == HealthStatus.OK and "as configured" in check.detail
    assert worker.stop() == 0


def test_a_killed_worker_s_tasks_are_recovered_through_pgbouncer(
    db: Conn,
    through_pgbouncer: Callable[..., dict[str, str]],
    producers: Callable[[], Tether],
    workers: WorkerFactory,
) -> None:
    """SIGKILL of a worker's whole process group while its task runs: the survivor's reaper,
    through PgBouncer, fails it with WORKER_CRASHED (no retry policy), and runs the rest."""
    settings = through_pgbouncer() | FAST
    app = producers()
    doomed = workers.start(APP, "--processes", "1", "--queues", "images", env=settings)
    held = app.tasks["sleep"].with_options(queue="images").send(60, "held-1")
    wait_until(lambda: runs(db, "held-1") == 1, message="the task to start in the doomed worker")
    assert task_row(db, held.id)["claimed_by_worker_id"] == doomed.worker_id
    doomed.kill()
    workers.start(APP, "--processes", "1", "--queues", "images", env=settings)
    after = app.tasks["add"].with_options(queue="images").send(2, 3)
    assert held.get(timeout=WAIT).err.code == "WORKER_CRASHED"
    assert after.get(timeout=WAIT).ok == 5
    assert runs(db, "held-1") == 1  # never run again: the policy has no retry
    wait_until(
        lambda: (
            db.execute("SELECT status FROM tether_workers WHERE id = %s", (doomed.worker_id,)).fetchone()[
                "status"
            ]
            != "active"
        ),
        message="the killed worker to be marked inactive",
    )


def test_the_dashboard_answers_through_pgbouncer(
    db: Conn,
    through_pgbouncer: Callable[..., dict[str, str]],
    producers: Callable[[], Tether],
    workers: WorkerFactory,
) -> None:
    """Every page and JSON of the dashboard, asked by 4 clients at once, again and again."""
    settings = through_pgbouncer()
    app = producers()
    workers.start(APP, "--processes", "1", env=settings)
    done = app.tasks["add"].send(1, 2)
    assert done.get(timeout=WAIT).ok == 3
    failed = app.tasks["fail"].send("BOOM")
    assert failed.get(timeout=WAIT).err.code == "BOOM"
    broker = PostgresBroker(PostgresConfig())  # from the environment: through PgBouncer
    server = DashboardServer(("127.0.0.1", 0), broker, RecoveryConfig())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    pages = [
        "",
        "api/status",
        "api/tasks",
        f"api/tasks/{done.id}",
        "api/tasks?status=FAILED",
        "api/workflows",
        "api/queues",
        "api/workers",
    ]
    answers: dict[str, set[int]] = {page: set() for page in pages}

    def read_all(i: int) -> None:
        for _ in range(6):
            for page in pages:
                with urllib.request.urlopen(server.url + page, timeout=WAIT) as response:
                    body = response.read()
                    answers[page].add(response.status)
                    if page == f"api/tasks/{done.id}":
                        assert str(done.id).encode() in body
                    if page == "api/tasks?status=FAILED":
                        assert str(failed.id).encode() in body

    try:
        errors = in_threads(4, read_all)
    finally:
        server.shutdown()
        server.server_close()
        broker.close()
    assert not errors, errors
    assert answers == {page: {200} for page in pages}


def test_migrations_through_pgbouncer_take_turns_and_leave_no_lock(
    pgbouncer: PgBouncer, server_url: str, through_pgbouncer: Callable[..., dict[str, str]]
) -> None:
    """Four starters migrate a new database at once through PgBouncer: each migration applied
    once, and no advisory lock left on any server session (a session lock would be)."""
    name = f"tether_pgb_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        url = pgbouncer.url(name)
        through_pgbouncer(url=url)
        config = PostgresConfig()
        applied: list[list[int]] = []

        def start(i: int) -> None:
            with connect(url, config) as conn:
                applied.append(migrate(conn))

        errors = in_threads(4, start)
        assert not errors, errors
        assert sorted(v for mine in applied for v in mine) == [m.version for m in available()]
        direct = urlsplit(server_url)._replace(path="/" + name).geturl()
        with psycopg.connect(direct, autocommit=True) as conn:
            held = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                (MIGRATION_LOCK_KEY & 0xFFFFFFFF,),
            ).fetchone()
        assert held == (0,)
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_a_worker_through_pgbouncer_in_session_mode(
    db: Conn,
    pgbouncers: PgBouncers,
    direct_url: str,
    through_pgbouncer: Callable[..., dict[str, str]],
    producers: Callable[[], Tether],
    workers: WorkerFactory,
) -> None:
    """pooler=session: every feature works through it (LISTEN on the pooled URL too); only the
    startup option a worker sends a direct server must be left out, or PgBouncer refuses it."""
    url = pgbouncers["session"].url(dbname(direct_url))
    settings = through_pgbouncer(pooler="session", listen=False, url=url)
    settings |= {"TETHER_WORKER_POLL_INTERVAL_MS": "60000"}
    app = producers()
    worker = workers.start(APP, "--processes", "1", env=settings)
    assert app.tasks["add"].send(20, 22).get(timeout=WAIT).ok == 42
    assert POLLING_LINE not in worker.log()
    assert f"tether-{listener_role(worker.worker_id or '')}" in listening_sessions(db)
    assert worker.stop() == 0
    assert statuses(db) == {"COMPLETED": 1}


def test_limited_claims_hold_their_limits_through_pgbouncer(
    db: Conn,
    database_url: str,
    direct_url: str,
    through_pgbouncer: Callable[..., dict[str, str]],
    workers: WorkerFactory,
) -> None:
    """docs/limits.md: the limited claim keeps no session state (transaction-level advisory
    locks, one transaction per claim), so a per-key limit holds through a transaction pooler."""
    from tests.apps.support import ensure_ledger, load_app_module
    from tests.limit_sampler import InFlightSampler

    limited = load_app_module("limited", database_url)  # the producer, direct
    ensure_ledger(db)
    settings = through_pgbouncer()
    started = [
        workers.start("tests.apps.limited:app", "--processes", "3", "--queues", "keyed", env=settings)
        for _ in range(2)
    ]
    with InFlightSampler(direct_url, "keyed") as sampler:
        ids = [
            h.id
            for h in limited.tenant_work.send_many([(f"t{k}", 0.05) for k in range(3) for _ in range(12)])
        ]
        wait_until(
            lambda: statuses(db)["COMPLETED"] == len(ids), timeout=WAIT * 2, interval=0.1, message="36 tasks"
        )
    assert max(sampler.max_per_key.values()) == 2, sampler.max_per_key
    for worker in started:
        log = worker.log()
        assert "prepared statement" not in log and "Traceback" not in log, log
        assert worker.stop() == 0
    assert advisory_locks(db) == 0
