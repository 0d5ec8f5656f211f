"""TaskHandle: waiting (sync, async, many at once), reading, finding by id, send_many's handles."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psycopg
import pytest

import tether.sending.many
from tests.apps.support import count_tasks, task_row
from tests.conftest import REPO, WorkerFactory, WorkerProcess
from tether import ErrorCode, TaskHandle, TaskStatus
from tether.broker.tasks import count_status_of
from tether.cancelling import CancelReply
from tether.errors import TaskNotFoundError

APP = "tests.apps.basic:app"
WAIT = 30.0


@pytest.fixture
def worker(workers: WorkerFactory) -> Iterator[WorkerProcess]:
    """A worker on `default`; `low` is left to tests that want tasks nobody runs yet."""
    yield workers.start(APP, "--queues", "default", "--processes", "2")


@pytest.mark.timing
def test_get_times_out_quickly_when_nobody_runs_the_task(basic: ModuleType) -> None:
    handle = basic.add.with_options(queue="low").send(1, 2)
    started = time.monotonic()
    result = handle.get(timeout=0.2)
    elapsed = time.monotonic() - started
    err = result.err
    assert err is not None and err.code == ErrorCode.WAIT_TIMEOUT and "0.2" in err.message
    assert 0.2 <= elapsed < 1.0
    started = time.monotonic()
    assert handle.get(timeout=0).err.code == ErrorCode.WAIT_TIMEOUT
    assert time.monotonic() - started < 0.5
    assert handle.status() is TaskStatus.PENDING  # waiting changed nothing
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(ValueError, match="timeout"):
            handle.get(timeout=bad)


@pytest.mark.smoke
async def test_async_send_get_status_cancel(basic: ModuleType, worker: WorkerProcess) -> None:
    handle = await basic.add.send_async(20, 22)
    result = await handle.get_async(timeout=WAIT)
    assert result.ok == 42
    assert await handle.status_async() is TaskStatus.COMPLETED
    info = await handle.info_async()
    assert (info.id, info.status, [a.outcome for a in info.attempts]) == (
        handle.id,
        TaskStatus.COMPLETED,
        ["COMPLETED"],
    )
    assert await handle.cancel_async() is CancelReply.ALREADY_ENDED

    waiting = await basic.add.with_options(queue="low").send_async(1, 1)
    assert await waiting.status_async() is TaskStatus.PENDING
    assert (await waiting.get_async(timeout=0.2)).err.code == ErrorCode.WAIT_TIMEOUT
    assert await waiting.cancel_async() is CancelReply.CANCELLED
    assert (await waiting.get_async(timeout=WAIT)).err.code == ErrorCode.TASK_CANCELLED

    many = await basic.add.send_many_async([(i, 1) for i in range(5)])
    assert [(await h.get_async(timeout=WAIT)).ok for h in many] == [1, 2, 3, 4, 5]
    later = await basic.add.schedule_async(0.3, 2, 2)
    assert (await later.get_async(timeout=WAIT)).ok == 4


@pytest.mark.smoke
def test_async_api_in_successive_event_loops(database_url: str, db: psycopg.Connection[Any]) -> None:
    # A script may call asyncio.run() many times; each loop must end promptly, and the
    # async API must work in the next one (nothing of a closed loop may be reused).
    script = textwrap.dedent("""
        import asyncio
        from tests.apps.basic import add

        async def once(i):
            h = await add.with_options(queue="low").send_async(i, i)
            assert (await h.status_async()).value == "PENDING"
            assert (await h.get_async(timeout=0.05)).err.code == "WAIT_TIMEOUT"
            assert await h.cancel_async()
            await add.with_options(queue="low").send_many_async([(i, 1), (i, 2)])

        for i in range(12):
            asyncio.run(once(i))
        # The shortest use: one quick read, the loop ends right after it.
        handle = add.with_options(queue="low").send(1, 2)
        for _ in range(12):
            assert asyncio.run(handle.status_async()).value == "PENDING"
        print("done")
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert count_tasks(db) == 37


def test_info_reports_the_row_and_its_attempts(
    basic: ModuleType, worker: WorkerProcess, db: psycopg.Connection[Any]
) -> None:
    tok = uuid.uuid4().hex
    handle = basic.flaky.send(tok, 1)
    # A worker is running: it may already have claimed the task (pickup takes ms), or its
    # first attempt may have failed and be waiting for its retry; never terminal yet.
    early = handle.info()
    assert not early.status.is_terminal and early.result is None
    assert early.name == "flaky" and early.max_retries == 2

    assert handle.get(timeout=WAIT).ok == 2
    info = handle.info()
    row = task_row(db, handle.id)
    assert info.id == handle.id and info.status is TaskStatus.COMPLETED
    assert (info.attempt, info.retry_count) == (2, 1)
    assert info.claimed_by_worker_id == worker.worker_id
    for name in ("sent_at", "enqueued_at", "claimed_at", "started_at", "completed_at", "failed_at"):
        assert getattr(info, name) == row[name], name
    assert info.sent_at < info.enqueued_at <= info.claimed_at <= info.started_at <= info.completed_at
    assert info.result is not None and info.result.ok == 2
    first, second = info.attempts
    assert (first.attempt, first.outcome, first.will_retry) == (1, "FAILED", True)
    assert first.error_code == "TRANSIENT"
    assert (second.attempt, second.outcome, second.will_retry) == (2, "COMPLETED", False)
    assert first.worker_id == second.worker_id == worker.worker_id
    assert first.started_at is not None and first.started_at <= first.finished_at <= second.started_at


def test_handle_from_an_id(basic: ModuleType, worker: WorkerProcess) -> None:
    sent = basic.add.send(3, 4)
    found = basic.app.handle(str(sent.id))
    assert found == sent and found.id == sent.id
    assert found.get(timeout=WAIT).ok == 7
    assert basic.app.handle(sent.id).status() is TaskStatus.COMPLETED
    assert basic.app.handle(str(sent.id).upper()).info().name == "add"
    with pytest.raises(ValueError, match="'not-a-uuid' is not a UUID"):
        basic.app.handle("not-a-uuid")


def test_an_unknown_id(basic: ModuleType) -> None:
    handle = basic.app.handle(uuid.uuid4())
    result = handle.get(timeout=5)
    assert result.err is not None and result.err.code == ErrorCode.TASK_NOT_FOUND
    assert str(handle.id) in result.err.message
    with pytest.raises(TaskNotFoundError, match=str(handle.id)):
        handle.status()
    with pytest.raises(TaskNotFoundError):
        handle.info()
    with pytest.raises(TaskNotFoundError):
        handle.cancel()
    assert count_tasks_of(basic, handle) == 0


def count_tasks_of(basic: ModuleType, handle: TaskHandle[Any]) -> int:
    return sum(basic.app.broker.run(lambda conn: count_status_of(conn, [handle.id])).values())


def test_twenty_threads_each_waiting_for_its_own_task(basic: ModuleType, workers: WorkerFactory) -> None:
    handles = [basic.add.with_options(queue="low").send(i, 1000) for i in range(20)]
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def wait(i: int) -> None:
        try:
            results[i] = handles[i].get(timeout=WAIT)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    # Nobody serves `low` yet: every thread is waiting. Now a worker runs them all.
    assert all(h.status() is TaskStatus.PENDING for h in handles)
    workers.start(APP, "--queues", "low", "--processes", "2")
    for t in threads:
        t.join(WAIT + 5)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    assert {i: r.ok for i, r in results.items()} == {i: i + 1000 for i in range(20)}


def test_send_many_returns_handles_in_order(basic: ModuleType, db: psycopg.Connection[Any]) -> None:
    items: list[Any] = [(i, -i) for i in range(10)] + [{"a": 100, "b": 1}, {"b": 2, "a": 200}]
    handles = basic.add.with_options(queue="low", priority=7).send_many(items)
    assert len(handles) == 12 and len({h.id for h in handles}) == 12
    rows = {r["id"]: r for r in db.execute("SELECT * FROM tether_tasks").fetchall()}
    assert set(rows) == {h.id for h in handles}
    assert [rows[h.id]["args"] for h in handles] == [[i, -i] for i in range(10)] + [[100, 1], [200, 2]]
    assert {(r["name"], r["queue"], r["priority"], r["status"]) for r in rows.values()} == {
        ("add", "low", 7, "PENDING")
    }
    assert len({r["sent_at"] for r in rows.values()}) == 1  # one statement, one transaction
    assert basic.add.send_many([]) == []


def test_send_many_is_one_transaction_across_statements(
    basic: ModuleType, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several INSERT statements (chunks) must still be all or nothing: make the third
    # chunk fail in the database (a duplicate id) after two chunks were inserted.
    existing = basic.add.with_options(queue="low").send(0, 0)
    ids = iter([uuid.uuid4() for _ in range(4)] + [existing.id])
    monkeypatch.setattr(tether.sending.many, "SEND_MANY_CHUNK", 2)
    monkeypatch.setattr(tether.sending.many, "new_task_ids", lambda n: [next(ids) for _ in range(n)])
    with pytest.raises(psycopg.errors.UniqueViolation):
        basic.add.with_options(queue="low").send_many([(i, i) for i in range(5)])
    assert count_tasks(db) == 1


@pytest.mark.timing
def test_waiters_are_woken_by_the_notification(
    database_url: str, basic: ModuleType, worker: WorkerProcess
) -> None:
    # Re-reading the row every minute only: a result that arrives within seconds can
    # only have come through LISTEN/NOTIFY, including for the very first waiter of a process.
    from tether import AppConfig, PostgresConfig, Tether

    app = Tether(AppConfig(broker=PostgresConfig(database_url=database_url), result_poll_interval_ms=60_000))
    add = app.task("add")(lambda a, b: a + b)  # the same name: the worker runs basic's `add`
    try:
        for i in range(5):
            handle = add.send(i, 1)
            started = time.monotonic()
            assert handle.get(timeout=WAIT).ok == i + 1
            assert time.monotonic() - started < 5, f"waiter {i} was not woken by the notification"
        slow = basic.sleep.send(0.5)
        started = time.monotonic()
        assert app.handle(slow.id).get(timeout=WAIT).ok == 0.5
        assert time.monotonic() - started < 5
    finally:
        app.close()


@pytest.mark.timing
def test_a_result_that_lands_while_the_listener_connects_is_not_missed(
    database_url: str, basic: ModuleType, worker: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first waiter of a process starts the listener; its connection takes a moment
    # (here 1 s). A task finishing meanwhile notifies nobody: the waiter must still see it
    # right away, not after its next re-read of the row (a minute here).
    from tether import AppConfig, PostgresConfig, Tether

    assert basic.add.send(0, 0).get(timeout=WAIT).ok == 0  # the worker is warm
    app = Tether(AppConfig(broker=PostgresConfig(database_url=database_url), result_poll_interval_ms=60_000))
    sleep = app.task("sleep")(lambda seconds, token="": seconds)
    connect = app.broker.connect

    def slow_connect(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return connect(*args, **kwargs)

    monkeypatch.setattr(app.broker, "connect", slow_connect)
    try:
        handle = sleep.send(0.05)
        started = time.monotonic()
        result = handle.get(timeout=10)
        assert result.ok == 0.05, result
        assert time.monotonic() - started < 4
    finally:
        app.close()
