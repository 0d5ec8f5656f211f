"""One `tether worker` subprocess, as a user starts it: shared by the tests and the benchmarks.

``python -m tether [--log-level LEVEL] worker APP [--processes N] [ARGS...]`` runs from the
repository root in its own session (``start_new_session=True``), so its process group id is
its pid and everything it spawned can be killed at once, by that pid. The caller gives the
whole environment of the process (the tests add their settings to ``os.environ``; the
benchmarks first remove the recovery timing variables) and the file its output goes to.

No pytest in here: ``python -m bench`` imports this module as ``tests.harness``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil
import psycopg

REPO = Path(__file__).resolve().parent.parent

#: What ``stop()`` and ``kill_group()`` wait for once the processes are gone: nothing, the
#: stopped worker's own database sessions, or every tether session on the database (for a
#: caller that runs one worker at a time and wants the database quiet before it measures).
SessionWait = Literal["nothing", "own_sessions", "all_sessions"]


@dataclass
class WorkerProcess:
    """A real `tether worker` process: start, wait until registered or ready, stop, kill, read its log."""

    app_path: str
    database_url: str
    log_path: Path
    args: Sequence[str] = ()  # more `tether worker` options
    env: Mapping[str, str] | None = None  # the whole environment of the process (None: ours)
    log_level: str | None = None  # `tether --log-level` (None: tether's default)
    # `--processes N`, put before ``args``; also the number of task children wait_ready()
    # expects. None: not passed (``args`` may hold it).
    processes: int | None = None
    stop_timeout: float = 30.0  # seconds stop() waits after SIGTERM before SIGKILL
    # True: a worker that SIGTERM did not stop within stop_timeout fails stop() with an
    # AssertionError (after the SIGKILL); False: the SIGKILL is enough.
    stop_must_be_graceful: bool = True
    stop_waits_for: SessionWait = "nothing"
    # The whole command line, instead of ``python -m tether worker APP_PATH ...`` (e.g. a
    # Django project's ``manage.py tether_worker``); ``app_path`` then only names it.
    command: Sequence[str] | None = None
    # Where the harness itself looks at the database (None: database_url); a direct URL
    # when the worker goes through PgBouncer (tests/pgbouncer.py).
    check_url: str | None = None
    worker_id: str | None = None  # tether_workers.id, once wait_registered() saw the row
    started_at: float = 0.0  # time.perf_counter() just before Popen
    stopped: bool = False  # stop() or kill() ran: never signal this pid (or group) again
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    # -- the process --------------------------------------------------------------------

    def start(self) -> WorkerProcess:
        if self.command is not None:
            cmd = list(self.command)
        else:
            cmd = [sys.executable, "-m", "tether"]
            if self.log_level is not None:
                cmd += ["--log-level", self.log_level]
            cmd += ["worker", self.app_path]
            if self.processes is not None:
                cmd += ["--processes", str(self.processes)]
            cmd += self.args
        with open(self.log_path, "ab") as out:  # the child keeps its own descriptor
            self.started_at = time.perf_counter()
            self._proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=dict(os.environ if self.env is None else self.env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole, by its pid
            )
        return self

    @property
    def started(self) -> bool:
        return self._proc is not None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError(f"worker {self.app_path} was never started")
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise RuntimeError(
                f"worker pid {self._proc and self._proc.pid} exited (code "
                f"{self._proc and self._proc.returncode}); log tail:\n{self.log_tail()}"
            )

    def tree(self) -> list[psutil.Process]:
        """The main process and all its descendants (children, multiprocessing's helpers)."""
        main = psutil.Process(self.pid)
        return [main, *main.children(recursive=True)]

    def task_children(self) -> list[psutil.Process]:
        """The child processes that run tasks (not multiprocessing's resource tracker, not the
        fork server): spawned by the main process, or forked by its fork server."""
        found = []
        for p in psutil.Process(self.pid).children():
            try:
                command = " ".join(p.cmdline())
                if "spawn_main" in command:
                    found.append(p)
                elif "resource_tracker" not in command:  # the fork server (forked, or started anew)
                    found.extend(p.children())
            except psutil.NoSuchProcess:
                continue
        return found

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

    def client_ports(self) -> set[int]:
        """Local TCP ports of the tree's open connections (pg_stat_activity.client_port)."""
        ports: set[int] = set()
        with contextlib.suppress(psutil.Error):
            for p in self.tree():
                with contextlib.suppress(psutil.Error):
                    ports.update(c.laddr.port for c in p.net_connections(kind="tcp") if c.raddr)
        return ports

    # -- the database's view of it ------------------------------------------------------

    def _query(self, statement: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.check_url or self.database_url, autocommit=True) as conn:
            return conn.execute(statement, params).fetchall()

    def _registered_id(self, conn: psycopg.Connection[Any]) -> str | None:
        """The id of this process's active registry row (its pid on this host), if there is one."""
        row = conn.execute(
            "SELECT id FROM tether_workers WHERE pid = %s AND hostname = %s AND status = 'active'",
            (self.pid, socket.gethostname()),
        ).fetchone()
        return None if row is None else str(row[0])

    def wait_registered(self, timeout: float = 60) -> str:
        """Wait until the worker registered (tether_workers) and logged the end of its startup
        (``worker <id> started: queues=...``, an INFO line: start it with ``log_level="INFO"``);
        sets and returns ``worker_id``.
        """
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.check_url or self.database_url, autocommit=True) as conn:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"worker exited with {self.proc.returncode}\n{self.log()}")
                worker_id = self._registered_id(conn)
                # Registered, and through its startup (reconciliation included): a test that
                # kills another worker next must not race this one's startup reconciliation.
                if worker_id is not None and f"worker {worker_id} started: queues=" in self.log():
                    self.worker_id = worker_id
                    return worker_id
                time.sleep(0.05)
        raise AssertionError(f"worker {self.pid} did not start within {timeout}s\n{self.log()}")

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Registered in tether_workers, LISTENing, and all its task children spawned.

        Children open their database connection lazily (on their first task), so a
        child's own readiness is not visible from outside: callers that need warm
        children run a few warm-up tasks, and the bench's memory scenario waits for RSS
        to settle. The LISTEN looked for is any session's on the database, not only this
        worker's.
        """
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.check_url or self.database_url, autocommit=True) as conn:
            while True:
                self.check_alive()
                worker_id = self._registered_id(conn)
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND query ILIKE 'LISTEN tether_work%%'"
                ).fetchone()
                listening = row[0] if row else 0
                if (
                    worker_id is not None
                    and listening >= 1
                    and len(self.task_children()) >= (self.processes or 0)
                ):
                    self.worker_id = worker_id
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"timed out after {timeout:.0f}s waiting for worker pid {self.pid} to be ready"
                    )
                time.sleep(0.05)

    def registration(self) -> tuple[str, Any]:
        """(worker id, tether_workers.started_at) of this process's latest registry row."""
        rows = self._query(
            "SELECT id, started_at FROM tether_workers WHERE pid = %s ORDER BY started_at DESC LIMIT 1",
            (self.pid,),
        )
        if not rows:
            raise RuntimeError(f"worker pid {self.pid} is not registered")
        return rows[0][0], rows[0][1]

    def _wait_sessions_gone(self, ports: set[int] | None) -> None:
        """All tether sessions on the database gone (ports None), or just those from these ports."""
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
        deadline = time.monotonic() + 10.0
        with contextlib.suppress(psycopg.Error):
            while self._query(statement, params)[0][0] != 0 and time.monotonic() < deadline:
                time.sleep(0.05)

    # -- ending it ----------------------------------------------------------------------

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (graceful), then SIGKILL to its process group; returns the exit code.

        The SIGKILL to the group (the session we created: its id is the worker's pid)
        reaches any straggler even after a graceful exit. Then waits as ``stop_waits_for``
        says. A worker still running ``timeout`` (default ``stop_timeout``) seconds after the
        SIGTERM is an AssertionError when ``stop_must_be_graceful``. None if never started.
        """
        if self._proc is None:
            return None
        if self.stopped:
            return self._proc.returncode  # never signal a pid (or group) again once ours is gone
        timeout = self.stop_timeout if timeout is None else timeout
        ports = self.client_ports() if self.stop_waits_for == "own_sessions" else None
        self.stopped = True
        graceful = True
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                graceful = False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(10)
        if self.stop_waits_for != "nothing":
            self._wait_sessions_gone(ports)
        if not graceful and self.stop_must_be_graceful:
            raise AssertionError(f"worker {self.pid} did not stop within {timeout}s\n{self.log()}")
        return self._proc.returncode

    def kill(self) -> None:
        """SIGKILL to the whole process group at once (main process, children, helpers): a crash.

        Returns once the main process is reaped, so its pid no longer exists (as a restarted
        worker's startup reconciliation checks). A worker that already exited is left alone.
        """
        if self._proc is None or self.stopped:
            return
        self.stopped = True
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(10)

    def kill_group(self, ports: set[int] | None = None) -> None:
        """kill(), then wait until the tree's database sessions have ended.

        ``ports``: ``client_ports()`` read beforehand, so the signal itself is not delayed.
        """
        if self._proc is None or self.stopped:
            return
        if ports is None:
            ports = self.client_ports()
        self.kill()
        self._wait_sessions_gone(ports)

    # -- its output ---------------------------------------------------------------------

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log().splitlines()[-lines:])
