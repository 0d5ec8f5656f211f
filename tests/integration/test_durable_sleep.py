"""Durable sleep (docs/durable-steps.md#durable-sleep) with real workers and real kills.

A sleeping task ends its attempt and gives its slot back (PENDING with a due time, a
SUSPENDED attempt row); it resumes on any worker within 1 s of its due time, skipping its
completed steps and the sleep itself; a sleep counts no retry, survives the death of every
worker, can be cancelled, and a frozen attempt recovered elsewhere cannot suspend.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import attempt_rows, load_app_module, task_row
from tests.chaos.conftest import FAST, check_history, ensure_chaos_ledger, runs, token, wait_status
from tests.chaos.conftest import stopped_groups as stopped_groups  # the fixture, for the freeze
from tests.cli_support import run, run_json
from tests.conftest import WorkerFactory, wait_until
from tests.integration.test_steps_view import call, serve
from tether import TaskSuspension

APP = "tests.apps.sleeps:app"
ONE_CHILD = ("--processes", "1", "--async-processes", "0")
ASYNC_ONLY = ("--processes", "0", "--async-processes", "1")
#: How late a task may resume after its due time on an idle worker (the issue's bound).
WAKE_BOUND_S = 1.0

Conn = psycopg.Connection[Any]


@pytest.fixture
def sleeps(database_url: str, db: Conn) -> ModuleType:
    ensure_chaos_ledger(db)
    db.execute("TRUNCATE tether_chaos_ledger")
    return load_app_module("sleeps", database_url)


def stored(db: Conn, task_id: Any) -> list[tuple[str, int, int]]:
    """(name, occurrence, attempt) of each stored step, in the order recorded."""
    rows = db.execute(
        "SELECT name, occurrence, attempt FROM tether_task_steps WHERE task_id = %s"
        " ORDER BY written_at, name",
        (task_id,),
    ).fetchall()
    return [(r["name"], r["occurrence"], r["attempt"]) for r in rows]


def suspended(db: Conn, task_id: Any, count: int = 1) -> dict[str, Any]:
    """Wait until the task is PENDING after its ``count``-th suspension; its SUSPENDED attempt row."""

    def seen() -> dict[str, Any] | None:
        rows = [a for a in attempt_rows(db, task_id) if a["outcome"] == "SUSPENDED"]
        return rows[-1] if len(rows) >= count and task_row(db, task_id)["status"] == "PENDING" else None

    return wait_until(seen, timeout=30, message=f"task {task_id} to be suspended")  # type: ignore[no-any-return]


def lateness(db: Conn, task_id: Any) -> list[float]:
    """Seconds from each suspension's due time to the start of the attempt that followed it."""
    attempts = attempt_rows(db, task_id)
    return [
        (after["started_at"] - before["resume_at"]).total_seconds()
        for before, after in itertools.pairwise(attempts)
        if before["outcome"] == "SUSPENDED"
    ]


@pytest.mark.timing
def test_a_sleeping_task_gives_its_slot_back_and_resumes_on_time(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    worker = workers.start(APP, *ONE_CHILD)
    tok = token()
    handle = sleeps.nap.send(tok, 3)
    sleep_row = suspended(db, handle.id)
    row = task_row(db, handle.id)
    assert row["claimed_by_worker_id"] is None and row["run_at"] == sleep_row["resume_at"]
    assert row["retry_count"] == 0 and not sleep_row["will_retry"]
    # The worker's one process is free: another task runs (and ends) while the first sleeps.
    other = sleeps.quick.send(tok)
    assert other.get(timeout=10).ok == "quick"
    assert task_row(db, handle.id)["status"] == "PENDING"

    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    row, attempts = check_history(db, handle.id)
    assert [(a["outcome"], a["worker_id"]) for a in attempts] == [
        ("SUSPENDED", worker.worker_id),
        ("COMPLETED", worker.worker_id),
    ]
    first, second = (a["attempt"] for a in attempts)
    assert row["result"] == {"ok": {"sum": 3, "attempt": second, "retry_count": 0}}
    assert [runs(db, f"{tok}:{s}") for s in ("before", "after")] == [1, 1]
    assert stored(db, handle.id) == [("before", 0, first), ("tether.sleep", 0, first), ("after", 0, second)]
    # Slept its 3 s (database time), and woke within the bound of its due time.
    assert sleep_row["resume_at"] - sleep_row["finished_at"] >= timedelta(seconds=2.99)
    (late,) = lateness(db, handle.id)
    assert 0 <= late < WAKE_BOUND_S, late


@pytest.mark.timing
def test_a_sleeping_task_holds_no_slot_of_a_concurrency_limit(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    """Queue "one" lets one task be in flight (limited claims, docs/limits.md): while the first
    sleeps, another runs to its end; then the first resumes on time."""
    workers.start(APP, "--processes", "2", "--async-processes", "0", "--queues", "one")
    tok = token()
    handle = sleeps.nap.with_options(queue="one").send(tok, 3)
    suspended(db, handle.id)
    other = sleeps.quick.with_options(queue="one").send(tok)
    assert other.get(timeout=10).ok == "quick"
    assert task_row(db, handle.id)["status"] == "PENDING"
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    (late,) = lateness(db, handle.id)
    assert 0 <= late < WAKE_BOUND_S, late


@pytest.mark.timing
def test_a_sleep_survives_the_death_of_every_worker(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    a = workers.start(APP, *ONE_CHILD, env=FAST)
    tok = token()
    handle = sleeps.nap.send(tok, 3)
    suspended(db, handle.id)
    a.kill()  # SIGKILL to A's whole process group: no worker is left
    b = workers.start(APP, *ONE_CHILD, env=FAST)

    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    row, attempts = check_history(db, handle.id)
    assert [(x["outcome"], x["worker_id"]) for x in attempts] == [
        ("SUSPENDED", a.worker_id),
        ("COMPLETED", b.worker_id),
    ]
    assert [runs(db, f"{tok}:{s}") for s in ("before", "after")] == [1, 1]  # once, no step repeated
    assert row["retry_count"] == 0


@pytest.mark.timing
def test_sleeps_count_no_retry(sleeps: ModuleType, db: Conn, workers: WorkerFactory) -> None:
    """Three sleeps (one name in a loop), then an error retried once: its one retry is still there."""
    workers.start(APP, *ONE_CHILD)
    tok = token()
    handle = sleeps.naps_then_fails_once.send(tok, 3, 0.2)
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    row, attempts = check_history(db, handle.id)
    assert [(a["outcome"], a["will_retry"]) for a in attempts] == [
        ("SUSPENDED", False),
        ("SUSPENDED", False),
        ("SUSPENDED", False),
        ("FAILED", True),
        ("COMPLETED", False),
    ]
    assert row["retry_count"] == 1
    assert row["result"]["ok"]["retry_count"] == 1
    assert [runs(db, f"{tok}:nap{i}") for i in range(3)] == [1, 1, 1]
    names = [(name, occurrence) for name, occurrence, _ in stored(db, handle.id)]
    assert [n for n in names if n[0] == "tether.sleep"] == [("tether.sleep", i) for i in range(3)]
    assert all(0 <= late < WAKE_BOUND_S for late in lateness(db, handle.id)), lateness(db, handle.id)


def test_a_sleeping_task_is_shown_sleeping_and_can_be_cancelled(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory, database_url: str
) -> None:
    workers.start(APP, *ONE_CHILD)
    tok = token()
    handle = sleeps.nap.send(tok, 60)
    row = suspended(db, handle.id)
    until = row["resume_at"].isoformat(sep=" ", timespec="seconds")
    state = f"sleeping until {until} (after step 'before')"
    shown = run_json(database_url, "task", str(handle.id))
    assert (shown["status"], shown["suspension"]["state"]) == ("PENDING", state)
    assert f"Suspended: {state}" in " ".join(run(database_url, "task", str(handle.id)).output.split())
    listed = run(database_url, "tasks", "--status", "pending").output
    assert "PENDING:" in listed and "sleeping" in listed, listed  # a narrow table wraps the rest
    assert handle.cancel()
    row = wait_status(db, handle.id, "CANCELLED", timeout=10)
    assert row["error_code"] == "TASK_CANCELLED"
    assert [runs(db, f"{tok}:{s}") for s in ("before", "after")] == [1, 0]


def test_info_and_the_dashboard_show_the_sleep_until_the_task_completes(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    """handle.info() (sync and async) and /api/tasks/<id> give the current sleep, read by the
    statement tether task ID reads it with; once the task completed, None."""
    workers.start(APP, *ONE_CHILD)
    handle = sleeps.nap.send(token(), 5)
    row = suspended(db, handle.id)
    state = f"sleeping until {row['resume_at'].isoformat(sep=' ', timespec='seconds')} (after step 'before')"
    expected = TaskSuspension(str(handle.id), row["resume_at"], None, False, None, "before")
    server = serve(sleeps.app.broker, "sleepview-" + token())
    try:
        info = handle.info()
        assert info.status == "PENDING" and info.suspension == expected, info.suspension
        assert info.suspension.kind == "sleep" and info.suspension.describe() == state
        assert asyncio.run(handle.info_async()).suspension == expected
        code, page = call(server, f"api/tasks/{handle.id}")
        assert code == 200, page
        assert page["task"]["suspension"]["kind"] == "sleep"
        assert page["task"]["suspension"]["state"] == state
        assert page["task"]["suspension"]["after_step"] == "before"
        assert datetime.fromisoformat(page["task"]["suspension"]["run_at"]) == row["resume_at"]

        assert wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)["status"] == "COMPLETED"
        assert handle.info().suspension is None
        code, page = call(server, f"api/tasks/{handle.id}")
        assert (code, page["task"]["status"], page["task"]["suspension"]) == (200, "COMPLETED", None)
    finally:
        server.shutdown()
        server.server_close()


def test_bad_sleeps_and_waits_are_refused_naming_the_argument(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    workers.start(APP, *ONE_CHILD)
    handle = sleeps.bad_waits.send()
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    assert row["result"]["ok"] == [
        "StepError: sleep: seconds must be between 0 and 3.16224e+07 seconds (366 days), got -1",
        "StepError: sleep: seconds must be a number of seconds or a timedelta, got str",
        "EventError: wait_for_event: key must be a non-empty string of at most 200 characters, got ''",
        "StepError: wait_for_event: timeout must be between 0 and 3.16224e+07 seconds (366 days), got -5",
        "EventError: wait_for_event: key 'two\\nlines' contains control characters",
    ]
    assert [a["outcome"] for a in attempt_rows(db, handle.id)] == ["COMPLETED"]  # nothing suspended


@pytest.mark.timing
def test_async_tasks_sleep_in_the_async_executor(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    worker = workers.start(APP, *ASYNC_ONLY)
    tok = token()
    handle = sleeps.nap_async.send(tok, 1)
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    attempts = attempt_rows(db, handle.id)
    assert [(a["outcome"], a["worker_id"]) for a in attempts] == [
        ("SUSPENDED", worker.worker_id),
        ("COMPLETED", worker.worker_id),
    ]
    assert row["result"] == {"ok": {"sum": 3, "attempt": attempts[1]["attempt"]}}
    assert [runs(db, f"{tok}:{s}") for s in ("before", "after")] == [1, 1]
    (late,) = lateness(db, handle.id)
    assert 0 <= late < WAKE_BOUND_S, late


@pytest.mark.timing
def test_a_frozen_attempt_cannot_suspend_after_its_task_was_recovered(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory, stopped_groups: list[int]
) -> None:
    """A is frozen (SIGSTOP) before its task's sleep; B's reaper retries the task (WORKER_CRASHED)
    and runs it to the end. A's child, continued, reaches the sleep: its suspension is fenced."""
    hold_s = 5.0
    a = workers.start(APP, *ONE_CHILD, env=FAST)
    tok = token()
    handle = sleeps.held_nap.send(tok, hold_s, 0.5)
    wait_until(lambda: runs(db, f"{tok}:held") == 1, timeout=30, message="the task to hold before its sleep")
    zombie = db.execute("SELECT pid FROM tether_chaos_ledger WHERE token = %s", (f"{tok}:held",)).fetchone()[
        "pid"
    ]
    b = workers.start(APP, *ONE_CHILD, env=FAST)
    os.killpg(a.pid, signal.SIGSTOP)
    stopped_groups.append(a.pid)

    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED" and row["claimed_by_worker_id"] == b.worker_id, row
    first = attempt_rows(db, handle.id)[0]
    assert (first["outcome"], first["error_code"]) == ("FAILED", "WORKER_CRASHED")
    before = (task_row(db, handle.id), attempt_rows(db, handle.id), stored(db, handle.id))

    # Wake only A's child: its hold ends and it reaches the sleep, as attempt `first` of a task
    # now COMPLETED under another attempt. Its suspension matches nothing and changes nothing.
    os.kill(zombie, signal.SIGCONT)
    lost = rf"WARNING .*lost task {handle.id} \(held_nap\) attempt {first['attempt']}: could not suspend"
    try:
        wait_until(lambda: re.search(lost, a.log()), timeout=15, message="A's child to lose its suspension")
    except AssertionError:
        raise AssertionError(f"A's log:\n{a.log()}") from None
    assert (task_row(db, handle.id), attempt_rows(db, handle.id), stored(db, handle.id)) == before
