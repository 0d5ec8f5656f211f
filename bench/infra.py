"""What the scenarios stand on: a throwaway database, worker subprocesses, memory readings.

The worker subprocess itself is tests/harness.py's WorkerProcess, the one the tests use.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psutil
import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from tests.harness import REPO, WorkerProcess

DEFAULT_SERVER_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
# Emptied between scenarios (those that exist in the installed schema version).
TASK_TABLES = (
    "tether_task_attempts",
    "tether_unique_keys",  # references tether_tasks: emptied with it
    "tether_task_steps",  # the same
    "tether_events",  # the same (durable sleep and events, bench/sleeps.py)
    "tether_event_waits",  # the same
    "tether_tasks",
    "tether_heartbeats",
    "tether_worker_states",
)
# Recovery timing settings a worker reads from its environment. Removed from what a worker
# inherits, so every worker runs with tether's defaults unless a scenario sets them.
RECOVERY_ENV = (
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS",
    "TETHER_RUNNING_STALE_THRESHOLD_MS",
    "TETHER_CHECK_INTERVAL_MS",
    "TETHER_SESSION_CLOSED_THRESHOLD_MS",
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


def connect_dict(url: str) -> psycopg.Connection[dict[str, Any]]:
    """An autocommit connection whose rows are dicts."""
    return psycopg.connect(url, autocommit=True, row_factory=dict_row)


def wait_for(what: str, check: Callable[[], bool], timeout: float, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def bench_worker(
    db: BenchDatabase,
    log_path: Path,
    processes: int = 2,
    *,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    exclusive: bool = True,
    app_path: str = "bench.apps:app",
) -> WorkerProcess:
    """``python -m tether worker APP_PATH --processes N``, to start in its own session.

    The worker inherits this process's environment without RECOVERY_ENV, plus ``env``
    (TETHER_* settings), on the bench database. ``extra_args``: more `tether worker` options.
    Its stop() is SIGTERM, SIGKILL after 15 s, and then waits until every tether connection
    to the bench database is gone (``exclusive``), or only its own (other workers of the
    scenario keep running).
    """
    worker_env = {k: v for k, v in os.environ.items() if k not in RECOVERY_ENV}
    worker_env.update(env or {})
    worker_env["TETHER_DATABASE_URL"] = db.url
    worker_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), worker_env.get("PYTHONPATH", "")) if p)
    return WorkerProcess(
        app_path,
        db.url,
        log_path,
        args=extra_args,
        env=worker_env,
        processes=processes,
        stop_timeout=15.0,
        stop_must_be_graceful=False,
        stop_waits_for="all_sessions" if exclusive else "own_sessions",
    )


def drain_mark(db: BenchDatabase) -> Any:
    """What drain_span counts after: the last completed_at so far (a day ago when none)."""
    ((mark,),) = db.query("SELECT coalesce(max(completed_at), now() - interval '1 day') FROM tether_tasks")
    return mark


def drain_span(db: BenchDatabase, mark: Any, n: int, who: str) -> float:
    """Seconds from the first start to the last completion of the tasks started after
    ``mark`` (drain_mark), which must be ``n`` COMPLETED ones; then both task tables are
    vacuumed, outside the measurement: autovacuum is off here, and without it the partial
    indexes' dead entries would grow through a run of many drains."""
    ((done, span),) = db.query(
        "SELECT count(*) FILTER (WHERE status = 'COMPLETED'),"
        " extract(epoch FROM max(completed_at) - min(started_at)) FROM tether_tasks WHERE started_at > %s",
        (mark,),
    )
    if done != n:
        raise RuntimeError(f"{who}: {done} of {n} completed")
    with db.connect() as conn:
        conn.execute("VACUUM tether_tasks, tether_task_attempts")
    return float(span)


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


def task_children(main_pid: int) -> list[psutil.Process]:
    """The worker's task children: spawned by its main process, or forked by its fork server."""
    found: list[psutil.Process] = []
    for p in psutil.Process(main_pid).children():
        command = " ".join(p.cmdline())
        if "spawn_main" in command:
            found.append(p)
        elif "resource_tracker" not in command:  # the fork server (forked, or started anew)
            found.extend(p.children())
    return found


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its children."""
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def settled(pid: int, children: int) -> None:
    """Until the worker has its ``children`` and their start-up (imports) is over: CPU flat for 0.5 s."""
    deadline = time.monotonic() + 60
    last = -1.0
    while time.monotonic() < deadline:
        kids = task_children(pid)
        now = tree_cpu(pid)
        if len(kids) >= children and now - last < 0.02:
            return
        last = now
        time.sleep(0.5)
    raise TimeoutError("worker did not settle")


def session_cpu(db: BenchDatabase, name_prefix: str = "tether-") -> dict[int, float]:
    """CPU seconds (user + system) used so far by each server process serving a session of the
    bench database whose application_name starts with ``name_prefix`` (a worker's sessions:
    tether-worker, tether-child, ...), read from /proc: the server must run on this machine."""
    rows = db.query(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE %s",
        (name_prefix + "%",),
    )
    used: dict[int, float] = {}
    for (pid,) in rows:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        used[pid] = times.user + times.system
    return used


def session_cpu_since(db: BenchDatabase, before: dict[int, float], name_prefix: str = "tether-") -> float:
    """CPU seconds the sessions of ``session_cpu`` used since ``before`` (a session opened since
    counts whole; one closed since is lost: read this before the worker stops)."""
    now = session_cpu(db, name_prefix)
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in now.items())


def cache_bytecode(*trees: Path) -> None:
    """Compile the sources of these trees (tether's src, bench/) to bytecode beside them, as
    pip does for an installed package: an editable install is not compiled, and a machine
    with PYTHONDONTWRITEBYTECODE set (this one) never caches it, so every worker started
    would compile ~180 modules again (about 0.5 s here), which the peers, installed from
    wheels, never pay. Start-up figures are meant with bytecode cached."""
    import compileall

    for tree in trees:
        compileall.compile_dir(str(tree), quiet=1, workers=1)
