"""The app most integration tests run: tasks with observable side effects.

Every task that runs writes a row to tether_test_ledger (its task id comes
from the TETHER_TASK_ID-free trick of passing a token argument), so tests can
count how many times each task's code ran.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from uuid import UUID

import psycopg
from pydantic import BaseModel

from tests.apps.support import machinery_url
from tether import AppConfig, ErrorCode, RetryPolicy, TaskError, TaskResult, Tether

app = Tether(AppConfig(queues=["default", "images", "low"]))


LEDGER_DDL = (
    "CREATE TABLE IF NOT EXISTS tether_test_ledger (token text, pid int, at timestamptz DEFAULT now())"
)


_ledger_conn: psycopg.Connection[tuple[object, ...]] | None = None


def _ledger_connection() -> psycopg.Connection[tuple[object, ...]]:
    """This process's ledger connection, checked before each use (opening one per run is slow).

    The check happens before the insert, so a connection lost between tasks (a database
    restart in a chaos test) is replaced without any doubt about whether a row was written.
    """
    global _ledger_conn
    conn = _ledger_conn
    if conn is not None and not conn.closed:
        try:
            conn.execute("SELECT 1")
            return conn
        except psycopg.OperationalError:
            conn.close()
    conn = psycopg.connect(machinery_url(), autocommit=True, application_name="tether-test-ledger")
    # Concurrent CREATE TABLE IF NOT EXISTS can still collide in the catalog: the loser
    # finds the table there (tests also create it up front, before starting workers).
    with contextlib.suppress(psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
        conn.execute(LEDGER_DDL)
    _ledger_conn = conn
    return conn


def ledger(token: str) -> None:
    """Record one execution of the task carrying ``token`` (a side effect tests can count).

    A failure of the insert itself is raised, never retried: a retry could count one run twice.
    """
    conn = _ledger_connection()
    try:
        conn.execute("INSERT INTO tether_test_ledger (token, pid) VALUES (%s, %s)", (token, os.getpid()))
    except psycopg.OperationalError:
        conn.close()
        raise


@app.task("add")
def add(a: int, b: int) -> TaskResult[int, TaskError]:
    return TaskResult(ok=a + b)


@app.task("noop")
def noop() -> TaskResult[None, TaskError]:
    return TaskResult(ok=None)


@app.task("record")
def record(token: str) -> TaskResult[str, TaskError]:
    ledger(token)
    return TaskResult(ok=token)


@app.task("sleep")
def sleep(seconds: float, token: str = "") -> TaskResult[float, TaskError]:
    if token:
        ledger(token)
    time.sleep(seconds)
    return TaskResult(ok=seconds)


@app.task("fail")
def fail(code: str, message: str = "it failed") -> TaskResult[None, TaskError]:
    return TaskResult(err=TaskError(code, message, {"at": "fail"}))


@app.task("boom")
def boom(message: str) -> TaskResult[None, TaskError]:
    raise RuntimeError(message)


@app.task(
    "flaky",
    retry_policy=RetryPolicy.fixed(0.2, max_retries=2, auto_retry_for=["TRANSIENT"], jitter=0),
)
def flaky(token: str, fail_times: int) -> TaskResult[int, TaskError]:
    """Fails with TRANSIENT the first ``fail_times`` runs (counted in the ledger)."""
    ledger(token)
    row = (
        _ledger_connection()
        .execute("SELECT count(*) FROM tether_test_ledger WHERE token = %s", (token,))
        .fetchone()
    )
    runs = row[0] if row else 0
    if runs <= fail_times:
        return TaskResult(err=TaskError("TRANSIENT", f"run {runs} fails"))
    return TaskResult(ok=runs)


@app.task(
    "always_crashy",
    retry_policy=RetryPolicy.exponential(
        0.1, max_retries=1, auto_retry_for=[ErrorCode.UNHANDLED_EXCEPTION], jitter=0
    ),
)
def always_crashy(token: str) -> TaskResult[None, TaskError]:
    ledger(token)
    raise ValueError("never works")


@app.task("crash_child")
def crash_child(token: str) -> TaskResult[None, TaskError]:
    ledger(token)
    os._exit(13)  # the child process dies mid-task


@dataclass
class Point:
    x: int
    y: int


class Order(BaseModel):
    id: UUID
    total: Decimal
    placed_at: datetime


@app.task("typed")
def typed(point: Point, order: Order, when: datetime) -> TaskResult[dict[str, object], TaskError]:
    assert isinstance(point, Point), type(point)
    assert isinstance(order, Order), type(order)
    return TaskResult(ok={"sum": point.x + point.y, "total": order.total, "when": when, "id": order.id})


@app.task("echo_async")
async def echo_async(value: str) -> TaskResult[str, TaskError]:
    return TaskResult(ok=value.upper())


@app.task("freeze_count")
def freeze_count() -> TaskResult[int, TaskError]:
    """How many objects this child keeps out of garbage collection (worker/heap.py)."""
    return TaskResult(ok=gc.get_freeze_count())


@app.task("freeze_count_async")
async def freeze_count_async() -> TaskResult[int, TaskError]:
    return TaskResult(ok=gc.get_freeze_count())


@app.task("plain_return")
def plain_return(value: int) -> int:
    return value * 2


@app.task(
    "retry_later",
    retry_policy=RetryPolicy.fixed(60, max_retries=1, auto_retry_for=["TRANSIENT"], jitter=0),
)
def retry_later(token: str) -> TaskResult[None, TaskError]:
    """Always fails TRANSIENT; its one retry waits a minute (tests read the row meanwhile)."""
    ledger(token)
    return TaskResult(err=TaskError("TRANSIENT", "try again in a minute"))


@app.task("limited", time_limit=0.5)
def limited(seconds: float, token: str = "") -> TaskResult[float, TaskError]:
    """Sleeps; killed by its worker once it has run for 0.5 s."""
    if token:
        ledger(token)
    time.sleep(seconds)
    return TaskResult(ok=seconds)


@app.task(
    "limited_retry",
    time_limit=timedelta(milliseconds=500),
    retry_policy=RetryPolicy.fixed(
        0.1, max_retries=1, auto_retry_for=[ErrorCode.TIME_LIMIT_EXCEEDED], jitter=0
    ),
)
def limited_retry(token: str) -> TaskResult[None, TaskError]:
    """Always outlives its 0.5 s limit; retried once for it."""
    ledger(token)
    time.sleep(3600)
    return TaskResult(ok=None)


@app.task("nul_result")
def nul_result() -> TaskResult[str, TaskError]:
    """Returns a string PostgreSQL cannot store (a NUL character)."""
    return TaskResult(ok="a\x00b")


@app.task("boom_nul")
def boom_nul() -> TaskResult[None, TaskError]:
    """Raises an exception whose message PostgreSQL cannot store (a NUL character)."""
    raise RuntimeError("bad byte \x00 here")
