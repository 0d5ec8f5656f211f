"""The app the chaos tests run: tasks that hold a slot, crash their process, or retry a crash.

Every run of a task's code writes one row to ``tether_chaos_ledger`` before doing anything
else, so a test can count how many times each task's code started. The ledger must stay
exact while connections are terminated and the server restarts under it, so unlike
tests/apps/basic.py it retries a failed insert: each run carries its own ``run_id`` (primary
key, ``ON CONFLICT DO NOTHING``), so a retried insert whose first try did commit cannot
count the run twice.

``build(config)`` registers the same tasks on a new app, for a test that runs its own server
(the worker still loads ``tests.apps.chaos:app``, bound by TETHER_DATABASE_URL).
"""

from __future__ import annotations

import os
import time
import uuid

import psycopg
import psycopg.errors

from tests.apps.gate_locks import wait_for_gate
from tests.apps.support import machinery_url
from tether import AppConfig, ErrorCode, RetryPolicy, TaskError, TaskResult, Tether

LEDGER_DDL = (
    "CREATE TABLE IF NOT EXISTS tether_chaos_ledger ("
    " run_id uuid PRIMARY KEY, token text NOT NULL, pid int NOT NULL,"
    " at timestamptz NOT NULL DEFAULT now())"
)
LEDGER_GIVE_UP_S = 120.0

#: Tasks that retry a crash: up to 3 retries, 0.2 s apart.
CRASH_RETRY = RetryPolicy.fixed(0.2, max_retries=3, auto_retry_for=[ErrorCode.WORKER_CRASHED], jitter=0)
#: One retry after a crash, 1 s later: long enough for a test to see the task PENDING again.
ONE_CRASH_RETRY = RetryPolicy.fixed(1.0, max_retries=1, auto_retry_for=[ErrorCode.WORKER_CRASHED], jitter=0)

_conn: psycopg.Connection[tuple[object, ...]] | None = None


def _connection() -> psycopg.Connection[tuple[object, ...]]:
    global _conn
    if _conn is None or _conn.closed:
        _conn = psycopg.connect(
            machinery_url(),
            autocommit=True,
            connect_timeout=5,
            application_name="tether-chaos-ledger",
        )
    return _conn


def ledger(token: str) -> int:
    """Record one run of the task carrying ``token``; returns how many runs it has had (this one included)."""
    run_id = uuid.uuid4()
    deadline = time.monotonic() + LEDGER_GIVE_UP_S
    delay = 0.05
    while True:
        try:
            conn = _connection()
            conn.execute(
                "INSERT INTO tether_chaos_ledger (run_id, token, pid) VALUES (%s, %s, %s)"
                " ON CONFLICT (run_id) DO NOTHING",
                (run_id, token, os.getpid()),
            )
            row = conn.execute(
                "SELECT count(*) FROM tether_chaos_ledger WHERE token = %s", (token,)
            ).fetchone()
            return int(row[0]) if row else 0
        except (psycopg.OperationalError, psycopg.errors.ReadOnlySqlTransaction):
            # Lost, or the server turned read-only (test_read_only_primary.py): write again.
            if _conn is not None:
                _conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def build(config: AppConfig | None = None) -> Tether:
    app = Tether(config if config is not None else AppConfig(queues=["default"]))

    @app.task("hold")
    def hold(token: str, seconds: float = 0.0) -> TaskResult[str, TaskError]:
        """Runs once, then holds its child for ``seconds``."""
        ledger(token)
        time.sleep(seconds)
        return TaskResult(ok=token)

    @app.task("hold_gated")
    def hold_gated(token: str, key: int) -> TaskResult[str, TaskError]:
        """Runs once, then holds its child until the test lets gate ``key`` go (tests/apps/gates.py)."""
        ledger(token)
        wait_for_gate(key)
        return TaskResult(ok=token)

    @app.task("hold_then_mark")
    def hold_then_mark(token: str, seconds: float) -> TaskResult[str, TaskError]:
        """Like hold, and the last thing its code does is write ``token + ':done'`` to the ledger."""
        ledger(token)
        time.sleep(seconds)
        ledger(token + ":done")
        return TaskResult(ok=token)

    @app.task("hold_retry", retry_policy=ONE_CRASH_RETRY)
    def hold_retry(
        token: str, first_seconds: float, later_seconds: float = 0.0
    ) -> TaskResult[int, TaskError]:
        """Holds its child for ``first_seconds`` on the first run, ``later_seconds`` after."""
        runs = ledger(token)
        time.sleep(first_seconds if runs == 1 else later_seconds)
        return TaskResult(ok=runs)

    @app.task("crash_child")
    def crash_child(token: str) -> TaskResult[None, TaskError]:
        """The child process dies mid-task (no retry policy)."""
        ledger(token)
        os._exit(13)

    @app.task("crash_once", retry_policy=ONE_CRASH_RETRY)
    def crash_once(token: str) -> TaskResult[int, TaskError]:
        """The child dies on the first run; the retry succeeds."""
        runs = ledger(token)
        if runs == 1:
            os._exit(13)
        return TaskResult(ok=runs)

    @app.task("work")
    def work(token: str, ms: int = 0) -> TaskResult[str, TaskError]:
        ledger(token)
        time.sleep(ms / 1000)
        return TaskResult(ok=token)

    @app.task("work_retry", retry_policy=CRASH_RETRY)
    def work_retry(token: str, ms: int = 0) -> TaskResult[str, TaskError]:
        ledger(token)
        time.sleep(ms / 1000)
        return TaskResult(ok=token)

    return app


app = build()
