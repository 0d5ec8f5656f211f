"""Commit attribution: what a worker that looks idle costs the database, and which loop costs it.

``idle_commits`` is the measurement of the ``commits_per_second`` scenario (bench/recovery.py):
it reads ``xact_commit`` of the bench database in ``pg_stat_database`` around a window, and
names the window's transactions after the tether statements that made them, from the
server's statement log (``StatementLog``) when it can be read, and from ``pg_stat_activity``
samples (``_ActivitySampler``) in any case.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

from bench.apps import make_app
from bench.infra import BenchDatabase, connect_dict, count_by_status, wait_for
from bench.scenarios import Context
from tether.broker.queries import _all as all_statements

# PostgreSQL (15) reports a backend's counters to pg_stat_database at most once a second,
# and those of a backend that then stays idle only after 10 s (PGSTAT_IDLE_INTERVAL).
STATS_SETTLE_S = 11.0


def idle_commits(
    ctx: Context,
    args: tuple[str, ...],
    window: float,
    statement_log: StatementLog,
    *,
    env: dict[str, str],
    hold_s: float,
) -> dict[str, Any]:
    """Commits of the bench database while one worker (``--processes 50 *args``, ``env``) holds
    50 RUNNING ``hold(hold_s)`` tasks, over ``window`` seconds, and which loop made them."""
    n = 50
    ctx.db.reset_tasks()
    worker = ctx.start_worker(processes=n, extra_args=args, env=env)
    app = make_app(ctx.db.url)
    try:
        worker.wait_ready(timeout=300)
        app.tasks["hold"].send_many([(hold_s,)] * n)
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
        with connect_dict(ctx.db.server_url) as server, _ActivitySampler(ctx.db) as sampler:
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
    seconds = (t1 - t0).total_seconds()
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
        with connect_dict(self.db.server_url) as conn:
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


class StatementLog:
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

    def __enter__(self) -> StatementLog:
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
        with connect_dict(self.db.server_url) as conn:
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
    "reaper_pass_due_in": "reaper tick",
    "claim_reaper_pass": "reaper pass",
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
