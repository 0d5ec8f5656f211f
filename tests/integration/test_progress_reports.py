"""Progress reports from async tasks hold up nothing else of their async child.

An async child runs many tasks in one event loop. A progress report is a database write
that can wait (here: another session holds the reporting tasks' rows, so each report's
UPDATE waits for that lock). Whichever form the task uses, ``report_progress()`` or
``await report_progress_async()``, the child's other tasks go on meanwhile: a task sent
while the reports wait is claimed, started, run and recorded by the same child, with
database timestamps to show it happened while the reports waited. Then every report
lands on its row (``progress``, ``progress_at``), counts as the task's latest heartbeat,
and the call returns True.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import ensure_ledger, load_app_module, task_row
from tests.conftest import WorkerFactory, wait_until

APP = "tests.apps.gates:app"
ONE_ASYNC_CHILD = ("--processes", "0", "--async-processes", "1")
# Heartbeats every two minutes (the longest interval allowed): the worker writes no runner
# heartbeat for the tasks of this test, so a task's latest heartbeat is its progress report.
SLOW_BEATS = {
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "120000",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "120000",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "240000",
}
REPORTERS = 4
WAIT = 30.0
PROGRESS = {"stage": "half", "progress": 0.5, "message": "halfway"}

Conn = psycopg.Connection[Any]


@pytest.fixture
def gates(database_url: str, db: Conn) -> ModuleType:
    ensure_ledger(db)
    return load_app_module("gates", database_url)


def reports_waiting_for_a_lock(db: Conn) -> int:
    row = db.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND query ILIKE '%%progress%%'"
    ).fetchone()
    assert row is not None
    return int(row["n"])


@pytest.mark.parametrize("form", ["sync", "async"])
def test_progress_reports_of_async_tasks_hold_up_no_other_task_of_their_child(
    gates: ModuleType, database_url: str, db: Conn, workers: WorkerFactory, form: str
) -> None:
    from tests.apps.gate_locks import hold_gate

    worker = workers.start(APP, *ONE_ASYNC_CHILD, env=SLOW_BEATS)
    go, end = secrets.randbits(62), secrets.randbits(62)
    with hold_gate(database_url, go) as go_gate, hold_gate(database_url, end) as end_gate:
        reporters = gates.reporter.send_many([(go, end, form)] * REPORTERS)
        ids = [h.id for h in reporters]
        wait_until(
            lambda: all(task_row(db, i)["status"] == "RUNNING" for i in ids),
            WAIT,
            message=f"{REPORTERS} reporters running at once in the async child",
        )

        # Another session holds the reporters' rows: their reports wait for it.
        with psycopg.connect(database_url) as holder:
            holder.execute("SELECT id FROM tether_tasks WHERE id = ANY(%s) FOR UPDATE", (ids,))
            go_gate.open()
            wait_until(lambda: reports_waiting_for_a_lock(db) >= 1, WAIT, message="a report waiting")

            # Meanwhile the child takes, runs and records another task.
            tok = uuid.uuid4().hex
            other = gates.record_async.send(tok)
            result = other.get(timeout=15)
            assert result.is_ok and result.ok == tok, (result, worker.log_tail())
            row = holder.execute("SELECT clock_timestamp()").fetchone()
            assert row is not None
            released_at = row[0]
            holder.rollback()

        other_row = task_row(db, other.id)
        assert other_row["completed_at"] < released_at  # done before any report could be written

        # The reports land once the rows are free, each as its task's latest heartbeat.
        wait_until(
            lambda: all(task_row(db, i)["progress"] is not None for i in ids), WAIT, message="the reports"
        )
        rows = [task_row(db, i) for i in ids]
        for r in rows:
            assert r["progress"] == PROGRESS, r
            assert r["started_at"] < r["progress_at"] and r["status"] == "RUNNING", r
        # progress_at is when its UPDATE began: the first report was already waiting when the
        # other task started, and that task ended before the report could be written.
        first_report = min(r["progress_at"] for r in rows)
        assert first_report < other_row["started_at"] < other_row["completed_at"] < released_at
        stale = asyncio.run(gates.app.broker.get_stale_tasks(stale_threshold_minutes=1e-6))
        last_heartbeat = {str(s.id): s.last_heartbeat_at for s in stale}
        assert all(last_heartbeat[str(r["id"])] == r["progress_at"] for r in rows), (last_heartbeat, rows)

        end_gate.open()
        assert [h.get(timeout=WAIT).ok for h in reporters] == [True] * REPORTERS
    assert worker.stop() == 0, worker.log_tail()
    assert "Traceback" not in worker.log(), worker.log_tail()


def test_both_forms_check_their_arguments_alike_and_say_when_the_task_is_no_longer_ours(
    gates: ModuleType, database_url: str, db: Conn, workers: WorkerFactory
) -> None:
    from tests.apps.gate_locks import hold_gate

    workers.start(APP, *ONE_ASYNC_CHILD, env=SLOW_BEATS)
    go, tok = secrets.randbits(62), uuid.uuid4().hex
    with hold_gate(database_url, go) as gate:
        handle = gates.progress_checks.send(go, tok)
        wait_until(lambda: task_row(db, handle.id)["status"] == "RUNNING", WAIT, message="the task to run")
        # As if it had been recovered and claimed by another worker meanwhile.
        db.execute(
            "UPDATE tether_tasks SET attempt = attempt + 1, claimed_by_worker_id = 'another-worker'"
            " WHERE id = %s",
            (handle.id,),
        )
        gate.open()

        def findings() -> dict[str, Any] | None:
            row = db.execute(
                "SELECT token FROM tether_test_ledger WHERE token LIKE %s", (f"{tok} %",)
            ).fetchone()
            return None if row is None else dict(json.loads(row["token"].split(" ", 1)[1]))

        found = wait_until(findings, WAIT, message="the task's findings")
    assert (
        found["errors"]["sync"]
        == found["errors"]["async"]
        == [
            "report_progress: stage must be a non-empty string, got ''",
            "report_progress: progress must be a number from 0.0 to 1.0, got 1.5",
            "report_progress: progress must be a number from 0.0 to 1.0, got True",
            "report_progress: message must be a string, got int",
        ]
    )
    assert (found["async"], found["sync_in_a_thread"], found["sync_on_the_loop"]) == (False, False, False)
    assert task_row(db, handle.id)["progress"] is None  # nothing was stored for the lost task


def test_outside_a_worker_both_forms_raise() -> None:
    from tether import report_progress, report_progress_async

    with pytest.raises(RuntimeError, match="only be called from inside a task"):
        report_progress("stage")
    with pytest.raises(RuntimeError, match="only be called from inside a task"):
        asyncio.run(report_progress_async("stage"))
