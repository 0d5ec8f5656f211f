"""Many workers on one queue: every task runs exactly once, none is lost, none runs twice."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from tests.apps.support import ensure_ledger, load_app_module
from tests.conftest import WorkerFactory, wait_until

N_TASKS = 2_000
N_WORKERS = 3


@pytest.mark.timeout(60)
def test_three_workers_run_2000_tasks_exactly_once(
    db: psycopg.Connection[Any], database_url: str, workers: WorkerFactory
) -> None:
    basic = load_app_module("basic", database_url)
    ensure_ledger(db)
    started = [
        workers.start("tests.apps.basic:app", "--processes", "2", wait=False) for _ in range(N_WORKERS)
    ]
    for worker in started:
        worker.worker_id = workers.wait_registered(worker)

    prefix = uuid.uuid4().hex
    tokens = [f"{prefix}-{i}" for i in range(N_TASKS)]
    handles = basic.record.send_many([(t,) for t in tokens])
    ids = [h.id for h in handles]
    assert len(set(ids)) == N_TASKS

    def completed() -> bool:
        row = db.execute(
            "SELECT count(*) AS n FROM tether_tasks WHERE id = ANY(%s) AND status = 'COMPLETED'", (ids,)
        ).fetchone()
        return row is not None and row["n"] == N_TASKS

    wait_until(completed, timeout=50, interval=0.2, message=f"{N_TASKS} tasks to complete")

    by_status = db.execute(
        "SELECT status, count(*) AS n, min(attempt) AS lo, max(attempt) AS hi FROM tether_tasks "
        "WHERE id = ANY(%s) GROUP BY status",
        (ids,),
    ).fetchall()
    assert by_status == [{"status": "COMPLETED", "n": N_TASKS, "lo": 1, "hi": 1}]

    ledger = db.execute(
        "SELECT count(*) AS runs, count(DISTINCT token) AS tokens FROM tether_test_ledger "
        "WHERE token LIKE %s",
        (prefix + "-%",),
    ).fetchone()
    assert ledger == {"runs": N_TASKS, "tokens": N_TASKS}  # none lost, none ran twice

    attempts = db.execute(
        "SELECT count(*) AS n, count(DISTINCT task_id) AS tasks, "
        "count(*) FILTER (WHERE outcome = 'COMPLETED' AND attempt = 1) AS good "
        "FROM tether_task_attempts WHERE task_id = ANY(%s)",
        (ids,),
    ).fetchone()
    assert attempts == {"n": N_TASKS, "tasks": N_TASKS, "good": N_TASKS}

    # The results are each task's own, and the work was shared by all the workers.
    mismatched = db.execute(
        "SELECT count(*) AS n FROM tether_tasks WHERE id = ANY(%s) AND result <> jsonb_build_object("
        "'ok', args->>0)",
        (ids,),
    ).fetchone()
    assert mismatched == {"n": 0}
    owners = {
        r["claimed_by_worker_id"]
        for r in db.execute(
            "SELECT DISTINCT claimed_by_worker_id FROM tether_tasks WHERE id = ANY(%s)", (ids,)
        ).fetchall()
    }
    assert owners == {w.worker_id for w in started}

    for worker in started:
        assert worker.stop() == 0, worker.log()
        assert "Traceback" not in worker.log(), worker.log()
