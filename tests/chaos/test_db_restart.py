"""The database server restarts in the middle of a run.

A private embedded PostgreSQL for this test alone (the others share the session's server):
a worker works through 200 short tasks, the server is stopped and started again under it,
and every task must still end by the rules: none lost, none stuck, none run twice.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.chaos.conftest import APP, FAST, check_history, migrated_for_chaos, token, wait_all
from tests.conftest import WorkerFactory, wait_until
from tether import AppConfig, PostgresConfig
from tether.db.embedded import EmbeddedServer

# The outage must stay well below the stale thresholds (nothing may be declared dead), and
# restarting the embedded server takes 0.5-1.6 s on a busy 2-core machine: thresholds of
# 6 s keep that margin whatever the load, with the usual 1 s heartbeats.
STALE_S = 6.0
RESTART_ENV = {
    **FAST,
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": str(int(STALE_S * 1000)),
    "TETHER_RUNNING_STALE_THRESHOLD_MS": str(int(STALE_S * 1000)),
}

TASKS = 200


def finished(conn: Any) -> int:
    row = conn.execute(
        "SELECT count(*) AS n FROM tether_tasks WHERE status IN ('COMPLETED', 'FAILED')"
    ).fetchone()
    return int(row["n"])


@pytest.mark.timing
def test_a_database_restart_mid_run_loses_nothing(
    private_server: EmbeddedServer, chaos: ModuleType, tmp_path: Path
) -> None:
    from tests.apps.chaos import build

    url = private_server.create_database("chaos")
    migrated_for_chaos(url)
    app = build(AppConfig(queues=["default"], broker=PostgresConfig(database_url=url)))
    factory = WorkerFactory(url, tmp_path / "private")
    (tmp_path / "private").mkdir()
    conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)
    try:
        worker = factory.start(APP, "--processes", "2", env={**RESTART_ENV, "TETHER_DATABASE_URL": url})
        plain = [token() for _ in range(TASKS // 2)]
        retried = [token() for _ in range(TASKS // 2)]
        handles = app.tasks["work"].send_many([(t, 30) for t in plain])
        handles += app.tasks["work_retry"].send_many([(t, 30) for t in retried])
        ids = [h.id for h in handles]
        wait_until(lambda: finished(conn) >= 50, timeout=30, message="50 tasks done before the restart")
        conn.close()

        t0 = time.monotonic()
        before = private_server.pid
        private_server.restart()
        outage_s = time.monotonic() - t0
        assert private_server.pid != before
        assert private_server.url("chaos") == url

        conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)
        done_at_restart = finished(conn)
        assert done_at_restart < TASKS, "the restart came too late to be mid-run"
        wait_all(
            conn,
            ids,
            {"COMPLETED", "FAILED", "CANCELLED", "EXPIRED"},
            timeout=60,
            why="every task to end after the restart",
        )

        rows = {
            str(r["id"]): r
            for r in conn.execute(
                "SELECT t.id, t.name, t.status, t.error_code, t.args->>0 AS token,"
                " (SELECT count(*) FROM tether_chaos_ledger l WHERE l.token = t.args->>0) AS runs,"
                " (SELECT count(*) FROM tether_task_attempts a WHERE a.task_id = t.id) AS attempts"
                " FROM tether_tasks t"
            ).fetchall()
        }
        assert len(rows) == TASKS
        for task_id in ids:
            check_history(conn, task_id)
        # Down for well under the running stale threshold: no worker could fence itself
        # off or be declared dead, so nothing may crash, and every task ran exactly once.
        log = worker.log()
        assert outage_s < STALE_S - 1.0, f"the restart took {outage_s:.1f}s"
        bad = [r for r in rows.values() if (r["status"], r["runs"], r["attempts"]) != ("COMPLETED", 1, 1)]
        assert not bad, (bad[:10], log[-8000:])
        assert worker.proc.poll() is None, log
        assert any(s in log for s in ("connection lost", "heartbeat failed", "listener disconnected")), log
        assert "Traceback" not in log, log

        # And it goes on: a task sent after the restart (by a fresh producer, see the test
        # below for the one that lived through the restart) completes on the same worker.
        fresh = build(AppConfig(queues=["default"], broker=PostgresConfig(database_url=url)))
        try:
            after = fresh.tasks["work"].send(token(), 0)
            assert after.get(timeout=30).is_ok
        finally:
            fresh.close()
        row = conn.execute(
            "SELECT claimed_by_worker_id FROM tether_tasks WHERE id = %s", (after.id,)
        ).fetchone()
        assert row["claimed_by_worker_id"] == worker.worker_id
        print(f"\nrestart took {outage_s:.2f}s with {done_at_restart}/{TASKS} tasks done")
    finally:
        factory.cleanup()
        conn.close()
        app.close()


def test_a_producer_can_send_and_wait_across_a_database_restart(
    private_server: EmbeddedServer, chaos: ModuleType, tmp_path: Path
) -> None:
    """The app that sends tasks lives through the restart too: its pooled connections died.

    A user's process keeps its Tether app for its whole life; after the server comes back,
    send() must work (the pool must notice dead connections and replace them), and a
    handle.get() that was waiting across the restart must still return the result.
    """
    from tests.apps.chaos import build

    url = private_server.create_database("chaos")
    migrated_for_chaos(url)
    app = build(AppConfig(queues=["default"], broker=PostgresConfig(database_url=url)))
    factory = WorkerFactory(url, tmp_path / "private")
    (tmp_path / "private").mkdir()
    try:
        factory.start(APP, "--processes", "1", env={**FAST, "TETHER_DATABASE_URL": url})
        assert app.tasks["work"].send(token(), 0).get(timeout=30).is_ok  # the pool is warm
        waiting = app.tasks["hold"].send(token(), 1.5)
        wait_until(lambda: waiting.status().value == "RUNNING", timeout=30, message="the task to run")

        private_server.restart()

        # The server is up again: a send must not fail because the pool held dead connections.
        errors = []
        handles = []
        for _ in range(3):
            try:
                handles.append(app.tasks["work"].send(token(), 0))
            except Exception as exc:  # the test reports what the user would see
                errors.append(f"{type(exc).__name__}: {exc}")
        assert not errors, f"send() after the server came back failed {len(errors)}/3 times: {errors}"
        assert waiting.get(timeout=30).is_ok
        for h in handles:
            assert h.get(timeout=30).is_ok
    finally:
        factory.cleanup()
        app.close()
