"""A real failover: the primary dies (``pg_ctl stop -m immediate``) under load and its
synchronous standby is promoted (tests/ha_pair.py builds both from Debian's PostgreSQL).

Two workers (2 processes each) and a producer that sends a task every 10 ms all name both
servers in one multi-host URL with ``target_session_attrs=read-write`` and the poll 30 s
away. Every send that returned must be on the new primary and end COMPLETED, its code run
once; the same worker processes carry on; and a task sent afterwards starts within 1 s,
so LISTEN is back (the poll alone would take up to 30 s). docs/high-availability.md quotes
the times this prints.

The same with an asynchronous standby (PostgreSQL's default) measures what a failover loses
there: it is reported, not asserted to be zero; what reached the new primary must still
end by the rules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.chaos.conftest import APP, FAST, check_history, migrated_for_chaos, token, wait_all
from tests.conftest import WorkerFactory, WorkerProcess, wait_until
from tests.ha_pair import HaPair
from tether import AppConfig, PostgresConfig
from tether.errors import DatabaseUnreachableError

# Above the failover's few seconds, so the rules decide nothing: a task is settled by its own
# worker, not recovered elsewhere.
STALE_S = 15.0
ENV = {
    **FAST,
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": str(int(STALE_S * 1000)),
    "TETHER_RUNNING_STALE_THRESHOLD_MS": str(int(STALE_S * 1000)),
    "TETHER_POLL_INTERVAL_MS": "30000",
}
#: Every acknowledged task ends within this after the promotion (docs/high-availability.md).
SETTLED_WITHIN_S = 30.0


@pytest.fixture
def pair() -> Iterator[HaPair]:
    built = HaPair()
    try:
        yield built.start()
    finally:
        built.close()  # both servers by their postmaster's pid, and the folder


@pytest.fixture
def async_pair() -> Iterator[HaPair]:
    built = HaPair(synchronous=False)
    try:
        yield built.start()
    finally:
        built.close()


class Producer(threading.Thread):
    """Sends one task every 10 ms; keeps the acknowledged sends and the refused ones."""

    def __init__(self, app: Any) -> None:
        super().__init__(daemon=True)
        self.app = app
        self.stop = threading.Event()
        self.sent: list[tuple[float, Any]] = []  # (monotonic time acknowledged, handle)
        self.refused: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                handle = self.app.tasks["work"].send(token(), 20)
                self.sent.append((time.monotonic(), handle))
            except DatabaseUnreachableError as exc:
                self.refused.append(str(exc))
            self.stop.wait(0.01)


@dataclass
class Load:
    """Two workers and a producer on the pair's multi-host URL (``under_load``)."""

    app: Any
    producer: Producer
    workers: list[WorkerProcess]


@contextmanager
def under_load(pair: HaPair, tmp_path: Path) -> Iterator[Load]:
    """Database ``ha`` on the pair, two workers (2 processes each) ready, and a producer sending
    a task every 10 ms, all on the multi-host URL; stopped and cleaned up at the end. The test
    takes the ``chaos`` fixture: tests.apps.chaos is first imported bound to the session's
    database, as every later test of the process expects."""
    from tests.apps.chaos import build

    with psycopg.connect(pair.primary.url("postgres"), autocommit=True) as c:
        c.execute("CREATE DATABASE ha")
    migrated_for_chaos(pair.primary.url("ha"))
    url = pair.multi_host_url("ha")
    app = build(AppConfig(queues=["default"], broker=PostgresConfig(database_url=url)))
    factory = WorkerFactory(url, tmp_path / "private")
    (tmp_path / "private").mkdir()
    producer = Producer(app)
    try:
        env = {**ENV, "TETHER_DATABASE_URL": url}
        workers = [factory.start(APP, "--processes", "2", env=env) for _ in range(2)]
        for w in workers:
            w.wait_ready()
        yield Load(app, producer, workers)
    finally:
        producer.stop.set()
        factory.cleanup()
        app.close()


# Its own servers: the outcome does not depend on the session's (one run, not two).
@pytest.mark.server_agnostic
@pytest.mark.timing
def test_a_promoted_standby_takes_over_with_nothing_acknowledged_lost(
    pair: HaPair, chaos: ModuleType, tmp_path: Path
) -> None:
    with under_load(pair, tmp_path) as load:
        app, producer, workers = load.app, load.producer, load.workers
        children = {w.pid: sorted(p.pid for p in w.task_children()) for w in workers}
        producer.start()
        wait_until(lambda: len(producer.sent) >= 200, timeout=60, message="200 sends before the failover")

        t0 = time.monotonic()
        pair.primary.stop_immediately()
        pair.standby.promote()
        promoted = time.monotonic()
        wait_until(lambda: producer.sent[-1][0] > promoted, timeout=60, message="a send on the new primary")
        first_send_s = producer.sent[-1][0] - t0 if producer.sent[-1][0] > promoted else None
        count_after = len(producer.sent)
        wait_until(lambda: len(producer.sent) >= count_after + 200, timeout=60, message="200 sends after")
        producer.stop.set()
        producer.join(timeout=10)

        conn = psycopg.connect(pair.standby.url("ha"), autocommit=True, row_factory=dict_row)
        try:
            ids = [h.id for _, h in producer.sent]
            wait_all(conn, ids, {"COMPLETED", "FAILED", "CANCELLED", "EXPIRED"}, timeout=SETTLED_WITHIN_S,
                     why="every acknowledged send to end on the new primary")  # fmt: skip
            settled_s = time.monotonic() - t0
            rows = conn.execute(
                "SELECT t.id, t.status, t.error_code,"
                " (SELECT count(*) FROM tether_chaos_ledger l WHERE l.token = t.args->>0) AS runs"
                " FROM tether_tasks t WHERE t.id = ANY(%s)",
                (ids,),
            ).fetchall()
            # Every acknowledged send survived (synchronous replication), and ran exactly once.
            assert len(rows) == len(ids)
            logs = "".join(w.log()[-4000:] for w in workers)
            bad = [r for r in rows if (r["status"], r["runs"]) != ("COMPLETED", 1)]
            assert not bad, (bad[:10], logs)
            for task_id in ids[:100]:
                check_history(conn, task_id)
            # The same processes carry on.
            for w in workers:
                assert w.proc.poll() is None, w.log()[-8000:]
                assert sorted(p.pid for p in w.task_children()) == children[w.pid], w.log()[-8000:]
            # LISTEN is back: a task sent now starts within 1 s with the poll 30 s away.
            sent_at = time.monotonic()
            probe = app.tasks["work"].send(token(), 0)
            assert probe.get(timeout=30).is_ok
            row = conn.execute(
                "SELECT extract(epoch FROM started_at - enqueued_at) AS s FROM tether_tasks WHERE id = %s",
                (probe.id,),
            ).fetchone()
            assert row is not None and row["s"] < 1.0, (row, time.monotonic() - sent_at)
        finally:
            conn.close()
        print(
            f"\nfailover: {len(ids)} acknowledged sends, all COMPLETED once; {len(producer.refused)} "
            f"refused during it; first send on the new primary {first_send_s:.2f}s after the stop; "
            f"every task settled {settled_s:.2f}s after it; probe started in {row['s'] * 1000:.0f} ms"
        )


# Its own servers: the outcome does not depend on the session's (one run, not two).
@pytest.mark.server_agnostic
@pytest.mark.timing
def test_an_asynchronous_standby_promoted_loses_at_most_the_last_commits_and_strands_nothing(
    async_pair: HaPair, chaos: ModuleType, tmp_path: Path
) -> None:
    pair = async_pair
    with under_load(pair, tmp_path) as load:
        producer, workers = load.producer, load.workers
        producer.start()
        wait_until(lambda: len(producer.sent) >= 200, timeout=60, message="200 sends before the failover")
        pair.primary.stop_immediately()
        pair.standby.promote()
        count_after = len(producer.sent)
        wait_until(lambda: len(producer.sent) >= count_after + 100, timeout=60, message="100 sends after")
        producer.stop.set()
        producer.join(timeout=10)

        conn = psycopg.connect(pair.standby.url("ha"), autocommit=True, row_factory=dict_row)
        try:
            ids = [h.id for _, h in producer.sent]
            there = [r["id"] for r in conn.execute(
                "SELECT id FROM tether_tasks WHERE id = ANY(%s)", (ids,)).fetchall()]  # fmt: skip
            # What reached the new primary ends by the rules, within the stale thresholds
            # (a lost outcome leaves its task RUNNING there with no live heartbeat).
            wait_all(conn, there, {"COMPLETED", "FAILED", "CANCELLED", "EXPIRED"}, timeout=STALE_S + 30,
                     why="every task on the new primary to end")  # fmt: skip
            rows = conn.execute(
                "SELECT t.status, t.error_code, count(*) AS n FROM tether_tasks t WHERE t.id = ANY(%s)"
                " GROUP BY 1, 2 ORDER BY 1, 2",
                (there,),
            ).fetchall()
        finally:
            conn.close()
        assert len(there) > 0 and all(w.proc.poll() is None for w in workers)
        lost = len(ids) - len(there)
        print(
            f"\nasynchronous failover: {len(ids)} acknowledged sends, {lost} lost with the old primary; "
            f"on the new one: {[(r['status'], r['error_code'], r['n']) for r in rows]}"
        )
