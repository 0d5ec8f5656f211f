"""Recovery scenarios: how fast a crashed task is recorded, and what an idle worker costs.

Every figure is a difference of database timestamps (``now()`` of the transaction that
wrote it, or of a ``SELECT now()`` read just before the kill), so they share one clock.
Workers are real subprocesses; a crash is a real SIGKILL, by pid or to the worker's own
process group (the session it was started in).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import statistics
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from bench.apps import make_app
from bench.infra import BenchDatabase, WorkerProcess, count_by_status, wait_for
from bench.scenarios import Context, Outcome, Row
from tether.broker.queries import _all as all_statements

# The recovery timing of scenarios 1, 2 and 4 (tether's defaults: 30 s / 300 s / 30 s).
FAST_RECOVERY_ENV = {
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "2000",
    "TETHER_RUNNING_STALE_THRESHOLD_MS": "2000",
    "TETHER_CHECK_INTERVAL_MS": "1000",
}
HEARTBEAT_S, THRESHOLD_S, CHECK_S = 1.0, 2.0, 1.0
CHILD_KILL_TARGET_S = 1.0
WORKER_KILL_MEDIAN_TARGET_S = 1.8
WORKER_KILL_MAX_S = THRESHOLD_S + CHECK_S
RESTART_TARGET_S = 3.0
COMMITS_TARGET = 2.0
HOLD_S = 3600.0  # hold(seconds) of the tasks that get killed: they only end by the crash
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "EXPIRED")
# PostgreSQL (15) reports a backend's counters to pg_stat_database at most once a second,
# and those of a backend that then stays idle only after 10 s (PGSTAT_IDLE_INTERVAL).
STATS_SETTLE_S = 11.0


# -- helpers ---------------------------------------------------------------------------------


def _connect(url: str) -> psycopg.Connection[dict[str, Any]]:
    return psycopg.connect(url, autocommit=True, row_factory=dict_row)


def _db_now(conn: psycopg.Connection[dict[str, Any]]) -> datetime:
    row = conn.execute("SELECT now() AS now").fetchone()
    assert row is not None
    now: datetime = row["now"]
    return now


def _task(conn: psycopg.Connection[dict[str, Any]], task_id: str) -> dict[str, Any]:
    row = conn.execute(
        "SELECT id, status, claimed_by_worker_id, started_at, failed_at, error_code, attempt"
        " FROM tether_tasks WHERE id = %s",
        (task_id,),
    ).fetchone()
    if row is None:
        raise RuntimeError(f"task {task_id} not found")
    return row


def _wait_task(
    conn: psycopg.Connection[dict[str, Any]],
    task_id: str,
    statuses: tuple[str, ...],
    timeout: float,
    watch: tuple[WorkerProcess, ...] = (),
    interval: float = 0.01,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        row = _task(conn, task_id)
        if row["status"] in statuses:
            return row
        for worker in watch:
            worker.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"task {task_id} still {row['status']} after {timeout:.0f}s, waiting for {statuses}"
            )
        time.sleep(interval)


def _runner_beats(
    conn: psycopg.Connection[dict[str, Any]], task_id: str, sender: str | None = None
) -> dict[str, Any]:
    """Runner heartbeats written for the task: how many, the last one and the pid it names."""
    row = conn.execute(
        "SELECT count(*) AS n, max(sent_at) AS last, (array_agg(pid ORDER BY sent_at DESC))[1] AS pid"
        " FROM tether_heartbeats WHERE task_id = %s AND role = 'runner'"
        " AND (%s::text IS NULL OR sender_id = %s)",
        (task_id, sender, sender),
    ).fetchone()
    assert row is not None
    return row


def _wait_runner_beat(
    conn: psycopg.Connection[dict[str, Any]], task_id: str, timeout: float, watch: tuple[WorkerProcess, ...]
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        beats = _runner_beats(conn, task_id)
        if beats["n"]:
            return beats
        for worker in watch:
            worker.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no runner heartbeat for task {task_id} after {timeout:.0f}s")
        time.sleep(0.02)


def _expect_crash(row: dict[str, Any]) -> None:
    if row["status"] != "FAILED" or row["error_code"] != "WORKER_CRASHED":
        raise RuntimeError(
            f"task {row['id']}: expected FAILED with WORKER_CRASHED, got {row['status']} {row['error_code']}"
        )


def _seconds(later: datetime, earlier: datetime) -> float:
    return (later - earlier).total_seconds()


# -- 1. a task child killed ------------------------------------------------------------------


def recovery_child_kill(ctx: Context) -> Outcome:
    runs = 3 if ctx.quick else 5
    ctx.db.reset_tasks()
    worker = ctx.start_worker(processes=2, env=FAST_RECOVERY_ENV)
    app = make_app(ctx.db.url)
    hold = app.tasks["hold"]
    results: list[dict[str, Any]] = []
    try:
        worker.wait_ready()
        with _connect(ctx.db.url) as conn:
            for _ in range(runs):
                # The child killed in the previous run has been replaced.
                wait_for("2 task children", lambda: len(worker.task_children()) >= 2, 60)
                task_id = str(hold.send(HOLD_S).id)
                _wait_task(conn, task_id, ("RUNNING",), 60, (worker,))
                beats = _wait_runner_beat(conn, task_id, 10, (worker,))
                children = {p.pid: p for p in worker.task_children()}
                child = children.get(beats["pid"])
                if child is None:
                    raise RuntimeError(
                        f"runner heartbeat names pid {beats['pid']}, not a task child of the worker "
                        f"({sorted(children)})"
                    )
                kill_at = _db_now(conn)
                child.kill()  # psutil: SIGKILL, after checking the pid still is this process
                row = _wait_task(conn, task_id, TERMINAL, 30, (worker,))
                _expect_crash(row)
                results.append(
                    {
                        "task_id": task_id,
                        "child_pid": child.pid,
                        "kill_at": str(kill_at),
                        "failed_at": str(row["failed_at"]),
                        "seconds": _seconds(row["failed_at"], kill_at),
                    }
                )
    finally:
        app.close()
        worker.stop()
    figures = [r["seconds"] for r in results]
    median, worst = statistics.median(figures), max(figures)
    ms = ", ".join(f"{f * 1000:.0f}" for f in figures)
    return Outcome(
        f"{runs} runs, SIGKILL to the child running hold(): failed_at - kill time median "
        f"{median * 1000:.0f} ms, max {worst * 1000:.0f} ms (runs: {ms} ms)",
        [
            Row(
                "recovery_child_kill",
                "failed_at - kill, median",
                median * 1000,
                "ms",
                f"< {CHILD_KILL_TARGET_S:g} s",
                median < CHILD_KILL_TARGET_S,
            ),
            Row(
                "recovery_child_kill",
                "failed_at - kill, max",
                worst * 1000,
                "ms",
                f"< {CHILD_KILL_TARGET_S:g} s",
                worst < CHILD_KILL_TARGET_S,
            ),
        ],
        {"runs": results, "median_s": median, "max_s": worst, "settings": FAST_RECOVERY_ENV},
    )


# -- 2. a whole worker killed, another one recovers its task ------------------------------------


def recovery_worker_kill(ctx: Context) -> Outcome:
    runs = 3 if ctx.quick else 5
    rng = random.Random(11)
    ctx.db.reset_tasks()
    workers = [ctx.start_worker(processes=2, env=FAST_RECOVERY_ENV, exclusive=False) for _ in range(2)]
    app = make_app(ctx.db.url)
    hold = app.tasks["hold"]
    results: list[dict[str, Any]] = []
    try:
        for worker in workers:
            worker.wait_ready()
        with _connect(ctx.db.url) as conn:
            for run in range(runs):
                task_id = str(hold.send(HOLD_S).id)
                row = _wait_task(conn, task_id, ("RUNNING",), 60, tuple(workers))
                ids = {w.registration()[0]: i for i, w in enumerate(workers)}
                a = ids[row["claimed_by_worker_id"]]  # A: the worker that runs it; B: the other one
                victim, survivor = workers[a], workers[1 - a]
                victim_id = row["claimed_by_worker_id"]
                # Kill at a random moment of the heartbeat cycle, as a crash of a long task would.
                _wait_runner_beat(conn, task_id, 10, tuple(workers))
                time.sleep(rng.uniform(0, HEARTBEAT_S))
                ports = victim.client_ports()
                kill_at = _db_now(conn)
                victim.kill_group(ports)
                row = _wait_task(conn, task_id, TERMINAL, 30, (survivor,), interval=0.02)
                _expect_crash(row)
                beats = _runner_beats(conn, task_id, victim_id)
                evidence = max(t for t in (row["started_at"], beats["last"]) if t is not None)
                results.append(
                    {
                        "task_id": task_id,
                        "killed_worker_pid": victim.pid,
                        "survivor_pid": survivor.pid,
                        "kill_at": str(kill_at),
                        "failed_at": str(row["failed_at"]),
                        "seconds": _seconds(row["failed_at"], kill_at),
                        "runner_heartbeats_before_kill": beats["n"],
                        # last sign of life (last runner heartbeat or start) -> kill
                        "kill_after_last_beat_s": _seconds(kill_at, evidence),
                        # failed_at - the moment the task turned stale (last sign + threshold)
                        "reaper_late_s": _seconds(row["failed_at"], evidence) - THRESHOLD_S,
                    }
                )
                if run < runs - 1:  # restart A
                    workers[a] = ctx.start_worker(processes=2, env=FAST_RECOVERY_ENV, exclusive=False)
                    workers[a].wait_ready()
    finally:
        app.close()
        for worker in workers:
            worker.stop()
    figures = [r["seconds"] for r in results]
    median, worst = statistics.median(figures), max(figures)
    each = ", ".join(f"{f:.2f}" for f in figures)
    late = ", ".join(f"{r['reaper_late_s'] * 1000:.0f}" for r in results)
    phase = ", ".join(f"{r['kill_after_last_beat_s']:.2f}" for r in results)
    return Outcome(
        f"{runs} runs, SIGKILL to worker A's process group, B's reaper recovers: failed_at - kill time "
        f"median {median:.2f} s, max {worst:.2f} s (runs: {each} s; kill came {phase} s after A's last "
        f"runner heartbeat; failed_at - (last heartbeat + {THRESHOLD_S:g} s): {late} ms)",
        [
            Row(
                "recovery_worker_kill",
                "failed_at - kill, median",
                median,
                "s",
                f"<= {WORKER_KILL_MEDIAN_TARGET_S:g} s",
                median <= WORKER_KILL_MEDIAN_TARGET_S,
            ),
            Row(
                "recovery_worker_kill",
                "failed_at - kill, max",
                worst,
                "s",
                f"<= {WORKER_KILL_MAX_S:g} s",
                worst <= WORKER_KILL_MAX_S,
            ),
            *(Row("recovery_worker_kill", f"run {i + 1}", f, "s") for i, f in enumerate(figures)),
        ],
        {"runs": results, "median_s": median, "max_s": worst, "settings": FAST_RECOVERY_ENV},
    )


# -- 3. a worker killed, a new one started on the same host (default settings) ------------------


def recovery_same_host_restart(ctx: Context) -> Outcome:
    runs = 2 if ctx.quick else 3
    ctx.db.reset_tasks()
    app = make_app(ctx.db.url)
    hold = app.tasks["hold"]
    results: list[dict[str, Any]] = []
    try:
        with _connect(ctx.db.url) as conn:
            for _ in range(runs):
                a = ctx.start_worker(processes=2, exclusive=False)  # tether's default recovery settings
                a.wait_ready()
                task_id = str(hold.send(HOLD_S).id)
                _wait_task(conn, task_id, ("RUNNING",), 60, (a,))
                ports = a.client_ports()
                kill_at = _db_now(conn)
                a.kill_group(ports)  # returns once A's main process is reaped: its pid is gone
                b = ctx.start_worker(processes=2, exclusive=False)
                try:
                    row = _wait_task(conn, task_id, TERMINAL, 60, (b,), interval=0.02)
                    _expect_crash(row)
                    _, b_started = b.registration()
                finally:
                    b.stop()
                results.append(
                    {
                        "task_id": task_id,
                        "killed_worker_pid": a.pid,
                        "new_worker_pid": b.pid,
                        "kill_at": str(kill_at),
                        "b_registered_at": str(b_started),
                        "failed_at": str(row["failed_at"]),
                        "since_b_registered_s": _seconds(row["failed_at"], b_started),
                        "since_kill_s": _seconds(row["failed_at"], kill_at),
                        "kill_to_b_registered_s": _seconds(b_started, kill_at),
                    }
                )
    finally:
        app.close()
    since_b = [r["since_b_registered_s"] for r in results]
    since_kill = [r["since_kill_s"] for r in results]
    startup = ", ".join(f"{r['kill_to_b_registered_s']:.2f}" for r in results)
    return Outcome(
        f"{runs} runs, default thresholds: A killed with hold() RUNNING, then B started: failed_at - B "
        f"registered {', '.join(f'{s * 1000:.0f}' for s in since_b)} ms; failed_at - kill "
        f"{', '.join(f'{s:.2f}' for s in since_kill)} s (of which B's start-up to registration "
        f"{startup} s)",
        [
            Row(
                "recovery_same_host_restart",
                "failed_at - B registered, max",
                max(since_b),
                "s",
                f"< {RESTART_TARGET_S:g} s",
                max(since_b) < RESTART_TARGET_S,
            ),
            Row(
                "recovery_same_host_restart",
                "failed_at - kill (B started at once), max",
                max(since_kill),
                "s",
                f"< {RESTART_TARGET_S:g} s",
                max(since_kill) < RESTART_TARGET_S,
            ),
        ],
        {"runs": results, "settings": "tether defaults (no TETHER_* recovery variables)"},
    )


# -- 4. commits per second of a worker holding 50 running tasks --------------------------------


def commits_per_second(ctx: Context) -> Outcome:
    window = 10.0 if ctx.quick else 20.0
    variants: list[tuple[str, tuple[str, ...]]] = [("--prefetch 0", ("--prefetch", "0"))]
    if not ctx.quick:
        variants.append(("default prefetch", ()))
    measured: dict[str, dict[str, Any]] = {}
    with _StatementLog(ctx.db) as statement_log:
        for label, args in variants:
            measured[label] = _idle_commits(ctx, args, window, statement_log)
    rows = []
    parts = []
    for label, m in measured.items():
        target = label == "--prefetch 0"
        rows.append(
            Row(
                "commits_per_second",
                f"50 RUNNING, {label}, commits/s",
                m["commits_per_s"],
                "",
                f"<= {COMMITS_TARGET:g}/s" if target else None,
                (m["commits_per_s"] <= COMMITS_TARGET) if target else None,
            )
        )
        parts.append(
            f"{label}: {m['commits']} commits in {m['window_s']:.1f}s = {m['commits_per_s']:.2f}/s"
            f" ({m['attribution']})"
        )
    return Outcome(
        f"1 worker --processes 50, 50 hold() RUNNING, 1 s/2 s/1 s settings; xact_commit of the bench "
        f"database over {window:g}s: " + "; ".join(parts),
        rows,
        {
            "window_s": window,
            "variants": measured,
            "settings": FAST_RECOVERY_ENV,
            "server_log": str(statement_log.path) if statement_log.path else None,
        },
    )


def _idle_commits(
    ctx: Context, args: tuple[str, ...], window: float, statement_log: _StatementLog
) -> dict[str, Any]:
    n = 50
    ctx.db.reset_tasks()
    worker = ctx.start_worker(processes=n, extra_args=args, env=FAST_RECOVERY_ENV)
    app = make_app(ctx.db.url)
    try:
        worker.wait_ready(timeout=300)
        app.tasks["hold"].send_many([(HOLD_S,)] * n)
        app.close()

        def all_running() -> bool:
            worker.check_alive()
            return bool(ctx.db.query("SELECT count(*) FROM tether_tasks WHERE status = 'RUNNING'")[0][0] == n)

        try:
            wait_for(f"{n} tasks RUNNING", all_running, 300, interval=0.2)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {count_by_status(ctx.db)}") from None
        vacuums_before = _autovacuum_runs(ctx.db)
        time.sleep(STATS_SETTLE_S)  # the start commits reach pg_stat_database before the window opens
        with _connect(ctx.db.server_url) as server, _ActivitySampler(ctx.db) as sampler:
            # Read from the server's own database: not one of these reads is a bench-database commit.
            before, t0 = _xact_commit(server, ctx.db.name)
            offset = statement_log.offset()
            time.sleep(window)
            after, t1 = _xact_commit(server, ctx.db.name)
            logged = statement_log.read(offset)
        vacuums_after = _autovacuum_runs(ctx.db)
        worker.check_alive()
        running = ctx.db.query("SELECT count(*) FROM tether_tasks WHERE status = 'RUNNING'")[0][0]
        if running != n:
            raise RuntimeError(f"only {running} of {n} tasks still RUNNING after the window")
    finally:
        app.close()
        worker.kill_group()  # 50 tasks sleeping for an hour: a graceful stop would wait out its grace period
    own = 0  # this scenario's own queries during the window all went to the server's own database
    seconds = _seconds(t1, t0)
    commits = after - before - own
    by_app = sampler.by_application(since=t0)
    attribution = _attribute(logged, sampler.app_of_pid(), commits)
    return {
        "worker_args": ["--processes", str(n), *args],
        "xact_commit_before": before,
        "xact_commit_after": after,
        "own_transactions_subtracted": own,
        "window_s": seconds,
        "commits": commits,
        "commits_per_s": commits / seconds,
        "autovacuum_runs_during": vacuums_after - vacuums_before,
        "pg_stat_activity": by_app,
        "server_log": logged is not None,
        "by_loop": attribution["by_loop"],
        "attribution": attribution["text"],
    }


def _xact_commit(server: psycopg.Connection[dict[str, Any]], dbname: str) -> tuple[int, datetime]:
    row = server.execute(
        "SELECT xact_commit, clock_timestamp() AS at FROM pg_stat_database WHERE datname = %s", (dbname,)
    ).fetchone()
    assert row is not None
    return int(row["xact_commit"]), row["at"]


def _autovacuum_runs(db: BenchDatabase) -> int:
    return int(
        db.query("SELECT coalesce(sum(autovacuum_count + autoanalyze_count), 0) FROM pg_stat_user_tables")[0][
            0
        ]
    )


class _ActivitySampler:
    """pg_stat_activity of the bench database every 100 ms, read from the server's own database.

    A statement seen = a new (pid, query_start). Two statements of one backend within one
    sampling interval show as one: a lower bound, and the application name of every pid.
    """

    def __init__(self, db: BenchDatabase, interval: float = 0.1) -> None:
        self.db = db
        self.interval = interval
        self.seen: dict[tuple[int, datetime], tuple[str, str]] = {}
        self.apps: dict[int, str] = {}
        self.backends: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-activity-sampler", daemon=True)

    def __enter__(self) -> _ActivitySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with _connect(self.db.server_url) as conn:
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT pid, application_name, backend_type, query_start, query FROM pg_stat_activity"
                    " WHERE datname = %s",
                    (self.db.name,),
                ).fetchall()
                self.backends = Counter(r["application_name"] or r["backend_type"] for r in rows)
                for r in rows:
                    app = r["application_name"] or r["backend_type"]
                    self.apps[r["pid"]] = app
                    if r["query_start"] is not None:
                        self.seen[(r["pid"], r["query_start"])] = (app, _statement_name(r["query"] or ""))
                self._stop.wait(self.interval)

    def app_of_pid(self) -> dict[int, str]:
        return dict(self.apps)

    def by_application(self, since: datetime) -> dict[str, Any]:
        """Statements seen per application name, among those started at or after ``since``."""
        out: dict[str, Any] = {}
        for (_, started), (app, name) in self.seen.items():
            if started < since:
                continue
            entry = out.setdefault(app, {"statements_seen": 0, "last_statements": Counter()})
            entry["statements_seen"] += 1
            entry["last_statements"][name] += 1
        for app, entry in out.items():
            entry["backends"] = self.backends.get(app, 0)
            entry["last_statements"] = dict(entry["last_statements"])
        return out


_PLACEHOLDER = re.compile(r"%\(\w+\)s|\$\d+")


def _normalise(text: str) -> str:
    return " ".join(_PLACEHOLDER.sub("?", text).split())


def _named_statements() -> list[tuple[str, str]]:
    return [(name, _normalise(text)) for name, text in all_statements().items()]


def _statement_name(text: str) -> str:
    """tether's name for a statement (by its SQL), or its first words."""
    t = _normalise(text)
    if not t:
        return "(empty statement)"
    word = t.split()[0].upper()
    if word in ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE"):
        return word
    for name, known in _named_statements():
        if t == known or (len(t) >= 60 and known.startswith(t[:200])) or t.startswith(known[:200]):
            return name
    return t[:60]


class _StatementLog:
    """The server's statement log for the bench database, when the server log can be read.

    Sets ``log_statement = 'all'`` on the bench database only (a per-database setting that
    applies to sessions opened afterwards and disappears with the database) and reads what
    the server appended to its log file during a window. Needs a superuser and a server
    on this machine with a readable log (logging_collector, or Debian's /var/log/postgresql);
    ``TETHER_BENCH_SERVER_LOG`` names the file explicitly. Otherwise: None, and the
    attribution falls back to pg_stat_activity samples.
    """

    def __init__(self, db: BenchDatabase) -> None:
        self.db = db
        self.path: Path | None = None
        self.prefix_ok = False
        self.enabled = False

    def __enter__(self) -> _StatementLog:
        try:
            self.path = self._find()
            if self.path is not None:
                with psycopg.connect(self.db.server_url, autocommit=True) as conn:
                    conn.execute(
                        sql.SQL("ALTER DATABASE {} SET log_statement = 'all'").format(
                            sql.Identifier(self.db.name)
                        )
                    )
                self.enabled = True
        except (psycopg.Error, OSError):
            self.path = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            with (
                contextlib.suppress(psycopg.Error),
                psycopg.connect(self.db.server_url, autocommit=True) as conn,
            ):
                conn.execute(
                    sql.SQL("ALTER DATABASE {} RESET log_statement").format(sql.Identifier(self.db.name))
                )

    def _find(self) -> Path | None:
        explicit = os.environ.get("TETHER_BENCH_SERVER_LOG")
        candidates: list[Path] = [Path(explicit)] if explicit else []
        host = urlsplit(self.db.server_url).hostname
        if not explicit and host not in (None, "", "127.0.0.1", "localhost", "::1"):
            return None  # another machine's server: its log is not ours to read
        with _connect(self.db.server_url) as conn:
            row = conn.execute(
                "SELECT pg_current_logfile() AS current, current_setting('data_directory') AS data,"
                " current_setting('cluster_name') AS cluster, current_setting('log_line_prefix') AS prefix,"
                " (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AS superuser"
            ).fetchone()
        assert row is not None
        if not row["superuser"]:
            return None
        # The parser below reads lines that start with '%m [%p] ' and name user@database.
        self.prefix_ok = row["prefix"].startswith("%m [%p] ") and "%d" in row["prefix"]
        if not self.prefix_ok:
            return None
        if row["current"]:
            current = Path(row["current"])
            candidates.append(current if current.is_absolute() else Path(row["data"]) / current)
        if row["cluster"] and "/" in row["cluster"]:  # Debian: '15/main'
            version, name = row["cluster"].split("/", 1)
            candidates.append(Path(f"/var/log/postgresql/postgresql-{version}-{name}.log"))
        for path in candidates:
            if path.is_file() and os.access(path, os.R_OK):
                return path
        return None

    def offset(self) -> int:
        return self.path.stat().st_size if self.enabled and self.path else 0

    _ENTRY = re.compile(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \S+ \[(\d+)\] \S*@(\S*) LOG:  "
        r"(?:statement|execute [^:]*): ?(.*)$"
    )

    def read(self, offset: int) -> list[tuple[int, str]] | None:
        """(pid, statement) for each statement of the bench database logged since ``offset``."""
        if not self.enabled or self.path is None:
            return None
        with open(self.path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", errors="replace")
        out: list[tuple[int, list[str]]] = []
        collecting = False
        for line in text.splitlines():
            if line.startswith("\t"):  # a continuation line of the entry above
                if collecting:
                    out[-1][1].append(line)
                continue
            m = self._ENTRY.match(line)
            collecting = bool(m and m.group(2) == self.db.name)
            if collecting and m:
                out.append((int(m.group(1)), [m.group(3)]))
        return [(pid, "\n".join(parts)) for pid, parts in out]


LOOPS = {
    "write_heartbeats": "heartbeat",
    "reaper_lock": "reaper tick",
    "next_due_in": "reaper next_due_in",
    "claim_tasks": "claim poll",
    "(empty statement)": "pool check (empty statement)",
}


def _attribute(logged: list[tuple[int, str]] | None, apps: dict[int, str], commits: int) -> dict[str, Any]:
    """Transactions of the window by the loop that ran them, from the server's statement log.

    A transaction is a COMMIT after BEGIN, or one statement outside BEGIN..COMMIT
    (autocommit), the empty statement included: psycopg_pool's connection check on
    checkout sends one, and PostgreSQL commits it as a transaction. It is named after
    its first tether statement. Not in the log: the commit of a new connection's start-up.
    """
    if logged is None:
        return {
            "by_loop": None,
            "text": "server log not readable: no per-loop attribution; see pg_stat_activity",
        }
    by_loop: Counter[str] = Counter()
    open_tx: dict[int, list[str]] = {}
    for pid, statement in logged:
        name = _statement_name(statement)
        if name == "BEGIN":
            open_tx[pid] = []
        elif name in ("COMMIT", "ROLLBACK"):
            names = open_tx.pop(pid, None)
            if name == "COMMIT":
                by_loop[_loop_of(names or [], apps.get(pid, "?"))] += 1
        elif name in ("SAVEPOINT", "RELEASE"):
            continue
        elif pid in open_tx:
            open_tx[pid].append(name)
        else:
            by_loop[_loop_of([name], apps.get(pid, "?"))] += 1
    logged_total = sum(by_loop.values())
    by_loop_dict = dict(by_loop.most_common())
    by_loop_dict["not in the log (e.g. new connections)"] = commits - logged_total
    text = "server log: " + ", ".join(f"{k} {v}" for k, v in by_loop_dict.items())
    return {"by_loop": by_loop_dict, "text": text}


def _loop_of(names: list[str], app: str) -> str:
    for name in names:
        if name in LOOPS:
            return LOOPS[name]
    return f"{app}: {names[0] if names else 'empty transaction'}"


RECOVERY_SCENARIOS = {
    "recovery_child_kill": recovery_child_kill,
    "recovery_worker_kill": recovery_worker_kill,
    "recovery_same_host_restart": recovery_same_host_restart,
    "commits_per_second": commits_per_second,
}
