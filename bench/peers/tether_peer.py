"""tether as a peer: ``python -m tether worker`` on bench/apps.py (sync) or bench/async_apps.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from bench.apps import make_app
from bench.async_apps import make_app as make_async_app
from bench.infra import TASK_TABLES
from bench.peers.base import HEARTBEAT_S, STALE_S, Peer, WorkerSpec
from tether import __version__
from tether.db.migrate import migrate

# 1 s heartbeats, 2 s stale thresholds, 1 s reaper checks (bench/recovery.py's FAST_RECOVERY_ENV).
FAST_ENV = {
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": str(int(HEARTBEAT_S * 1000)),
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": str(int(HEARTBEAT_S * 1000)),
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": str(int(STALE_S * 1000)),
    "TETHER_RUNNING_STALE_THRESHOLD_MS": str(int(STALE_S * 1000)),
    "TETHER_CHECK_INTERVAL_MS": str(int(HEARTBEAT_S * 1000)),
}
# The recovery scenario's workers also opt in to the session_closed rule (1.25 s after the last
# heartbeat once the killed worker's listener session is gone; bench/recovery.py's
# SESSION_CLOSED_ENV), tether's fastest setting for a whole worker killed on another host.
RECOVERY_ENV = {**FAST_ENV, "TETHER_SESSION_CLOSED_THRESHOLD_MS": str(int(1.25 * HEARTBEAT_S * 1000))}
TWO = ("--processes", "2")
SYNC_APP, ASYNC_APP = "bench.apps:app", "bench.async_apps:app"


class TetherPeer(Peer):
    name = "tether"
    version = __version__

    def _worker(self, label: str, app: str, *args: str, env: dict[str, str] | None = None) -> WorkerSpec:
        return WorkerSpec(
            f"tether {label}",
            ["-m", "tether", "worker", app, *args],
            {"TETHER_DATABASE_URL": self.url, **(env or {})},
        )

    def install(self) -> None:
        with self.connect() as conn:
            migrate(conn)

    def reset(self) -> None:
        present = [
            r[0]
            for r in self.query(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() AND tablename = ANY(%s)",
                (list(TASK_TABLES),),
            )
        ]
        with self.connect() as conn:
            conn.execute("TRUNCATE " + ", ".join(present))

    def enqueue(self, task: str, n: int, args: tuple[Any, ...] = ()) -> None:
        app = (make_async_app if task == "anoop" else make_app)(self.url)
        try:
            app.tasks[task].send_many([args] * n)
        finally:
            app.close()

    def startup_worker(self) -> WorkerSpec:
        return self._worker("2 sync processes", SYNC_APP, "--processes", "2", "--prefetch", "0")

    def drain_workers(self) -> list[WorkerSpec]:
        return [
            self._worker("1 async child", ASYNC_APP, "--processes", "0", "--async-processes", "1"),
            self._worker("2 async children", ASYNC_APP, "--processes", "0", "--async-processes", "2"),
        ]

    def pickup_workers(self) -> list[tuple[WorkerSpec, str]]:
        return [
            (self._worker("2 sync processes", SYNC_APP, "--processes", "2"), "noop"),
            (self._worker("1 async child", ASYNC_APP, "--processes", "0", "--async-processes", "1"), "anoop"),
        ]

    def hold_worker(self) -> WorkerSpec:
        # As bench/recovery.py's commits_per_second: one sync process per held task, no prefetch.
        return self._worker(
            "50 sync processes, --prefetch 0", SYNC_APP, "--processes", "50", "--prefetch", "0", env=FAST_ENV
        )

    def first_start_epoch(self) -> float | None:
        (at,) = self.query("SELECT extract(epoch FROM min(started_at))::float8 FROM tether_tasks")[0]
        return None if at is None else float(at)

    def left(self) -> int:
        return int(
            self.query("SELECT count(*) FROM tether_tasks WHERE status IN ('PENDING', 'CLAIMED', 'RUNNING')")[
                0
            ][0]
        )

    def running(self) -> int:
        return int(self.query("SELECT count(*) FROM tether_tasks WHERE status = 'RUNNING'")[0][0])

    def span(self) -> tuple[float, float, int]:
        first, last, done = self.query(
            "SELECT extract(epoch FROM min(started_at))::float8,"
            " extract(epoch FROM max(completed_at))::float8,"
            " count(*) FILTER (WHERE status = 'COMPLETED') FROM tether_tasks"
        )[0]
        return float(first), float(last), int(done)

    def pickup_ms(self, since: float) -> tuple[list[float], str]:
        rows = self.query(
            "SELECT 1000 * extract(epoch FROM started_at - sent_at)::float8 FROM tether_tasks"
            " WHERE status = 'COMPLETED' AND sent_at >= to_timestamp(%s) ORDER BY sent_at",
            (since,),
        )
        return [float(r[0]) for r in rows], "started_at - sent_at (the start write, before the body)"

    def recovery_workers(self) -> tuple[WorkerSpec, WorkerSpec] | None:
        # As bench/recovery.py's recovery_worker_kill_session_closed: two workers --processes 2,
        # fast settings and the session_closed rule.
        return (
            self._worker(
                "A, 2 sync processes, 1 s/2 s/1 s, session_closed 1.25 s", SYNC_APP, *TWO, env=RECOVERY_ENV
            ),
            self._worker(
                "B, 2 sync processes, 1 s/2 s/1 s, session_closed 1.25 s", SYNC_APP, *TWO, env=RECOVERY_ENV
            ),
        )

    def ready_since(self, since: float) -> bool:
        return bool(
            self.query(
                "SELECT count(*) FROM tether_workers"
                " WHERE started_at >= to_timestamp(%s) AND status = 'active'",
                (since,),
            )[0][0]
        )

    def decision_epoch(self) -> float | None:
        rows = self.query(
            "SELECT extract(epoch FROM failed_at)::float8, error_code FROM tether_tasks"
            " WHERE name = 'hold' AND status = 'FAILED'"
        )
        if not rows:
            return None
        if rows[0][1] != "WORKER_CRASHED":
            raise RuntimeError(f"the held task FAILED with {rows[0][1]}, not WORKER_CRASHED")
        return float(rows[0][0])

    def claim_ms(self, since: float) -> list[float] | None:
        rows = self.query(
            "SELECT 1000 * extract(epoch FROM claimed_at - sent_at)::float8 FROM tether_tasks"
            " WHERE status = 'COMPLETED' AND sent_at >= to_timestamp(%s)",
            (since,),
        )
        return [float(r[0]) for r in rows]

    def producer(self, task: str) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        state: dict[str, Any] = {}

        def open_() -> None:
            state["app"] = (make_async_app if task == "anoop" else make_app)(self.url)

        def send() -> None:
            state["app"].tasks[task].send()  # a sync send() of an async task: same row, same commit

        return open_, send, lambda: state.pop("app").close()

    def senders(self) -> dict[str, tuple[Callable[[], None], Callable[[int], None], Callable[[], None]]]:
        state: dict[str, Any] = {}

        def open_sync() -> None:
            state["sync"] = make_app(self.url)

        def send_sync(n: int) -> None:
            noop = state["sync"].tasks["noop"]
            for _ in range(n):
                noop.send()

        def open_async() -> None:
            state["loop"] = asyncio.new_event_loop()
            state["async"] = make_async_app(self.url)

        def send_async(n: int) -> None:
            anoop = state["async"].tasks["anoop"]

            async def run() -> None:
                for _ in range(n):
                    await anoop.send_async()

            state["loop"].run_until_complete(run())

        def close_async() -> None:
            app = state.pop("async")
            aclose = getattr(app.broker, "aclose", None)
            if aclose is not None:
                state["loop"].run_until_complete(aclose())
            app.close()
            state.pop("loop").close()

        return {
            "tether send()": (open_sync, send_sync, lambda: state.pop("sync").close()),
            "tether await send_async()": (open_async, send_async, close_async),
        }
