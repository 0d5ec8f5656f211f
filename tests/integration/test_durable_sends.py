"""durable_sends / with_options(durable=...): whether a send's commit waits for the WAL flush.

The flush is observed where PostgreSQL counts it: the number of times WAL was synced to
disk (pg_stat_wal.wal_sync; pg_stat_io's WAL fsyncs from PostgreSQL 18). A durable commit
syncs before it returns; a commit with synchronous_commit off leaves the sync to the WAL
writer, which batches many commits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from tests.apps.support import connect, prepared_insert
from tests.conftest import WorkerFactory
from tether import AppConfig, PostgresConfig, TaskError, TaskResult, Tether
from tether.sending.many import ManySend

SENDS = 100


def producer(database_url: str, *, durable_sends: bool = True, pool_max_size: int = 1) -> Tether:
    """A producer with ONE pooled connection by default, so the statistics flush below runs on the
    backend that sent."""
    app = Tether(
        AppConfig(
            queues=["default", "images", "low"],
            broker=PostgresConfig(
                database_url=database_url, pool_max_size=pool_max_size, durable_sends=durable_sends
            ),
        )
    )

    @app.task("add")
    def add(a: int, b: int) -> TaskResult[int, TaskError]:
        return TaskResult(ok=a + b)

    return app


@pytest.fixture
def app(database_url: str, db: psycopg.Connection[Any]) -> Iterator[Tether]:
    app = producer(database_url)
    yield app
    app.close()
    db.execute("DELETE FROM tether_tasks")


def wal_syncs(app: Tether, db: psycopg.Connection[Any]) -> int:
    """Cluster-wide WAL syncs so far, with the producer's backend's own counts reported first."""
    with app.broker.connection() as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")  # a backend reports its counts lazily
    if db.info.server_version >= 180000:  # PostgreSQL 18 moved the WAL sync count to pg_stat_io
        row = db.execute("SELECT sum(fsyncs) AS n FROM pg_stat_io WHERE object = 'wal'").fetchone()
    else:
        row = db.execute("SELECT wal_sync AS n FROM pg_stat_wal").fetchone()
    assert row is not None
    return int(row["n"])


def syncs_during(app: Tether, db: psycopg.Connection[Any], send: Any) -> int:
    before = wal_syncs(app, db)
    for _ in range(SENDS):
        send()
    return wal_syncs(app, db) - before


@pytest.mark.timing
def test_a_durable_send_syncs_the_wal_and_a_durable_false_one_does_not(
    app: Tether, db: psycopg.Connection[Any]
) -> None:
    add = app.tasks["add"]
    fast = add.with_options(durable=False)
    add.send(1, 1)  # opens the pool's connection
    # Every durable commit syncs; other backends can only add to the count.
    assert syncs_during(app, db, lambda: add.send(1, 2)) >= SENDS
    assert syncs_during(app, db, lambda: add.send_many([(1, 2), (3, 4)])) >= SENDS
    assert syncs_during(app, db, lambda: add.schedule(timedelta(minutes=5), 1, 2)) >= SENDS
    # Without the wait the WAL writer syncs for many commits at once (every 200 ms by default).
    assert syncs_during(app, db, lambda: fast.send(1, 2)) <= SENDS // 4
    assert syncs_during(app, db, lambda: fast.send_many([(1, 2), (3, 4)])) <= SENDS // 4
    assert syncs_during(app, db, lambda: fast.schedule(timedelta(minutes=5), 1, 2)) <= SENDS // 4
    stored = db.execute("SELECT count(*) AS n FROM tether_tasks").fetchone()
    assert stored is not None and stored["n"] == 1 + 8 * SENDS  # every send was stored


@pytest.mark.timing
def test_the_app_setting_is_the_default_and_with_options_overrides_it(
    database_url: str, db: psycopg.Connection[Any]
) -> None:
    app = producer(database_url, durable_sends=False)
    try:
        add = app.tasks["add"]
        add.send(1, 1)
        assert syncs_during(app, db, lambda: add.send(1, 2)) <= SENDS // 4
        assert syncs_during(app, db, lambda: asyncio.run(add.send_async(1, 2))) <= SENDS // 4
        durable = add.with_options(durable=True)
        assert syncs_during(app, db, lambda: durable.send(1, 2)) >= SENDS
    finally:
        app.close()
        db.execute("DELETE FROM tether_tasks")


def test_durable_false_does_not_outlive_its_own_transaction(app: Tether) -> None:
    app.tasks["add"].with_options(durable=False).send(1, 2)
    with app.broker.connection() as conn:  # the same (only) pooled connection
        row = conn.execute(
            "SELECT current_setting('synchronous_commit') AS now, reset_val AS session_default "
            "FROM pg_settings WHERE name = 'synchronous_commit'"
        ).fetchone()
    assert row is not None and row["now"] == row["session_default"] != "off", row


@pytest.mark.parametrize("statement", ["insert_task", "insert_tasks"])
def test_a_durable_send_keeps_the_sessions_own_setting(
    app: Tether, database_url: str, statement: str
) -> None:
    """A user who set synchronous_commit (say remote_apply, for a replica) keeps it for durable sends."""
    add = app.tasks["add"]
    with connect(database_url) as conn:
        conn.execute("SET synchronous_commit = local")
        for durable, expected in ((True, "local"), (False, "off")):
            bound = add.with_options(durable=durable)
            if statement == "insert_task":
                _, insert = prepared_insert(bound, (1, 2))
            else:
                insert = ManySend.prepare(bound._basis, [(1, 2)], {}, None).write
            with conn.transaction(force_rollback=True):
                insert(conn)
                row = conn.execute("SHOW synchronous_commit").fetchone()
            assert row is not None and row["synchronous_commit"] == expected, (durable, row)


def test_a_task_sent_without_the_flush_wait_runs_like_any_other(
    database_url: str, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    workers.start("tests.apps.basic:app", "--queues", "default", "--processes", "2")
    app = producer(database_url, durable_sends=False)
    try:
        add = app.tasks["add"]
        handles = [add.send(i, i) for i in range(5)] + add.send_many([(10, 1), (20, 2)])
        assert [h.get(timeout=30).ok for h in handles] == [0, 2, 4, 6, 8, 11, 22]
    finally:
        app.close()
        db.execute("DELETE FROM tether_task_attempts; DELETE FROM tether_tasks")
