"""Every transition of a task and the row it leaves, with real workers on a real database.

One worker serving only the `default` queue is shared by the module. Tests that need a
queue nobody serves (pending, cancel, expiry, priority, routing) use `low` and `images`,
and start their own worker for those queues when they need one.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import (
    attempt_rows,
    clean_connection,
    db_now,
    load_app_module,
    runs,
    task_row,
)
from tests.conftest import WorkerFactory, WorkerProcess, wait_until
from tether import ErrorCode, TaskStatus
from tether.cancelling import CancelReply

# In the smoke set (.ci/run's Python 3.12 run): a task's whole life, end to end.
pytestmark = pytest.mark.smoke

APP = "tests.apps.basic:app"
FAST_REAPER = {"TETHER_CHECK_INTERVAL_MS": "1000"}
WAIT = 30.0


@pytest.fixture(scope="module")
def conn(database_url: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    with clean_connection(database_url) as c:
        yield c


@pytest.fixture(scope="module")
def basic(database_url: str, conn: psycopg.Connection[Any]) -> ModuleType:
    return load_app_module("basic", database_url)


@pytest.fixture(scope="module")
def default_worker(
    database_url: str, conn: psycopg.Connection[Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """One worker for the module, on the `default` queue only."""
    factory = WorkerFactory(database_url, Path(tmp_path_factory.mktemp("lifecycle-worker")))
    try:
        worker = factory.start(APP, "--queues", "default", "--processes", "2", env=FAST_REAPER)
        yield worker
        assert worker.stop() == 0, worker.log()
        assert "Traceback" not in worker.log(), worker.log()
    finally:
        factory.cleanup()


def token() -> str:
    return uuid.uuid4().hex


# -- send ------------------------------------------------------------------------------


def test_send_creates_a_pending_row(basic: ModuleType, conn: psycopg.Connection[Any]) -> None:
    before = db_now(conn)
    handle = basic.add.with_options(queue="low").send(1, b=2)
    after = db_now(conn)

    row = task_row(conn, handle.id)
    assert row["status"] == "PENDING"
    assert (row["name"], row["queue"], row["priority"]) == ("add", "low", 0)
    assert (row["args"], row["kwargs"]) == ([1, 2], {})  # bound to the signature
    assert row["attempt"] == 0 and row["retry_count"] == 0 and row["max_retries"] == 0
    assert before <= row["sent_at"] <= after
    assert row["enqueued_at"] == row["sent_at"] == row["run_at"]
    for column in (
        "claimed_at",
        "started_at",
        "completed_at",
        "failed_at",
        "cancelled_at",
        "expired_at",
        "next_retry_at",
        "claimed_by_worker_id",
        "result",
        "error_code",
    ):
        assert row[column] is None, column
    assert attempt_rows(conn, handle.id) == []
    assert handle.status() is TaskStatus.PENDING
    assert handle.cancel()  # leave nothing runnable behind


# -- outcomes --------------------------------------------------------------------------


def test_completed_row_and_its_one_attempt(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    handle = basic.add.send(2, 3)
    result = handle.get(timeout=WAIT)
    assert result.is_ok and result.ok == 5

    row = task_row(conn, handle.id)
    assert row["status"] == "COMPLETED"
    assert row["sent_at"] <= row["claimed_at"] <= row["started_at"] <= row["completed_at"]
    assert row["claimed_by_worker_id"] == default_worker.worker_id
    assert row["attempt"] == 1 and row["retry_count"] == 0
    assert row["failed_at"] is None and row["error_code"] is None and row["next_retry_at"] is None
    assert row["result"] == {"ok": 5}

    (attempt,) = attempt_rows(conn, handle.id)
    assert attempt["attempt"] == row["attempt"] == 1
    assert attempt["outcome"] == "COMPLETED" and attempt["will_retry"] is False
    assert attempt["worker_id"] == default_worker.worker_id
    assert attempt["hostname"] == socket.gethostname() and attempt["pid"] > 0
    assert attempt["started_at"] == row["started_at"]
    assert attempt["finished_at"] == row["completed_at"]  # same transaction as the transition
    assert attempt["error_code"] is None
    assert handle.status() is TaskStatus.COMPLETED


def test_err_result_is_failed_and_round_trips(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    handle = basic.fail.send("OUT_OF_STOCK", message="no more widgets")
    result = handle.get(timeout=WAIT)
    assert result.is_err
    err = result.err
    assert err is not None
    assert (err.code, err.message, err.data) == ("OUT_OF_STOCK", "no more widgets", {"at": "fail"})

    row = task_row(conn, handle.id)
    assert row["status"] == "FAILED" and row["error_code"] == "OUT_OF_STOCK"
    assert row["started_at"] <= row["failed_at"] and row["completed_at"] is None
    (attempt,) = attempt_rows(conn, handle.id)
    assert attempt["outcome"] == "FAILED" and attempt["will_retry"] is False
    assert (attempt["error_code"], attempt["error_message"]) == ("OUT_OF_STOCK", "no more widgets")
    assert attempt["finished_at"] == row["failed_at"]
    assert handle.status() is TaskStatus.FAILED


def test_exception_is_failed_with_its_traceback(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    handle = basic.boom.send("kaput 42")
    err = handle.get(timeout=WAIT).err
    assert err is not None
    assert err.code == ErrorCode.UNHANDLED_EXCEPTION
    assert err.message == "RuntimeError: kaput 42"
    assert (err.data["module"], err.data["type"]) == ("builtins", "RuntimeError")
    traceback = err.data["traceback"]
    assert traceback.startswith("Traceback (most recent call last)")
    assert "raise RuntimeError(message)" in traceback and "RuntimeError: kaput 42" in traceback

    row = task_row(conn, handle.id)
    assert row["status"] == "FAILED" and row["error_code"] == "UNHANDLED_EXCEPTION"
    assert row["failed_at"] is not None
    (attempt,) = attempt_rows(conn, handle.id)
    assert attempt["error_code"] == "UNHANDLED_EXCEPTION" and attempt["outcome"] == "FAILED"


def test_unstorable_result_fails_the_task_not_the_worker(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    # A NUL character cannot be stored by PostgreSQL: the task fails with a clear code,
    # the child that ran it stays alive and the worker carries on.
    handle = basic.nul_result.send()
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.RESULT_NOT_SERIALIZABLE, err
    assert "NUL" in err.message
    assert task_row(conn, handle.id)["status"] == "FAILED"
    assert basic.add.send(1, 1).get(timeout=WAIT).ok == 2
    assert "exited with code" not in default_worker.log()


def test_exception_with_an_unstorable_message_fails_the_task_not_the_worker(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    # Exception messages are the user's text too (a NUL from a C library, a binary
    # protocol): the task must still fail as UNHANDLED_EXCEPTION, with the traceback.
    handle = basic.boom_nul.send()
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.UNHANDLED_EXCEPTION, err
    assert "bad byte" in err.message and "Traceback" in err.data["traceback"]
    assert task_row(conn, handle.id)["status"] == "FAILED"
    assert basic.add.send(1, 1).get(timeout=WAIT).ok == 2


# -- retries ---------------------------------------------------------------------------


def test_retry_then_success(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    tok = token()
    handle = basic.flaky.send(tok, 1)
    result = handle.get(timeout=WAIT)
    assert result.is_ok and result.ok == 2

    row = task_row(conn, handle.id)
    assert row["status"] == "COMPLETED"
    assert row["retry_count"] == 1 and row["attempt"] == 2 and row["max_retries"] == 2
    assert row["next_retry_at"] is None and row["error_code"] is None
    assert row["enqueued_at"] > row["sent_at"]  # enqueued again for the retry

    first, second = attempt_rows(conn, handle.id)
    assert (first["attempt"], first["outcome"], first["will_retry"]) == (1, "FAILED", True)
    assert (first["error_code"], first["error_message"]) == ("TRANSIENT", "run 1 fails")
    assert (second["attempt"], second["outcome"], second["will_retry"]) == (2, "COMPLETED", False)
    # The fixed 0.2 s retry delay is respected (database time).
    assert second["started_at"] >= first["finished_at"] + timedelta(seconds=0.2)
    assert runs(conn, tok) == 2


def test_retries_exhausted(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    tok = token()
    handle = basic.flaky.send(tok, 10)
    err = handle.get(timeout=WAIT).err
    assert err is not None and (err.code, err.message) == ("TRANSIENT", "run 3 fails")

    row = task_row(conn, handle.id)
    assert row["status"] == "FAILED" and row["error_code"] == "TRANSIENT"
    assert row["retry_count"] == row["max_retries"] == 2
    assert row["attempt"] == 3
    attempts = attempt_rows(conn, handle.id)
    assert [a["attempt"] for a in attempts] == [1, 2, 3]
    assert [a["outcome"] for a in attempts] == ["FAILED"] * 3
    assert [a["will_retry"] for a in attempts] == [True, True, False]
    assert runs(conn, tok) == 3


def test_next_retry_at_while_waiting_for_a_retry(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    tok = token()
    handle = basic.retry_later.send(tok)  # fails once, retry in 60 s
    row = wait_until(
        lambda: (r := task_row(conn, handle.id))["retry_count"] == 1 and r,
        timeout=WAIT,
        message="the first failure to be recorded",
    )
    assert row["status"] == "PENDING"
    (attempt,) = attempt_rows(conn, handle.id)
    assert attempt["will_retry"] is True and attempt["outcome"] == "FAILED"
    assert row["next_retry_at"] == attempt["finished_at"] + timedelta(seconds=60)
    assert row["run_at"] == row["enqueued_at"] == row["next_retry_at"]
    assert row["claimed_by_worker_id"] is None and row["claimed_at"] is None and row["started_at"] is None
    assert row["error_code"] == "TRANSIENT"
    assert handle.status() is TaskStatus.PENDING
    assert handle.get(timeout=0.2).err.code == ErrorCode.WAIT_TIMEOUT  # not an outcome yet

    assert handle.cancel()  # a task waiting for its retry can still be cancelled
    assert handle.get(timeout=WAIT).err.code == ErrorCode.TASK_CANCELLED
    assert runs(conn, tok) == 1


# -- cancel ----------------------------------------------------------------------------


def test_cancel_pending_and_it_never_runs(
    basic: ModuleType, conn: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    cancelled_tok, other_tok = token(), token()
    low = basic.record.with_options(queue="low")
    cancelled = low.send(cancelled_tok)
    other = low.send(other_tok)

    assert cancelled.cancel() is CancelReply.CANCELLED
    row = task_row(conn, cancelled.id)
    assert row["status"] == "CANCELLED" and row["error_code"] == "TASK_CANCELLED"
    assert row["cancelled_at"] >= row["sent_at"]
    err = cancelled.get(timeout=5).err
    assert err is not None and err.code == ErrorCode.TASK_CANCELLED
    assert cancelled.cancel() is CancelReply.ALREADY_ENDED
    assert cancelled.status() is TaskStatus.CANCELLED

    workers.start(APP, "--queues", "low", "--processes", "1")
    # The task sent after it runs; the cancelled one, first in line, never does.
    assert other.get(timeout=WAIT).ok == other_tok
    assert runs(conn, cancelled_tok) == 0
    after = task_row(conn, cancelled.id)
    assert after["status"] == "CANCELLED" and after["attempt"] == 0 and after["claimed_at"] is None
    assert attempt_rows(conn, cancelled.id) == []


def test_cancel_completed_changes_nothing(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    handle = basic.add.send(1, 1)
    assert handle.get(timeout=WAIT).ok == 2
    before = task_row(conn, handle.id)
    assert handle.cancel() is CancelReply.ALREADY_ENDED
    assert task_row(conn, handle.id) == before
    assert handle.status() is TaskStatus.COMPLETED
    assert handle.get(timeout=1).ok == 2


# -- time ------------------------------------------------------------------------------


def test_expired_before_any_worker_claimed_it(
    basic: ModuleType, conn: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    tok = token()
    handle = basic.record.with_options(queue="low").send(
        tok, good_until=datetime.now(UTC) + timedelta(seconds=1)
    )
    assert task_row(conn, handle.id)["good_until"] is not None
    wait_until(
        lambda: conn.execute(
            "SELECT now() > good_until AS over FROM tether_tasks WHERE id = %s", (handle.id,)
        ).fetchone()["over"],
        timeout=10,
        message="good_until to pass (database time)",
    )
    workers.start(APP, "--queues", "low", "--processes", "1", env=FAST_REAPER)

    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TASK_EXPIRED
    row = task_row(conn, handle.id)
    assert row["status"] == "EXPIRED" and row["error_code"] == "TASK_EXPIRED"
    assert row["expired_at"] >= row["good_until"]
    assert row["attempt"] == 0 and row["claimed_at"] is None and row["started_at"] is None
    assert attempt_rows(conn, handle.id) == []  # nothing ran: no attempt
    assert runs(conn, tok) == 0
    assert handle.cancel() is CancelReply.ALREADY_ENDED


def test_schedule_runs_after_the_delay(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    delayed = basic.add.schedule(timedelta(seconds=1.5), 4, 5)
    by_number = basic.add.schedule(1, 1, 2)  # seconds as a number
    row = task_row(conn, delayed.id)
    assert row["status"] == "PENDING"
    assert row["run_at"] == row["enqueued_at"] == row["sent_at"] + timedelta(seconds=1.5)

    assert delayed.get(timeout=WAIT).ok == 9
    assert by_number.get(timeout=WAIT).ok == 3
    row = task_row(conn, delayed.id)
    assert row["claimed_at"] >= row["sent_at"] + timedelta(seconds=1.5)
    assert row["started_at"] >= row["sent_at"] + timedelta(seconds=1.5)
    row = task_row(conn, by_number.id)
    assert row["started_at"] >= row["sent_at"] + timedelta(seconds=1)


def test_priority_orders_the_claims(
    basic: ModuleType, conn: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    prefix = token()
    priorities = [0, -100, 50, 10, 100, -5, 10]
    handles = [
        basic.record.with_options(queue="low", priority=p).send(f"{prefix}-{i}")
        for i, p in enumerate(priorities)
    ]
    workers.start(APP, "--queues", "low", "--processes", "1", "--prefetch", "0")
    for handle in handles:
        assert handle.get(timeout=WAIT).is_ok

    rows = sorted((task_row(conn, h.id) for h in handles), key=lambda r: r["started_at"])
    assert [r["priority"] for r in rows] == sorted(priorities, reverse=True)
    # Equal priorities keep the order they were sent in.
    tens = [r["id"] for r in rows if r["priority"] == 10]
    assert tens == [handles[3].id, handles[6].id]
    claimed = sorted(rows, key=lambda r: r["claimed_at"])
    assert [r["id"] for r in claimed] == [r["id"] for r in rows]


def test_claims_go_past_a_higher_prioritys_tasks_that_are_not_due(
    basic: ModuleType, conn: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    """Tasks due later at a higher priority are neither claimed nor in the way: the due ones
    of the priorities below run, in priority order, and every one of them is claimed."""
    prefix = token()
    later = [
        basic.record.with_options(queue="low", priority=p).schedule(timedelta(hours=1), f"{prefix}-later-{i}")
        for i, p in enumerate([100, 100, 100, 50, 50])
    ]
    due = [
        basic.record.with_options(queue="low", priority=p).send(f"{prefix}-due-{i}")
        for i, p in enumerate([0, 50, -5, 100, 50, 0])
    ]
    workers.start(APP, "--queues", "low", "--processes", "1", "--prefetch", "0")
    for handle in due:
        assert handle.get(timeout=WAIT).is_ok

    rows = sorted((task_row(conn, h.id) for h in due), key=lambda r: r["started_at"])
    assert [r["priority"] for r in rows] == [100, 50, 50, 0, 0, -5]
    assert [r["id"] for r in rows if r["priority"] == 50] == [due[1].id, due[4].id]
    assert [task_row(conn, h.id)["status"] for h in later] == ["PENDING"] * len(later)


def test_a_worker_takes_only_its_queues(
    basic: ModuleType, conn: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--queues", "images", "--processes", "1")
    ignored_tok = token()
    ignored = basic.record.with_options(queue="low").send(ignored_tok)
    images = [basic.add.with_options(queue="images").send(i, i) for i in range(3)]

    assert [h.get(timeout=WAIT).ok for h in images] == [0, 2, 4]
    for h in images:
        row = task_row(conn, h.id)
        assert row["queue"] == "images" and row["claimed_by_worker_id"] == worker.worker_id
    row = conn.execute("SELECT queues FROM tether_workers WHERE id = %s", (worker.worker_id,)).fetchone()
    assert row is not None and row["queues"] == ["images"]
    # Sent first, but on a queue the worker does not serve: untouched.
    row = task_row(conn, ignored.id)
    assert row["status"] == "PENDING" and row["attempt"] == 0 and row["claimed_by_worker_id"] is None
    assert runs(conn, ignored_tok) == 0
    assert ignored.cancel()


# -- what runs -------------------------------------------------------------------------


def test_task_not_registered_in_the_worker(
    basic: ModuleType, database_url: str, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    other = load_app_module("other", database_url)
    assert "only_in_other" not in basic.app.tasks
    handle = other.only_in_other.send(7)
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TASK_NOT_REGISTERED
    assert "only_in_other" in err.message

    row = task_row(conn, handle.id)
    assert row["status"] == "FAILED" and row["error_code"] == "TASK_NOT_REGISTERED"
    assert row["claimed_by_worker_id"] == default_worker.worker_id and row["started_at"] is None
    (attempt,) = attempt_rows(conn, handle.id)
    assert attempt["outcome"] == "FAILED" and attempt["error_code"] == "TASK_NOT_REGISTERED"
    # The worker carries on.
    assert basic.add.send(20, 22).get(timeout=WAIT).ok == 42


def test_async_task_and_plain_return_value(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    async_handle = basic.echo_async.send("hi")
    plain_handle = basic.plain_return.send(21)
    assert async_handle.get(timeout=WAIT).ok == "HI"
    assert plain_handle.get(timeout=WAIT).ok == 42
    assert task_row(conn, async_handle.id)["status"] == "COMPLETED"
    assert task_row(conn, plain_handle.id)["result"] == {"ok": 42}


def test_typed_arguments_round_trip(
    basic: ModuleType, conn: psycopg.Connection[Any], default_worker: WorkerProcess
) -> None:
    from decimal import Decimal

    order_id = uuid.uuid4()
    when = datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    handle = basic.typed.send(
        basic.Point(1, 2), basic.Order(id=order_id, total=Decimal("10.05"), placed_at=when), when
    )
    result = handle.get(timeout=WAIT)
    assert result.is_ok, result
    assert result.ok == {"sum": 3, "total": Decimal("10.05"), "when": when, "id": order_id}
