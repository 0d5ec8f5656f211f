"""The primary turns read-only on live sockets for a few seconds, under load.

What a cloud failover does to the old primary's clients: their sockets stay open, and every
write is refused with SQLSTATE 25006 (``read_only_sql_transaction``). A private embedded
PostgreSQL for this test alone (``ALTER SYSTEM`` reaches every session of its server): one
worker with 2 processes runs short tasks while a producer sends one every 10 ms; the server
is made read-only (``default_transaction_read_only``, reloaded into every live session) for
4 s, then writable again. A refused write is a lost connection (db/read_only.py): no child
dies, no task fails or runs twice, sends fail fast with an error that says why, and
everything resumes on the same processes.
"""

from __future__ import annotations

import threading
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
from tether.errors import DatabaseUnreachableError

# Far above the read-only window: nothing may be declared dead or fence itself off.
STALE_S = 20.0
ENV = {
    **FAST,
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": str(int(STALE_S * 1000)),
    "TETHER_RUNNING_STALE_THRESHOLD_MS": str(int(STALE_S * 1000)),
}
READ_ONLY_S = 4.0


def read_only(admin: psycopg.Connection[Any], on: bool) -> None:
    """Every session of the server, live ones included, gets the new default at once."""
    if on:
        admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
    else:
        admin.execute("ALTER SYSTEM RESET default_transaction_read_only")
    admin.execute("SELECT pg_reload_conf()")


class Producer(threading.Thread):
    """Sends one task every 10 ms; keeps what each send did and how long it took."""

    def __init__(self, app: Any) -> None:
        super().__init__(daemon=True)
        self.app = app
        self.stop = threading.Event()
        self.sent: list[Any] = []  # handles of acknowledged sends
        self.refused: list[tuple[float, str]] = []  # (seconds the send took, its error)

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                self.sent.append(self.app.tasks["work"].send(token(), 20))
            except DatabaseUnreachableError as exc:
                self.refused.append((time.monotonic() - t0, str(exc)))
            self.stop.wait(0.01)


# Its own servers: the outcome does not depend on the session's (one run, not two).
@pytest.mark.server_agnostic
@pytest.mark.timing
def test_a_primary_read_only_on_live_sockets_fails_nothing_and_everything_resumes(
    private_server: EmbeddedServer, chaos: ModuleType, tmp_path: Path
) -> None:
    from tests.apps.chaos import build

    url = private_server.create_database("chaos")
    migrated_for_chaos(url)
    app = build(AppConfig(queues=["default"], broker=PostgresConfig(database_url=url)))
    factory = WorkerFactory(url, tmp_path / "private")
    (tmp_path / "private").mkdir()
    conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)
    conn.execute("SET default_transaction_read_only = off")  # the test's own writes go on
    producer = Producer(app)
    try:
        worker = factory.start(APP, "--processes", "2", env={**ENV, "TETHER_DATABASE_URL": url})
        worker.wait_ready()
        children = sorted(p.pid for p in worker.task_children())
        producer.start()
        wait_until(lambda: len(producer.sent) >= 100, timeout=30, message="100 sends before read-only")
        read_only(conn, True)
        time.sleep(READ_ONLY_S)  # the outage itself: nothing to wait for but time
        read_only(conn, False)
        during = len(producer.refused)
        wait_until(lambda: len(producer.sent) >= 300, timeout=30, message="sends again after read-only")
        producer.stop.set()
        producer.join(timeout=10)

        ids = [h.id for h in producer.sent]
        wait_all(
            conn, ids, {"COMPLETED", "FAILED", "CANCELLED", "EXPIRED"}, timeout=60, why="every send to end"
        )
        rows = conn.execute(
            "SELECT t.id, t.status, t.error_code, t.attempt,"
            " (SELECT count(*) FROM tether_chaos_ledger l WHERE l.token = t.args->>0) AS runs"
            " FROM tether_tasks t WHERE t.id = ANY(%s)",
            (ids,),
        ).fetchall()
        log = worker.log()
        # Nothing failed and nothing ran twice: a refused write was retried, fenced, once writable.
        bad = [r for r in rows if (r["status"], r["runs"]) != ("COMPLETED", 1)]
        assert not bad, (bad[:10], log[-8000:])
        for task_id in ids[:50]:
            check_history(conn, task_id)
        # The window was real: sends were refused, each fast and saying why.
        assert during > 0, "no send met the read-only server"
        assert all("read-only" in message for _, message in producer.refused), producer.refused[:3]
        assert max(took for took, _ in producer.refused) < 2.0, sorted(producer.refused)[-3:]
        # No worker process died, and it said what happened.
        assert worker.proc.poll() is None, log
        assert "is read-only" in log, log[-8000:]
        # Its listener, which only reads, left the read-only session too and listened anew.
        assert "work listener: a failover was seen by this process; listening anew" in log, log[-8000:]
        assert "died" not in log and "WORKER_CRASHED" not in log and "Traceback" not in log, log[-8000:]
        assert sorted(p.pid for p in worker.task_children()) == children  # the same children
        # The same worker goes on.
        after = app.tasks["work"].send(token(), 0)
        assert after.get(timeout=30).is_ok
        print(f"\n{len(ids)} tasks sent and completed; {during} sends refused while read-only")
    finally:
        producer.stop.set()
        factory.cleanup()
        conn.close()
        app.close()
