"""Sends inside the caller's own transaction (docs/transactions.md), with real workers.

The task commits or rolls back with the caller's transaction: before the commit no
worker sees it, after it a waiting worker starts it within the usual pickup latency
(the wake-up is part of the same transaction), after a rollback there is nothing.
tether never commits, rolls back or closes the caller's connection.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from tests.apps.support import connect
from tests.apps.support import runs as ledger_count
from tests.conftest import WorkerFactory, _with_dbname, wait_until
from tests.integration.test_wakeups import fake_worker, register
from tether import ErrorCode, TaskStatus
from tether.errors import InvalidOptionError, TaskNotFoundError, WrongDatabaseError

APP = "tests.apps.basic:app"
# The worker's fallback poll is pushed far out, so a prompt start can only come from the
# notification delivered at the caller's commit.
NO_POLL = {"TETHER_WORKER_POLL_INTERVAL_MS": "60000"}


def task_exists(db: psycopg.Connection[Any], task_id: uuid.UUID) -> bool:
    return db.execute("SELECT 1 FROM tether_tasks WHERE id = %s", (task_id,)).fetchone() is not None


def waiters(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) AS n FROM tether_queue_waiters").fetchone()
    return int(row["n"])


@pytest.fixture
def caller(database_url: str) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    """The application's own connection: psycopg's defaults (not autocommit, tuple rows)."""
    with psycopg.connect(database_url) as conn:
        yield conn


@pytest.mark.smoke
@pytest.mark.timing
def test_a_committed_send_runs_once_and_the_connection_stays_the_callers(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, caller: psycopg.Connection[Any]
) -> None:
    workers.start(APP, "--processes", "1", env=NO_POLL)
    wait_until(lambda: waiters(db), message="the idle worker to wait for work")
    caller.execute("CREATE TEMP TABLE orders (id int)")
    caller.execute("INSERT INTO orders VALUES (1)")
    handle = basic.record.with_options(connection=caller).send("committed")

    # tether wrote inside the caller's transaction and ended nothing, changed nothing of it.
    assert caller.info.transaction_status == TransactionStatus.INTRANS
    assert caller.row_factory is tuple_row
    assert caller.execute("SELECT count(*) FROM tether_tasks WHERE id = %s", (handle.id,)).fetchone() == (1,)
    # Nobody else sees it yet: not the database, not a handle, not the idle worker.
    assert not task_exists(db, handle.id)
    with pytest.raises(TaskNotFoundError, match="has not committed or was rolled back"):
        handle.status()
    assert ledger_count(db, "committed") == 0

    caller.commit()
    committed_at = db.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    assert handle.get(timeout=10).ok == "committed"
    row = db.execute("SELECT started_at FROM tether_tasks WHERE id = %s", (handle.id,)).fetchone()
    # Woken by the notification delivered at commit (the poll is 60 s away).
    assert row["started_at"] - committed_at < timedelta(seconds=1)
    assert ledger_count(db, "committed") == 1
    assert not caller.closed


@pytest.mark.smoke
def test_a_rolled_back_send_leaves_nothing_and_its_handle_says_not_found(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, caller: psycopg.Connection[Any]
) -> None:
    worker = workers.start(APP, "--processes", "1", env=NO_POLL)
    wait_until(lambda: waiters(db), message="the idle worker to wait for work")
    listener = psycopg.connect(db.info.dsn, autocommit=True)
    listener.execute("LISTEN tether_work")
    handle = basic.record.with_options(connection=caller).send("rolled-back")
    caller.rollback()

    assert not task_exists(db, handle.id)
    # get() answers at once, it does not wait out its timeout for a task that will never be.
    result = handle.get(timeout=60)
    assert result.err is not None and result.err.code == ErrorCode.TASK_NOT_FOUND
    assert "rolled back" in result.err.message
    # No notification escaped the rollback: a marker sent afterwards is the first one to arrive.
    db.execute("NOTIFY tether_work, 'marker'")
    first = next(listener.notifies(timeout=10))
    assert first.payload == "marker"
    listener.close()
    # The worker stayed idle and the next committed send runs normally.
    basic.record.with_options(connection=caller).send("after")
    caller.commit()
    wait_until(lambda: ledger_count(db, "after") == 1, message="the send after the rollback to run")
    assert ledger_count(db, "rolled-back") == 0
    assert worker.stop() == 0, worker.log()


@pytest.mark.timing
def test_a_transaction_open_for_seconds_holds_its_task_back_and_no_other_send(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, caller: psycopg.Connection[Any]
) -> None:
    workers.start(APP, "--processes", "1", env=NO_POLL)
    wait_until(lambda: waiters(db), message="the idle worker to wait for work")
    held = basic.record.with_options(connection=caller).send("held")
    opened = time.monotonic()
    # While it stays open, a worker registering to wait for work on the queue (what an idle
    # worker does, in one transaction taking the queue's lock exclusively) is not held back,
    # and plain sends to the same queue go through and run.
    with connect(db.info.dsn) as registrar:
        registrar.execute("SET lock_timeout = '5s'")
        register(registrar, fake_worker(db, ["default"]), ["default"])
    for i in range(5):
        assert basic.add.send(i, 1).get(timeout=10).ok == i + 1
    while time.monotonic() - opened < 3:
        assert not task_exists(db, held.id)
        assert held.get(timeout=0.2).err.code == ErrorCode.TASK_NOT_FOUND
    assert ledger_count(db, "held") == 0
    # Read just before the commit: the notification wakes the worker at the commit, and it can
    # start the task before a clock read after commit() returned (seen: 1 ms before).
    committed_at = db.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    caller.commit()
    assert held.get(timeout=10).ok == "held"
    row = db.execute("SELECT sent_at, started_at FROM tether_tasks WHERE id = %s", (held.id,)).fetchone()
    assert row["started_at"] >= committed_at
    assert row["started_at"] - committed_at < timedelta(seconds=1)
    # sent_at is the transaction's start (PostgreSQL's now()), as documented.
    assert committed_at - row["sent_at"] >= timedelta(seconds=3)


def test_many_concurrent_transactions_each_sending_run_exactly_what_committed(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, database_url: str
) -> None:
    workers.start(APP, "--processes", "2")
    threads, rounds = 8, 20
    committed: list[str] = []
    rolled_back: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def producer(n: int) -> None:
        try:
            with psycopg.connect(database_url) as conn:
                for r in range(rounds):
                    tokens = [f"t{n}-{r}-{k}" for k in range(1 + r % 3)]
                    for token in tokens:
                        basic.record.with_options(connection=conn).send(token)
                    conn.execute("SELECT pg_sleep(0.005)")  # the application's own work, in between
                    if r % 2:
                        conn.rollback()
                    else:
                        conn.commit()
                    with lock:
                        (rolled_back if r % 2 else committed).extend(tokens)
        except BaseException as exc:
            errors.append(exc)

    started = [threading.Thread(target=producer, args=(n,)) for n in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join()
    assert not errors, errors
    wait_until(
        lambda: (
            db.execute("SELECT count(*) AS n FROM tether_tasks WHERE status = 'COMPLETED'").fetchone()["n"]
            == len(committed)
        ),
        timeout=60,
        message=f"all {len(committed)} committed tasks to complete",
    )
    ran = db.execute("SELECT token, count(*) AS n FROM tether_test_ledger GROUP BY token").fetchall()
    assert {r["token"]: r["n"] for r in ran} == dict.fromkeys(committed, 1)
    assert db.execute("SELECT count(*) AS n FROM tether_tasks").fetchone()["n"] == len(committed)
    assert set(committed).isdisjoint(rolled_back) and len(rolled_back) > 0


@pytest.mark.smoke
async def test_an_async_connection_commits_and_rolls_back_with_its_transaction(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, database_url: str
) -> None:
    workers.start(APP, "--processes", "1")
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        kept = await basic.record.with_options(connection=conn).send_async("async-kept")
        many = await basic.record.with_options(connection=conn).send_many_async(
            [("async-m1",), ("async-m2",)]
        )
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        assert not task_exists(db, kept.id)
        await conn.commit()
        dropped = await basic.record.with_options(connection=conn).send_async("async-dropped")
        await conn.rollback()
    assert (await kept.get_async(timeout=10)).ok == "async-kept"
    assert [(await h.get_async(timeout=10)).ok for h in many] == ["async-m1", "async-m2"]
    result = await dropped.get_async(timeout=60)
    assert result.err is not None and result.err.code == ErrorCode.TASK_NOT_FOUND
    assert ledger_count(db, "async-dropped") == 0


def test_send_many_schedule_and_unique_sends_follow_the_transaction(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, caller: psycopg.Connection[Any]
) -> None:
    bound = basic.record.with_options(connection=caller)
    rolled = bound.send_many([("m-rolled-1",), ("m-rolled-2",)])
    keyed = basic.record.with_options(connection=caller, unique_key="order-7").send("u-rolled")
    caller.rollback()
    assert not any(task_exists(db, h.id) for h in [*rolled, keyed])
    # The key was never taken for good: after the rollback the next unique send creates.
    keyed_again = basic.record.with_options(connection=caller, unique_key="order-7").send("u-kept")
    duplicate = basic.record.with_options(connection=caller, unique_key="order-7").send("u-dup")
    assert not keyed_again.deduplicated and duplicate.deduplicated and duplicate.id == keyed_again.id
    many = bound.send_many([("m-1",), ("m-2",), ("m-3",)])
    run_at = datetime.now(UTC) + timedelta(seconds=2)
    later = bound.schedule(run_at, "at-a-time")
    caller.commit()
    workers.start(APP, "--processes", "2")
    assert [h.get(timeout=10).ok for h in many] == ["m-1", "m-2", "m-3"]
    assert keyed_again.get(timeout=10).ok == "u-kept"
    assert later.get(timeout=10).ok == "at-a-time"
    row = db.execute("SELECT run_at, started_at FROM tether_tasks WHERE id = %s", (later.id,)).fetchone()
    assert row["run_at"] == run_at and row["started_at"] >= run_at
    assert ledger_count(db, "u-dup") == 0 and ledger_count(db, "m-rolled-1") == 0


def test_a_workflow_starts_inside_the_transaction(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, caller: psycopg.Connection[Any]
) -> None:
    def flow() -> Any:
        first = basic.add.node(args=(1, 2))
        second = basic.add.node(kwargs={"b": 10}, args_from={"a": first})
        return basic.app.workflow("in-transaction", [first, second], output=second)

    dropped = flow().start(connection=caller)
    caller.rollback()
    assert db.execute("SELECT count(*) AS n FROM tether_workflows").fetchone()["n"] == 0
    kept = flow().start(connection=caller)
    assert caller.info.transaction_status == TransactionStatus.INTRANS
    caller.commit()
    workers.start(APP, "--processes", "1")
    assert kept.get(timeout=10).ok == 13
    assert db.execute("SELECT id FROM tether_workflows").fetchall() == [{"id": kept.id}]
    assert dropped.id != kept.id


@pytest.mark.smoke
async def test_a_workflow_starts_inside_an_async_transaction(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, database_url: str
) -> None:
    first = basic.add.node(args=(2, 3))
    flow = basic.app.workflow(
        "in-async-transaction", [first, basic.add.node(args_from={"a": first}, kwargs={"b": 1})]
    )
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        handle = await flow.start_async(connection=conn)
        await conn.commit()
    workers.start(APP, "--processes", "1")
    assert (await handle.get_async(timeout=10)).ok is not None
    steps = db.execute(
        "SELECT status FROM tether_workflow_tasks WHERE workflow_id = %s", (handle.id,)
    ).fetchall()
    assert [s["status"] for s in steps] == ["COMPLETED", "COMPLETED"]


# -- refusals: each names what is wrong and leaves the caller's transaction as it was ------------


def test_a_connection_that_is_not_psycopg_3_is_refused_by_name(basic: Any) -> None:
    import sqlite3

    with pytest.raises(InvalidOptionError, match=r"connection must be a psycopg 3 Connection.*sqlite3"):
        basic.record.with_options(connection=sqlite3.connect(":memory:"))


def test_durable_false_with_a_connection_is_refused(basic: Any, caller: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidOptionError, match="durable=False cannot apply"):
        basic.record.with_options(connection=caller, durable=False)


def test_an_autocommit_connection_with_no_transaction_is_refused_and_nothing_is_sent(
    basic: Any, db: psycopg.Connection[Any], database_url: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        with pytest.raises(InvalidOptionError, match="autocommit mode with no transaction open"):
            basic.record.with_options(connection=conn).send("never")
        with conn.transaction():  # the remedy the message gives
            handle = basic.record.with_options(connection=conn).send("inside")
    assert task_exists(db, handle.id)
    assert db.execute("SELECT count(*) AS n FROM tether_tasks").fetchone()["n"] == 1


def test_a_failed_transaction_is_refused(basic: Any, caller: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero):
        caller.execute("SELECT 1 / 0")
    with pytest.raises(InvalidOptionError, match="failed transaction"):
        basic.record.with_options(connection=caller).send("never")


async def test_sync_and_async_connections_go_to_their_own_calls(
    basic: Any, caller: psycopg.Connection[Any], database_url: str
) -> None:
    with pytest.raises(InvalidOptionError, match=r"send_async\(\) got a sync psycopg Connection"):
        await basic.record.with_options(connection=caller).send_async("never")
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        with pytest.raises(InvalidOptionError, match=r"send\(\) got an async connection"):
            basic.record.with_options(connection=conn).send("never")
        assert conn.info.transaction_status == TransactionStatus.IDLE  # nothing ran on it


@pytest.fixture
def other_database(server_url: str) -> Iterator[str]:
    """Another database on the same server, without tether's tables."""
    name = f"tether_other_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield _with_dbname(server_url, name)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_a_connection_to_another_database_is_refused_naming_both(
    basic: Any, db: psycopg.Connection[Any], other_database: str, database_url: str
) -> None:
    ours = db.execute("SELECT current_database() AS d").fetchone()["d"]
    with psycopg.connect(other_database) as conn:
        conn.execute("CREATE TABLE app_rows (id int)")
        with pytest.raises(WrongDatabaseError) as refused:
            basic.record.with_options(connection=conn).send("never")
        theirs = conn.execute("SELECT current_database()").fetchone()[0]
        # The caller's transaction is intact: the check ran no statement that could fail.
        conn.execute("INSERT INTO app_rows VALUES (1)")
        conn.commit()
    message = str(refused.value)
    assert f"database {theirs!r}" in message and "has no tether tables" in message
    assert f"database {ours!r}" in message
    assert db.execute("SELECT count(*) AS n FROM tether_tasks").fetchone()["n"] == 0


def test_a_search_path_that_hides_tethers_tables_is_refused(
    basic: Any, db: psycopg.Connection[Any], caller: psycopg.Connection[Any]
) -> None:
    caller.execute("CREATE SCHEMA IF NOT EXISTS elsewhere")
    caller.execute("SET search_path TO elsewhere")
    with pytest.raises(WrongDatabaseError, match="cannot see tether's tables through its search_path"):
        basic.record.with_options(connection=caller).send("never")
    caller.rollback()


@pytest.mark.smoke
def test_sqlalchemy_session_commits_and_rolls_back_the_task_with_its_rows(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, database_url: str
) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    from tether.contrib.sqlalchemy import psycopg_connection

    engine = create_engine(database_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS sa_orders (id int PRIMARY KEY)"))
    try:
        with Session(engine) as session:
            with session.begin():
                session.execute(text("INSERT INTO sa_orders VALUES (1)"))
                kept = basic.record.with_options(connection=psycopg_connection(session)).send("sa-kept")
            session.begin()
            session.execute(text("INSERT INTO sa_orders VALUES (2)"))
            dropped = basic.record.with_options(connection=psycopg_connection(session)).send("sa-dropped")
            session.rollback()
        workers.start(APP, "--processes", "1")
        assert kept.get(timeout=10).ok == "sa-kept"
        assert not task_exists(db, dropped.id)
        assert [r["id"] for r in db.execute("SELECT id FROM sa_orders").fetchall()] == [1]
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE sa_orders"))
        engine.dispose()


@pytest.mark.smoke
async def test_sqlalchemy_async_session_sends_in_its_transaction(
    basic: Any, db: psycopg.Connection[Any], database_url: str
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from tether.contrib.sqlalchemy import psycopg_connection_async

    engine = create_async_engine(database_url.replace("postgresql://", "postgresql+psycopg_async://", 1))
    try:
        async with AsyncSession(engine) as session, session.begin():
            conn = await psycopg_connection_async(session)
            kept = await basic.record.with_options(connection=conn).send_async("sa-async")
            assert not task_exists(db, kept.id)
        assert (await kept.status_async()) is TaskStatus.PENDING
    finally:
        await engine.dispose()


def test_a_psycopg2_style_engine_is_refused_with_the_driver_named(basic: Any) -> None:
    from sqlalchemy import create_engine

    from tether.contrib.sqlalchemy import psycopg_connection

    engine = create_engine("sqlite://")
    with engine.connect() as conn, pytest.raises(InvalidOptionError, match="'pysqlite' driver"):
        psycopg_connection(conn)


async def test_an_async_start_whose_first_step_key_is_held_is_settled_by_the_reaper(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory, database_url: str
) -> None:
    """On an async connection the refused first step is settled after the commit, by the
    reaper's reconciliation (docs/transactions.md), not left hanging."""
    holder = basic.sleep.with_options(unique_key="held-by-another").send(0.1)
    step = basic.sleep.with_options(unique_key="held-by-another").node(args=(0.1,))
    flow = basic.app.workflow("refused-at-start", [step])
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        handle = await flow.start_async(connection=conn)
        await conn.commit()
    row = db.execute(
        "SELECT status, error_code FROM tether_tasks WHERE workflow_id = %s", (handle.id,)
    ).fetchone()
    assert (row["status"], row["error_code"]) == ("FAILED", "UNIQUE_KEY_HELD")
    workers.start(APP, "--processes", "1", env={"TETHER_CHECK_INTERVAL_MS": "1000"})
    result = await handle.get_async(timeout=20)
    assert result.err is not None
    assert (await handle.status_async()).value == "FAILED"
    assert holder.get(timeout=10).ok == 0.1
