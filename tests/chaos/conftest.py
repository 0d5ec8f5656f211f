"""Shared pieces of the chaos tests: the chaos app, fast recovery settings, and checks of rows.

Every process a test starts goes through the `workers` fixture (tests/conftest.py), which
SIGKILLs each worker's whole process group by pid at teardown, stopped (SIGSTOP) or not.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psutil
import psycopg
import pytest
from psycopg import sql

from tests.apps.support import attempt_rows, load_app_module, task_row
from tests.conftest import WorkerProcess, wait_until
from tether.db.embedded import EmbeddedServer

APP = "tests.apps.chaos:app"

#: Recovery in seconds instead of minutes (RecoveryConfig reads TETHER_* from the environment).
FAST: dict[str, str] = {
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "2000",
    "TETHER_RUNNING_STALE_THRESHOLD_MS": "2000",
    "TETHER_CHECK_INTERVAL_MS": "1000",
}
RUNNING_STALE_S = 2.0
CLAIMED_STALE_S = 2.0
CHECK_S = 1.0
HEARTBEAT_S = 1.0

Row = dict[str, Any]
Conn = psycopg.Connection[Any]


def ensure_chaos_ledger(conn: Conn) -> None:
    from tests.apps.chaos import LEDGER_DDL

    conn.execute(LEDGER_DDL)


@pytest.fixture
def chaos(database_url: str, db: Conn) -> ModuleType:
    """The chaos app module (bound to the test database), with an empty ledger."""
    ensure_chaos_ledger(db)
    db.execute("TRUNCATE tether_chaos_ledger")
    return load_app_module("chaos", database_url)


@pytest.fixture
def stopped_groups() -> Iterator[list[int]]:
    """Process groups a test SIGSTOPped: SIGCONT at teardown (the workers fixture then kills them)."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)


def token() -> str:
    return uuid.uuid4().hex


def db_now(conn: Conn) -> datetime:
    row = conn.execute("SELECT now() AS now").fetchone()
    assert row is not None
    return row["now"]


def runs(conn: Conn, tok: str) -> int:
    row = conn.execute("SELECT count(*) AS n FROM tether_chaos_ledger WHERE token = %s", (tok,)).fetchone()
    assert row is not None
    return int(row["n"])


def run_pids(conn: Conn, tok: str) -> list[int]:
    rows = conn.execute("SELECT pid FROM tether_chaos_ledger WHERE token = %s ORDER BY at", (tok,)).fetchall()
    return [r["pid"] for r in rows]


def status(conn: Conn, task_id: Any) -> str:
    return str(task_row(conn, task_id)["status"])


def statuses(conn: Conn, ids: list[Any]) -> dict[str, str]:
    rows = conn.execute(
        "SELECT id::text AS id, status FROM tether_tasks WHERE id = ANY(%s::uuid[])", ([str(i) for i in ids],)
    ).fetchall()
    return {r["id"]: r["status"] for r in rows}


def wait_status(conn: Conn, task_id: Any, wanted: str | set[str], timeout: float = 30) -> Row:
    want = {wanted} if isinstance(wanted, str) else wanted

    def reached() -> Row | None:
        row = task_row(conn, task_id)
        return row if row["status"] in want else None

    try:
        return wait_until(reached, timeout=timeout, message=f"task {task_id} to be {sorted(want)}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; row now: {task_row(conn, task_id)}") from None


def wait_all(conn: Conn, ids: list[Any], wanted: set[str], timeout: float = 30, why: str = "") -> None:
    def done() -> bool:
        now = statuses(conn, ids)
        return len(now) == len(ids) and all(s in wanted for s in now.values())

    try:
        wait_until(done, timeout=timeout, message=why or f"{len(ids)} task(s) to be {sorted(wanted)}")
    except AssertionError as exc:
        counts: dict[str, int] = {}
        for s in statuses(conn, ids).values():
            counts[s] = counts.get(s, 0) + 1
        raise AssertionError(f"{exc}; statuses now: {counts}") from None


def worker_row(conn: Conn, worker_id: str) -> Row:
    row = conn.execute("SELECT * FROM tether_workers WHERE id = %s", (worker_id,)).fetchone()
    assert row is not None, f"no registry row for worker {worker_id}"
    return dict(row)


def child_pids(worker: WorkerProcess) -> set[int]:
    """The worker's processes below its main one: its children, its fork server's."""
    try:
        return {c.pid for c in psutil.Process(worker.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def last_heartbeat(conn: Conn, task_id: Any, role: str) -> datetime | None:
    row = conn.execute(
        "SELECT max(sent_at) AS at FROM tether_heartbeats WHERE task_id = %s AND role = %s", (task_id, role)
    ).fetchone()
    return row["at"] if row else None


def check_history(conn: Conn, task_id: Any) -> tuple[Row, list[Row]]:
    """The task's attempt rows agree with the task; returns (task row, attempt rows).

    One row per attempt number; every row but the last is a failure that was retried; a
    terminal task's last row is its final outcome, for the attempt the task ended with; one
    retried row per retry counted on the task.
    """
    row = task_row(conn, task_id)
    attempts = attempt_rows(conn, task_id)
    numbers = [a["attempt"] for a in attempts]
    context = f"task {row}\nattempts {attempts}"
    assert len(numbers) == len(set(numbers)), context
    assert all(1 <= n <= row["attempt"] for n in numbers), context
    assert sum(a["will_retry"] for a in attempts) == row["retry_count"], context
    if row["status"] in ("COMPLETED", "FAILED"):
        assert attempts, context
        last = attempts[-1]
        assert last["outcome"] == row["status"] and not last["will_retry"], context
        assert last["attempt"] == row["attempt"], context
        assert last["error_code"] == row["error_code"], context
        earlier = attempts[:-1]
    else:
        earlier = attempts
    for a in earlier:  # a retried failure, or a durable sleep or wait (no retry counted)
        assert (a["outcome"] == "FAILED" and a["will_retry"]) or (
            a["outcome"] == "SUSPENDED" and not a["will_retry"]
        ), context
    return row, attempts


@pytest.fixture
def private_server() -> Iterator[EmbeddedServer]:
    """An embedded PostgreSQL for one test alone: one it restarts, or turns read-only (the
    others share the session's server)."""
    base = Path(tempfile.mkdtemp(prefix="tether-chaos-pg-", dir="/tmp"))
    base.chmod(0o755)  # as root the server runs as its own system user, who must get in
    server = EmbeddedServer.start(base / "data")
    try:
        yield server
    finally:
        server.stop()  # by its postmaster's pid
        shutil.rmtree(base, ignore_errors=True)


# -- a worker cut off from the database by its own login role (test_network_loss.py, metrics) --


def url_as(url: str, role: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{quote(role, safe='')}@{host}"))


@pytest.fixture
def worker_role(db: Any, database_url: str) -> Iterator[tuple[str, str]]:
    """A login role of its own for the worker to be cut off (NOLOGIN and its sessions ended):
    (role, its database URL)."""
    role = f"tether_chaos_{os.getpid()}_{secrets.token_hex(3)}"
    db.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(role)))
    try:
        yield role, url_as(database_url, role)
    finally:
        db.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))
        terminate(db, role)
        wait_until(
            lambda: not db.execute("SELECT 1 FROM pg_stat_activity WHERE usename = %s", (role,)).fetchone(),
            timeout=10,
            message=f"role {role}'s connections to go",
        )
        db.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def terminate(db: Any, role: str) -> int:
    rows = db.execute(
        "SELECT pg_terminate_backend(pid) AS ok FROM pg_stat_activity WHERE usename = %s", (role,)
    ).fetchall()
    return sum(1 for r in rows if r["ok"])


def migrated_for_chaos(url: str) -> None:
    """A database of a test's own server ready for the chaos app: migrated, with its ledger."""
    from tests.apps.chaos import LEDGER_DDL
    from tether.db.migrate import migrate

    with psycopg.connect(url, autocommit=True) as conn:
        migrate(conn)
        conn.execute(LEDGER_DDL)
