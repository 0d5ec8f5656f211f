"""What the scenarios stand on: a throwaway database, worker subprocesses, memory readings."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import psutil
import psycopg
from psycopg import sql

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SERVER_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
# Emptied between scenarios (those that exist in the installed schema version).
TASK_TABLES = ("tether_task_attempts", "tether_tasks", "tether_heartbeats", "tether_worker_states")
# Recovery timing settings a worker reads from its environment. Removed from what a worker
# inherits, so every worker runs with tether's defaults unless a scenario sets them.
RECOVERY_ENV = (
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS",
    "TETHER_RUNNING_STALE_THRESHOLD_MS",
    "TETHER_CHECK_INTERVAL_MS",
)


def with_database(url: str, dbname: str) -> str:
    """``url`` pointing at database ``dbname`` (same server, user and parameters)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


class BenchDatabase:
    """CREATE DATABASE tether_bench_<random> on the server; DROP it on close."""

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self.name = f"tether_bench_{secrets.token_hex(4)}"
        self.url = with_database(server_url, self.name)
        self.created = False

    def create(self) -> None:
        with psycopg.connect(self.server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        self.created = True

    def drop(self) -> None:
        if not self.created:
            return
        with psycopg.connect(self.server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.name)))
        self.created = False

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True)

    def query(self, statement: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            return conn.execute(statement, params).fetchall()  # type: ignore[arg-type]

    def reset_tasks(self) -> None:
        """Empty the task tables (workers must be stopped) so each scenario starts from zero.

        Only TRUNCATE: no ANALYZE, so the planner sees what a fresh install sees.
        """
        with self.connect() as conn:
            present = [
                r[0]
                for r in conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
                    " AND tablename = ANY(%s)",
                    (list(TASK_TABLES),),
                ).fetchall()
            ]
            if present:
                conn.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(map(sql.Identifier, present))))


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class WorkerProcess:
    """``python -m tether worker bench.apps:app`` as a real subprocess in its own session."""

    db: BenchDatabase
    log_path: Path
    processes: int = 2
    extra_args: tuple[str, ...] = ()  # more `tether worker` options (for experiments)
    env: dict[str, str] = field(default_factory=dict)  # more environment (TETHER_* settings)
    # stop() waits until every tether connection to the bench database is gone. False:
    # only this worker's own (other workers of the scenario keep running).
    exclusive: bool = True
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0  # time.perf_counter() just before Popen
    stopped: bool = False
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> WorkerProcess:
        env = {k: v for k, v in os.environ.items() if k not in RECOVERY_ENV}
        env.update(self.env)
        env["TETHER_DATABASE_URL"] = self.db.url
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        cmd = [
            sys.executable,
            "-m",
            "tether",
            "worker",
            "bench.apps:app",
            "--processes",
            str(self.processes),
            *self.extra_args,
        ]
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(
                f"worker pid {self.pid} exited (code {self.proc and self.proc.returncode});"
                f" log tail:\n{self.log_tail()}"
            )

    def tree(self) -> list[psutil.Process]:
        """The main process and all its descendants (children, multiprocessing's helpers)."""
        main = psutil.Process(self.pid)
        return [main, *main.children(recursive=True)]

    def rss_bytes(self) -> tuple[int, dict[int, int]]:
        total, per_pid = 0, {}
        for p in self.tree():
            try:
                rss = p.memory_info().rss
            except psutil.NoSuchProcess:
                continue
            per_pid[p.pid] = rss
            total += rss
        return total, per_pid

    def pss_bytes(self) -> int:
        """Proportional set size of the tree: shared pages counted once (context for RSS)."""
        total = 0
        for p in self.tree():
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
                continue
        return total

    def task_children(self) -> list[psutil.Process]:
        """The child processes that run tasks (not multiprocessing's resource tracker)."""
        found = []
        for p in psutil.Process(self.pid).children():
            try:
                if any("spawn_main" in part for part in p.cmdline()):
                    found.append(p)
            except psutil.NoSuchProcess:
                continue
        return found

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Registered in tether_workers, LISTENing, and all its task children spawned.

        Children open their database connection lazily (on their first task), so a
        child's own readiness is not visible from outside: callers that need warm
        children run a few warm-up tasks, and the memory scenario waits for RSS to settle.
        """

        def ready() -> bool:
            self.check_alive()
            rows = self.db.query(
                "SELECT"
                " (SELECT count(*) FROM tether_workers WHERE pid = %s AND status = 'active'),"
                " (SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                "   AND query ILIKE 'LISTEN tether_work%%')",
                (self.pid,),
            )
            registered, listening = rows[0]
            return registered == 1 and listening >= 1 and len(self.task_children()) >= self.processes

        wait_for(f"worker pid {self.pid} to be ready", ready, timeout, interval=0.05)

    def registration(self) -> tuple[str, Any]:
        """(worker id, tether_workers.started_at) of this process's registry row."""
        rows = self.db.query(
            "SELECT id, started_at FROM tether_workers WHERE pid = %s ORDER BY started_at DESC LIMIT 1",
            (self.pid,),
        )
        if not rows:
            raise RuntimeError(f"worker pid {self.pid} is not registered")
        return rows[0][0], rows[0][1]

    def client_ports(self) -> set[int]:
        """Local TCP ports of the tree's open connections (pg_stat_activity.client_port)."""
        ports: set[int] = set()
        with contextlib.suppress(psutil.Error):
            for p in self.tree():
                with contextlib.suppress(psutil.Error):
                    ports.update(c.laddr.port for c in p.net_connections(kind="tcp") if c.raddr)
        return ports

    def kill_group(self, ports: set[int] | None = None) -> None:
        """SIGKILL to the whole process group at once (main process, children, helpers): a crash.

        Waits until the main process is reaped (its pid no longer exists, as a restarted
        worker's reconciliation checks) and the tree's database sessions have ended.
        ``ports``: ``client_ports()`` read beforehand, so the signal itself is not delayed.
        """
        if self.proc is None or self.stopped:
            return
        if ports is None:
            ports = self.client_ports()
        self.stopped = True
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
        self._wait_sessions_gone(ports)

    def _wait_sessions_gone(self, ports: set[int] | None) -> None:
        """All tether sessions on the bench database gone (ports None), or just these."""
        if ports is None:
            statement, params = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name LIKE 'tether%%'",
                None,
            )
        elif ports:
            statement, params = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND client_port = ANY(%s)",
                (sorted(ports),),
            )
        else:
            return
        with contextlib.suppress(TimeoutError, psycopg.Error):
            wait_for(
                "the stopped worker's connections to close",
                lambda: self.db.query(statement, params)[0][0] == 0,
                10.0,
            )

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (graceful), then SIGKILL to its process group; wait until its connections are gone."""
        if self.proc is None or self.stopped:
            return  # never signal a pid (or group) again once ours is gone: it may be reused
        ports = None if self.exclusive else self.client_ports()
        self.stopped = True
        try:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout)
            # The session we created: its group id is the worker's pid. Reaches any straggler.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
        self._wait_sessions_gone(ports)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def wait_all_terminal(
    db: BenchDatabase, worker: WorkerProcess | None, timeout: float, interval: float = 0.1
) -> float:
    """Wait until no task is left PENDING/CLAIMED/RUNNING; returns time.perf_counter() when seen."""

    def done() -> bool:
        if worker is not None:
            worker.check_alive()
        left = db.query("SELECT count(*) FROM tether_tasks WHERE status IN ('PENDING', 'CLAIMED', 'RUNNING')")
        return left[0][0] == 0

    wait_for("all tasks to finish", done, timeout, interval)
    return time.perf_counter()


def count_by_status(db: BenchDatabase) -> dict[str, int]:
    return dict(db.query("SELECT status, count(*) FROM tether_tasks GROUP BY status"))  # type: ignore[arg-type]


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)
