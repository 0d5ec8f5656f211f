"""Seeds 002 ("Worker Heartbeat and Job Recovery") and 003 ("Worker Heartbeat Monitoring").

Their code is another system's (Node.js against a ``jobs`` table, a Rust executor against
a ``worker`` table), so what runs here is the behaviour each example shows, with real
workers: the worker identity ``hostname-pid-random``; one claim per task however many
workers race; progress counting as a heartbeat; startup reconciliation of a worker killed
on the same host; a silent worker marked inactive with the seed's log lines; and seed
003's monitoring and cleanup SQL, written against ``tether_workers``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest

from tests.apps.support import attempt_rows, task_row
from tests.chaos.conftest import APP, FAST, runs, token, wait_all, wait_status, worker_row
from tests.conftest import WorkerFactory, wait_until
from tests.seeds.conftest import age_rows

pytestmark = pytest.mark.usefixtures("db")

# Seed 003's queries; the seed's table and columns are tether_workers': name is id,
# worker_role is queues (what work a worker takes), last_heartbeat is last_heartbeat_at,
# updated is updated_at.
ACTIVE_WORKERS_SQL = """
SELECT id AS name, queues AS worker_role, status, last_heartbeat_at AS last_heartbeat
FROM tether_workers
WHERE status = 'active'
ORDER BY last_heartbeat_at DESC;
"""
RECENT_DEACTIVATIONS_SQL = """
SELECT id AS name, queues AS worker_role, status, last_heartbeat_at AS last_heartbeat, updated_at AS updated
FROM tether_workers
WHERE status = 'inactive'
  AND updated_at > NOW() - INTERVAL '5 minutes'
ORDER BY updated_at DESC;
"""
COUNT_BY_STATUS_SQL = """
SELECT status, COUNT(*)
FROM tether_workers
GROUP BY status;
"""
DELETE_OLD_INACTIVE_SQL = """
-- Delete inactive workers older than 7 days
DELETE FROM tether_workers
WHERE status = 'inactive'
  AND updated_at < NOW() - INTERVAL '7 days';
"""


def test_a_worker_is_named_hostname_pid_random(db: Any, workers: WorkerFactory) -> None:
    a = workers.start(APP, "--processes", "1", env=FAST)
    b = workers.start(APP, "--processes", "1", env=FAST)
    for worker in (a, b):
        assert worker.worker_id is not None
        assert re.fullmatch(
            rf"{re.escape(socket.gethostname())}-{worker.pid}-[0-9a-f]{{8}}", worker.worker_id
        )
        row = worker_row(db, worker.worker_id)
        assert (row["hostname"], row["pid"]) == (socket.gethostname(), worker.pid)
    assert a.worker_id != b.worker_id


def test_racing_workers_claim_each_task_once(db: Any, chaos: ModuleType, workers: WorkerFactory) -> None:
    for _ in range(3):
        workers.start(APP, "--processes", "2", env=FAST)
    work = chaos.app.tasks["work"]
    tokens = [token() for _ in range(300)]
    handles = work.send_many([(t,) for t in tokens])
    wait_all(db, [h.id for h in handles], {"COMPLETED"}, timeout=60)
    counts = db.execute(
        "SELECT token, count(*) AS n FROM tether_chaos_ledger WHERE token = ANY(%s) GROUP BY token", (tokens,)
    ).fetchall()
    assert len(counts) == 300 and {r["n"] for r in counts} == {1}  # each ran once
    owners = db.execute(
        "SELECT count(DISTINCT claimed_by_worker_id) AS n, max(attempt) AS attempts FROM tether_tasks"
        " WHERE id = ANY(%s::uuid[])",
        ([str(h.id) for h in handles],),
    ).fetchone()
    assert owners["attempts"] == 1 and owners["n"] >= 2  # spread over workers, one claim each


def test_progress_counts_as_a_heartbeat(
    db: Any, chaos: ModuleType, workers: WorkerFactory, stopped_groups: list[int]
) -> None:
    """updateProgress() 'also updates the heartbeat': a report keeps a task from looking stale."""
    worker = workers.start(APP, "--processes", "1", env=FAST)
    hold = chaos.app.tasks["hold"]
    running = hold.send(token(), 60)
    wait_status(db, running.id, "RUNNING")
    # The worker frozen, and none of its statements still running on the server: no heartbeat
    # of its can land after the times are moved back (a live worker's next beat, 1 s later,
    # made the task fresh again between the two checks below in CI).
    os.killpg(worker.pid, signal.SIGSTOP)
    stopped_groups.append(worker.pid)
    wait_until(
        lambda: (
            db.execute(
                "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND state = 'active' AND backend_type = 'client backend'"
            ).fetchone()["n"]
            == 0
        ),
        timeout=10,
        message="the frozen worker's statements to end",
    )
    # Ten minutes of silence from start and heartbeats, but progress reported just now.
    age_rows(db, [running.id], timedelta(minutes=10))
    db.execute(
        'UPDATE tether_tasks SET progress = \'{"stage": "clone"}\', progress_at = now() WHERE id = %s',
        (running.id,),
    )
    broker = chaos.app.get_broker()
    assert [t.id for t in broker.get_stale_tasks_sync(stale_threshold_minutes=5)] == []
    # Without it, the same task is stale.
    db.execute(
        "UPDATE tether_tasks SET progress_at = now() - interval '10 minutes' WHERE id = %s", (running.id,)
    )
    assert [t["id"] for t in broker.get_stale_tasks_sync(stale_threshold_minutes=5)] == [running.id]


def test_startup_reconciliation_recovers_a_killed_worker_on_this_host_at_once(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    """Scenario 1: a pod restart. The new worker finds the old one's tasks at start, long
    before any stale threshold (here the defaults: 2 and 5 minutes)."""
    hold = chaos.app.tasks["hold"]
    old = workers.start(APP, "--processes", "1", "--prefetch", "1")
    t_running = token()
    running = hold.send(t_running, 60)
    wait_status(db, running.id, "RUNNING")
    # RUNNING is written before the child starts the code: wait for the code's own row, or a
    # kill in between leaves a crashed task whose code never ran.
    wait_until(lambda: runs(db, t_running) == 1, message="the held task's code to start")
    claimed = hold.send(token(), 0)
    wait_status(db, claimed.id, "CLAIMED")
    old.kill()
    new = workers.start(APP, "--processes", "1")
    wait_status(db, running.id, "FAILED", timeout=15)
    wait_status(db, claimed.id, "COMPLETED", timeout=15)  # requeued, run by the new worker
    row = task_row(db, running.id)
    assert row["error_code"] == "WORKER_CRASHED" and runs(db, t_running) == 1
    assert [a["outcome"] for a in attempt_rows(db, running.id)] == ["FAILED"]
    assert task_row(db, claimed.id)["claimed_by_worker_id"] == new.worker_id
    assert worker_row(db, old.worker_id)["status"] == "inactive"
    assert f"worker {old.worker_id} is gone" in new.log()
    assert "startup reconciliation: 1 worker(s) marked inactive, 1 task(s) requeued, 0 retried, 1 failed" in (
        new.log()
    )


def test_a_silent_worker_is_marked_inactive_with_the_seeds_log_lines(
    db: Any, workers: WorkerFactory, stopped_groups: list[int]
) -> None:
    watcher = workers.start(APP, "--processes", "1", env=FAST)
    silent = workers.start(APP, "--processes", "1", env=FAST)
    rows = db.execute(ACTIVE_WORKERS_SQL).fetchall()
    assert {r["name"] for r in rows} == {watcher.worker_id, silent.worker_id}
    assert all(r["worker_role"] == ["default"] and r["status"] == "active" for r in rows)
    assert [r["last_heartbeat"] for r in rows] == sorted((r["last_heartbeat"] for r in rows), reverse=True)

    os.killpg(silent.pid, signal.SIGSTOP)  # alive, but its heartbeats stop
    stopped_groups.append(silent.pid)
    wait_until(
        lambda: worker_row(db, silent.worker_id)["status"] == "inactive",
        timeout=20,
        message="the watcher's reaper to mark the silent worker inactive (3 heartbeat intervals)",
    )
    log = watcher.log()
    line = re.search(
        rf"worker {re.escape(silent.worker_id)} \(host {re.escape(socket.gethostname())}, pid {silent.pid}\)"
        r" heartbeat is stale \((\d+)s old\), marking it inactive",
        log,
    )
    assert line is not None, log[-3000:]
    assert int(line.group(1)) >= 3  # 3 x the 1 s heartbeat interval
    assert "deactivated 1 worker(s) with stale heartbeats" in log

    recent = db.execute(RECENT_DEACTIVATIONS_SQL).fetchall()
    assert [r["name"] for r in recent] == [silent.worker_id]
    assert {r["status"]: r["count"] for r in db.execute(COUNT_BY_STATUS_SQL)} == {"active": 1, "inactive": 1}


def test_a_stopped_worker_says_so_and_old_inactive_workers_are_deleted(
    db: Any, workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--processes", "1", env=FAST)
    assert worker.stop() == 0
    assert worker_row(db, worker.worker_id)["status"] == "stopped"  # graceful shutdown: marked at once
    db.execute(
        "INSERT INTO tether_workers (id, hostname, pid, queues, processes, status, updated_at) VALUES"
        " ('old-1-aa', 'old', 1, '{default}', 1, 'inactive', now() - interval '8 days'),"
        " ('new-1-bb', 'new', 1, '{default}', 1, 'inactive', now() - interval '6 days')"
    )
    with db.cursor() as cur:
        cur.execute(DELETE_OLD_INACTIVE_SQL)
        assert cur.rowcount == 1
    left = {r["id"] for r in db.execute("SELECT id FROM tether_workers")}
    assert left == {worker.worker_id, "new-1-bb"}
