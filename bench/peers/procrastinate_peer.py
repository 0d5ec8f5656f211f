"""procrastinate as a peer: ``python -m procrastinate --app bench.peers.procrastinate_app.app
worker`` (one asyncio worker; sync tasks run in its threads). Its triggers write
``procrastinate_events`` rows for every transition: ``deferred``, ``started`` (todo ->
doing, by the fetch statement), ``succeeded``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

from bench.peers.base import HEARTBEAT_S, REPO, STALE_S, Peer, WorkerSpec

APP = "bench.peers.procrastinate_app.app"


class ProcrastinatePeer(Peer):
    name = "procrastinate"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        from importlib.metadata import version

        self.version = version("procrastinate")

    def _env(self) -> dict[str, str]:
        return {"PROCRASTINATE_BENCH_DSN": self.url}

    def _worker(self, label: str, *args: str, env: dict[str, str] | None = None) -> WorkerSpec:
        return WorkerSpec(
            f"procrastinate {label}",
            ["-m", "procrastinate", "--app", APP, "worker", *args],
            {**self._env(), **(env or {})},
        )

    def install(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "procrastinate", "--app", APP, "schema", "--apply"],
            cwd=REPO,
            check=True,
            capture_output=True,
            env={**_environ(), **self._env()},
        )

    def reset(self) -> None:
        with self.connect() as conn:
            conn.execute("TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_workers CASCADE")

    def enqueue(self, task: str, n: int, args: tuple[Any, ...] = ()) -> None:
        from bench.peers import procrastinate_app

        kwargs = {"seconds": args[0]} if args else {}
        with procrastinate_app.app.replace_connector(_connector(self.url)) as app, app.open():
            app.tasks[task].batch_defer(*([kwargs] * n))

    def startup_worker(self) -> WorkerSpec:
        return self._worker("worker, concurrency 1 (default), sync task")

    def drain_workers(self) -> list[WorkerSpec]:
        return [
            self._worker("worker, concurrency 1 (default)"),
            self._worker("worker, concurrency 10", "--concurrency", "10"),
        ]

    def pickup_workers(self) -> list[tuple[WorkerSpec, str]]:
        return [(self._worker("worker, concurrency 1 (default)"), "anoop")]

    def hold_worker(self) -> WorkerSpec:
        return self._worker(
            f"worker, concurrency 50, heartbeat {HEARTBEAT_S:g} s, stalled {STALE_S:g} s",
            "--concurrency",
            "50",
            env={
                "PROCRASTINATE_BENCH_HEARTBEAT_S": str(HEARTBEAT_S),
                "PROCRASTINATE_BENCH_STALLED_S": str(STALE_S),
            },
        )

    def first_start_epoch(self) -> float | None:
        (at,) = self.query(
            "SELECT extract(epoch FROM min(at))::float8 FROM procrastinate_events WHERE type = 'started'"
        )[0]
        return None if at is None else float(at)

    def left(self) -> int:
        return int(
            self.query("SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')")[0][0]
        )

    def running(self) -> int:
        return int(self.query("SELECT count(*) FROM procrastinate_jobs WHERE status = 'doing'")[0][0])

    def span(self) -> tuple[float, float, int]:
        first, last, done = self.query(
            "SELECT extract(epoch FROM min(at) FILTER (WHERE type = 'started'))::float8,"
            " extract(epoch FROM max(at) FILTER (WHERE type = 'succeeded'))::float8,"
            " count(*) FILTER (WHERE type = 'succeeded') FROM procrastinate_events"
        )[0]
        return float(first), float(last), int(done)

    def pickup_ms(self, since: float) -> tuple[list[float], str]:
        rows = self.query(
            "SELECT 1000 * extract(epoch FROM s.at - d.at)::float8 FROM procrastinate_events d"
            " JOIN procrastinate_events s ON s.job_id = d.job_id AND s.type = 'started'"
            " WHERE d.type = 'deferred' AND d.at >= to_timestamp(%s) ORDER BY d.job_id",
            (since,),
        )
        return [
            float(r[0]) for r in rows
        ], "started - deferred in procrastinate_events (the fetch, todo -> doing)"

    def senders(self) -> dict[str, tuple[Callable[[], None], Callable[[int], None], Callable[[], None]]]:
        open_, send, close = self.producer("noop")

        def send_n(n: int) -> None:
            for _ in range(n):
                send()

        return {"procrastinate defer()": (open_, send_n, close)}

    def producer(self, task: str) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        from bench.peers import procrastinate_app

        state: dict[str, Any] = {}

        def open_() -> None:
            state["cm"] = procrastinate_app.app.replace_connector(_connector(self.url))
            app = state["cm"].__enter__()
            state["open"] = app.open()
            state["open"].__enter__()
            state["task"] = app.tasks[task]

        def send() -> None:
            state["task"].defer()

        def close() -> None:
            state.pop("open").__exit__(None, None, None)
            state.pop("cm").__exit__(None, None, None)

        return open_, send, close


def _connector(url: str) -> Any:
    from procrastinate import PsycopgConnector

    return PsycopgConnector(conninfo=url)


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)
