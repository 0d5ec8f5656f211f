"""The async executor on a real database with real worker processes: many ``async def``
tasks at once in one async child, each with the guarantees of a task in a sync child."""

from __future__ import annotations

import signal
import uuid
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import attempt_rows, ensure_ledger, load_app_module, task_row
from tests.conftest import WorkerFactory, wait_until

APP = "tests.apps.aio:app"
WAIT = 30
ONE_ASYNC_CHILD = ("--processes", "0", "--async-processes", "1")


@pytest.fixture
def aio(database_url: str, db: psycopg.Connection[Any]) -> ModuleType:
    ensure_ledger(db)
    return load_app_module("aio", database_url)


def token() -> str:
    return uuid.uuid4().hex


def ledger_pids(db: psycopg.Connection[Any], tokens: list[str]) -> list[int]:
    rows = db.execute("SELECT pid FROM tether_test_ledger WHERE token = ANY(%s)", (tokens,)).fetchall()
    return [r["pid"] for r in rows]


def most_at_once(rows: list[dict[str, Any]]) -> int:
    """The most tasks whose [started_at, completed_at] overlapped at one moment."""
    events = sorted([(r["started_at"], 1) for r in rows] + [(r["completed_at"], -1) for r in rows])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def rows_of(db: psycopg.Connection[Any], handles: list[Any]) -> list[dict[str, Any]]:
    return [task_row(db, h.id) for h in handles]


@pytest.mark.smoke
@pytest.mark.timing
def test_ten_half_second_naps_run_at_once_in_one_process(
    aio: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, *ONE_ASYNC_CHILD)
    tokens = [token() for _ in range(10)]
    handles = aio.nap.send_many([(0.5, t) for t in tokens])
    # Read from the rows, not with get(): a get() flags its row for a notification with an
    # UPDATE, and a claim running at that moment skips the locked row until the next poll.
    wait_until(lambda: all(task_row(db, h.id)["status"] == "COMPLETED" for h in handles), message="10 naps")
    pids = {task_row(db, h.id)["result"]["ok"] for h in handles}
    assert len(pids) == 1, pids  # one process ran them all...
    assert set(ledger_pids(db, tokens)) == pids
    rows = rows_of(db, handles)
    span = max(r["completed_at"] for r in rows) - min(r["started_at"] for r in rows)
    assert span.total_seconds() < 2.5, span  # ...at once: one after another takes 5 s or more
    assert most_at_once(rows) == 10, sorted(
        (r["claimed_at"], r["started_at"], r["completed_at"]) for r in rows
    )
    (pid,) = pids
    for row in rows:  # the process that ran each task recorded its outcome
        (attempt,) = attempt_rows(db, row["id"])
        assert (row["status"], attempt["outcome"], attempt["pid"]) == ("COMPLETED", "COMPLETED", pid)
        assert attempt["worker_id"] == worker.worker_id


def test_a_child_runs_no_more_than_its_concurrency(
    aio: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    workers.start(APP, *ONE_ASYNC_CHILD, "--async-concurrency", "3")
    handles = aio.nap.send_many([(0.3,)] * 9)
    for handle in handles:
        assert handle.get(timeout=WAIT).is_ok
    rows = rows_of(db, handles)
    assert most_at_once(rows) == 3
    span = max(r["completed_at"] for r in rows) - min(r["started_at"] for r in rows)
    assert span.total_seconds() >= 0.9, span  # three rounds of three


@pytest.mark.smoke
def test_a_worker_runs_each_kind_in_its_own_children(
    aio: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--processes", "1")  # async children: 1, by default
    wait_until(lambda: len(worker.task_children()) == 2, message="one sync and one async child")
    sync_tokens, async_tokens = [token() for _ in range(3)], [token() for _ in range(3)]
    sync_handles = [aio.double.send(i, t) for i, t in enumerate(sync_tokens)]
    async_handles = aio.nap.send_many([(0.05, t) for t in async_tokens])
    assert [h.get(timeout=WAIT).ok for h in sync_handles] == [0, 2, 4]
    assert all(h.get(timeout=WAIT).is_ok for h in async_handles)
    (sync_pid,) = set(ledger_pids(db, sync_tokens))
    (async_pid,) = set(ledger_pids(db, async_tokens))
    assert sync_pid != async_pid
    assert {sync_pid, async_pid} == {p.pid for p in worker.task_children()}
    registered = db.execute(
        "SELECT processes, async_processes, async_concurrency FROM tether_workers WHERE id = %s",
        (worker.worker_id,),
    ).fetchone()
    assert registered == {"processes": 1, "async_processes": 1, "async_concurrency": 100}


def test_a_worker_without_sync_children_runs_a_sync_task_in_a_thread_of_its_async_child(
    aio: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, *ONE_ASYNC_CHILD)
    tok = token()
    assert aio.double.send(21, tok).get(timeout=WAIT).ok == 42
    (pid,) = ledger_pids(db, [tok])
    assert [p.pid for p in worker.task_children()] == [pid]


@pytest.mark.smoke
def test_each_task_sees_itself_as_current_task_among_many(
    aio: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    workers.start(APP, *ONE_ASYNC_CHILD)
    handles = aio.whoami.send_many([(0.2,)] * 20)
    for handle in handles:
        seen = handle.get(timeout=WAIT).ok
        assert seen == {"before": str(handle.id), "after": str(handle.id), "thread": str(handle.id)}
        row = task_row(db, handle.id)
        assert row["progress"]["stage"] == "started" and row["progress_at"] is not None


def test_an_exception_fails_only_its_own_task_with_its_traceback(
    aio: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    workers.start(APP, *ONE_ASYNC_CHILD)
    failing = aio.boom.send("bad input 7")
    napping = aio.nap.send_many([(0.2,)] * 5)
    err = failing.get(timeout=WAIT).err
    assert err is not None and err.code == "UNHANDLED_EXCEPTION"
    assert err.message == "ValueError: bad input 7"
    assert "raise ValueError(message)" in err.data["traceback"]
    assert all(h.get(timeout=WAIT).is_ok for h in napping)


@pytest.mark.smoke
@pytest.mark.timing
def test_a_time_limit_cancels_the_coroutine_and_the_child_goes_on(
    aio: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, *ONE_ASYNC_CHILD)
    wait_until(lambda: len(worker.task_children()) == 1, message="the async child")
    (child,) = worker.task_children()
    limited = aio.limited.send(30)
    napping = aio.nap.send_many([(1.5,)] * 5)
    err = limited.get(timeout=WAIT).err
    assert err is not None and err.code == "TIME_LIMIT_EXCEEDED"
    assert "time limit of 0.5s; it was cancelled" in err.message
    row = task_row(db, limited.id)
    ran = (row["failed_at"] - row["started_at"]).total_seconds()
    assert 0.5 <= ran < 1.5, ran
    assert all(h.get(timeout=WAIT).is_ok for h in napping)  # its neighbours were not touched
    assert [p.pid for p in worker.task_children()] == [child.pid]  # nor was the process


@pytest.mark.smoke
@pytest.mark.timing
def test_a_task_that_ignores_its_cancellation_has_its_child_killed_after_the_grace(
    aio: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, *ONE_ASYNC_CHILD, env={"TETHER_WORKER_CANCEL_GRACE_S": "1"})
    wait_until(lambda: len(worker.task_children()) == 1, message="the async child")
    (child,) = worker.task_children()
    stubborn = aio.stubborn.send()
    napping = aio.nap.send_many([(30,)] * 3)
    err = stubborn.get(timeout=WAIT).err
    assert err is not None and err.code == "TIME_LIMIT_EXCEEDED"
    assert "did not end within 1s of being cancelled and its process was killed" in err.message
    row = task_row(db, stubborn.id)
    assert 1.5 <= (row["failed_at"] - row["started_at"]).total_seconds() < 4
    for handle in napping:  # the same process ran them: recorded as crashed, by their policy
        other = handle.get(timeout=WAIT).err
        assert other is not None and other.code == "WORKER_CRASHED"
        assert "overran its time limit" in other.message and str(stubborn.id) in other.message
    assert aio.nap.send(0.01).get(timeout=WAIT).is_ok  # a new child runs the next task
    assert child.pid not in [p.pid for p in worker.task_children()]


@pytest.mark.smoke
def test_a_graceful_stop_finishes_what_runs_and_gives_back_what_never_started(
    aio: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, *ONE_ASYNC_CHILD, "--async-concurrency", "5")
    handles = aio.nap.send_many([(1.5,)] * 12)
    wait_until(
        lambda: sum(task_row(db, h.id)["status"] == "RUNNING" for h in handles) == 5,
        message="five tasks running",
    )
    worker.proc.send_signal(signal.SIGTERM)
    assert worker.proc.wait(WAIT) == 0, worker.log()
    rows = rows_of(db, handles)
    statuses = sorted(r["status"] for r in rows)
    assert statuses == ["COMPLETED"] * 5 + ["PENDING"] * 7, statuses
    for row in rows:
        if row["status"] == "PENDING":  # never started: no attempt row, no owner
            assert attempt_rows(db, row["id"]) == [] and row["claimed_by_worker_id"] is None
    # The child held 5 beyond its 5 running (its prefetch) and gave them back; the worker's
    # capacity is 10, so the last 2 were never claimed.
    assert "gave back 5 task(s) that never started" in worker.log()
