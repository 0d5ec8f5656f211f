"""pgqueuer as a peer: its asyncio worker (``pgqueuer.run``, what ``pgq run`` starts) on
bench/peers/pgqueuer_app.py. pgqueuer logs every state change in ``pgqueuer_log``
(``queued`` at enqueue, ``picked`` by the dequeue statement, ``successful`` when the
buffered outcome is written); a finished job's queue row is deleted."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import psycopg

from bench.peers.base import REPO, STALE_S, Peer, WorkerSpec

APP = "bench.peers.pgqueuer_app"


class PgqueuerPeer(Peer):
    name = "pgqueuer"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        from importlib.metadata import version

        self.version = version("pgqueuer")

    def _worker(self, label: str, *args: str) -> WorkerSpec:
        return WorkerSpec(f"pgqueuer {label}", ["-m", APP, *args], {"PGQUEUER_BENCH_DSN": self.url})

    def install(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "pgqueuer", "--pg-dsn", self.url, "install"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )

    def reset(self) -> None:
        with self.connect() as conn:
            conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")

    def enqueue(self, task: str, n: int, args: tuple[Any, ...] = ()) -> None:
        from pgqueuer.db import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries

        entrypoint = "noop" if task == "anoop" else task  # pgqueuer's tasks are all async
        payload = str(args[0]).encode() if args else None
        with psycopg.connect(self.url, autocommit=True) as conn:
            SyncQueries(SyncPsycopgDriver(conn)).enqueue([entrypoint] * n, [payload] * n, [0] * n)

    def startup_worker(self) -> WorkerSpec:
        return self._worker("asyncio worker, batch 10", "--batch-size", "10")

    def drain_workers(self) -> list[WorkerSpec]:
        return [self._worker("asyncio worker, batch 10", "--batch-size", "10")]

    def pickup_workers(self) -> list[tuple[WorkerSpec, str]]:
        return [(self._worker("asyncio worker, batch 10", "--batch-size", "10"), "noop")]

    def hold_worker(self) -> WorkerSpec:
        # heartbeat_timeout is pgqueuer's staleness threshold; it beats at half of it: 1 s.
        return self._worker(
            f"asyncio worker, batch 10, heartbeat_timeout {STALE_S:g} s",
            "--batch-size",
            "10",
            "--heartbeat-timeout",
            str(STALE_S),
        )

    def recovery_workers(self) -> tuple[WorkerSpec, WorkerSpec] | None:
        # B re-picks the job once its heartbeat is older than heartbeat_timeout, at its next
        # dequeue: an idle worker dequeues on a NOTIFY or after dequeue_timeout (30 s by
        # default), so it is set to 1 s, as tether's reaper checks every 1 s here.
        args = ["--batch-size", "10", "--heartbeat-timeout", str(STALE_S), "--dequeue-timeout", "1"]
        label = f"batch 10, heartbeat_timeout {STALE_S:g} s, dequeue_timeout 1 s"
        a = self._worker(f"A, {label}", *args)
        b = self._worker(f"B, {label}", *args)
        b.env["PGAPPNAME"] = "peers-bench-b"  # libpq's default application_name: B's session
        return a, b

    def ready_since(self, since: float) -> bool:
        return bool(
            self.query(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'peers-bench-b' AND backend_start >= to_timestamp(%s)",
                (since,),
            )[0][0]
        )

    def decision_epoch(self) -> float | None:
        rows = self.query(
            "SELECT extract(epoch FROM created)::float8 FROM pgqueuer_log"
            " WHERE entrypoint = 'hold' AND status = 'picked' ORDER BY created OFFSET 1 LIMIT 1"
        )
        return float(rows[0][0]) if rows else None

    def first_start_epoch(self) -> float | None:
        (at,) = self.query(
            "SELECT extract(epoch FROM min(created))::float8 FROM pgqueuer_log WHERE status = 'picked'"
        )[0]
        return None if at is None else float(at)

    def left(self) -> int:
        return int(self.query("SELECT count(*) FROM pgqueuer")[0][0])

    def running(self) -> int:
        return int(self.query("SELECT count(*) FROM pgqueuer WHERE status = 'picked'")[0][0])

    def span(self) -> tuple[float, float, int]:
        first, last, done = self.query(
            "SELECT extract(epoch FROM min(created) FILTER (WHERE status = 'picked'))::float8,"
            " extract(epoch FROM max(created) FILTER (WHERE status = 'successful'))::float8,"
            " count(*) FILTER (WHERE status = 'successful') FROM pgqueuer_log"
        )[0]
        return float(first), float(last), int(done)

    def pickup_ms(self, since: float) -> tuple[list[float], str]:
        rows = self.query(
            "SELECT 1000 * extract(epoch FROM p.created - q.created)::float8"
            " FROM pgqueuer_log q JOIN pgqueuer_log p ON p.job_id = q.job_id AND p.status = 'picked'"
            " WHERE q.status = 'queued' AND q.created >= to_timestamp(%s) ORDER BY q.job_id",
            (since,),
        )
        return [float(r[0]) for r in rows], "picked - queued in pgqueuer_log (the dequeue; no start write)"

    def producer(self, task: str) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        from pgqueuer.db import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries

        state: dict[str, Any] = {}

        def open_() -> None:
            state["conn"] = psycopg.connect(self.url, autocommit=True)
            state["q"] = SyncQueries(SyncPsycopgDriver(state["conn"]))

        def send() -> None:
            state["q"].enqueue("noop" if task == "anoop" else task, None)

        return open_, send, lambda: state.pop("conn").close()

    def senders(self) -> dict[str, tuple[Callable[[], None], Callable[[int], None], Callable[[], None]]]:
        from pgqueuer.db import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries

        state: dict[str, Any] = {}

        def open_sync() -> None:
            state["conn"] = psycopg.connect(self.url, autocommit=True)
            state["q"] = SyncQueries(SyncPsycopgDriver(state["conn"]))

        def send_sync(n: int) -> None:
            q = state["q"]
            for _ in range(n):
                q.enqueue("noop", None)

        return {"pgqueuer enqueue()": (open_sync, send_sync, lambda: state.pop("conn").close())}
