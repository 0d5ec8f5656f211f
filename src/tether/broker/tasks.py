"""Producer-side task statements (tasks.sql): send, read, wait, cancel; listings and counts.

Rows come back as frozen dataclasses whose fields are the statement's columns (statuses as
TaskStatus): ``dataclasses.asdict`` of one is what the CLI and the dashboard print as JSON.
A task read whole is a TaskInfo (broker/rows.py), public as ``tether.TaskInfo``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from tether import tracing
from tether.broker.answers import Answer
from tether.broker.queries import q
from tether.broker.steps import list_steps
from tether.broker.suspensions import suspension_states
from tether.broker.types import AsyncConn, Conn, with_status
from tether.result import TaskStatus

if TYPE_CHECKING:
    # The public row types (rows.py), imported by the reads that return them on first use:
    # a worker and a send never build them.
    from tether.broker.rows import AttemptInfo, TaskInfo

# -- sending ----------------------------------------------------------------


# Not frozen: send() builds one per call on its hot path, and a frozen dataclass's
# __init__ costs ~1.5 us more (object.__setattr__ per field) than a plain one.
@dataclass(slots=True)
class SendSpec:
    """What every task of one send shares: its name and options (retry_policy as JSON text)."""

    name: str
    queue: str
    priority: int
    max_retries: int
    retry_policy: str | None
    good_until: datetime | None
    delay: timedelta
    durable: bool  # False: the commit does not wait for its WAL flush
    run_at: datetime | None = None  # a time asked for; None: now() + delay
    # True inside the caller's transaction: NOTIFY whenever due, never take the waiter lock
    # (tasks.sql says why).
    notify_always: bool = False
    # Flow control (docs/limits.md): the key of every task of the send, or one per task
    # (a send_many whose task takes its key from an argument; None items: no key).
    concurrency_key: str | None = None
    concurrency_keys: tuple[str | None, ...] | None = None

    def params(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "queue": self.queue,
            "priority": self.priority,
            "max_retries": self.max_retries,
            "retry_policy": self.retry_policy,
            "good_until": self.good_until,
            "delay": self.delay,
            "durable": self.durable,
            "run_at": self.run_at,
            "notify_always": self.notify_always,
            "trace_context": tracing.outgoing(),
            "concurrency_key": self.concurrency_key,
        }


def insert_task(conn: Conn, spec: SendSpec, task_id: UUID, args: str, kwargs: str) -> None:
    """Insert one PENDING task (args and kwargs as JSON text), NOTIFYing if a worker needs telling."""
    conn.execute(q("insert_task"), _insert_params(spec, task_id, args, kwargs))


async def insert_task_async(conn: AsyncConn, spec: SendSpec, task_id: UUID, args: str, kwargs: str) -> None:
    """insert_task on an async connection (a send inside the caller's async transaction)."""
    await conn.execute(q("insert_task"), _insert_params(spec, task_id, args, kwargs))


def _insert_params(spec: SendSpec, task_id: UUID, args: str, kwargs: str) -> dict[str, Any]:
    # The send path: one dict, built in one go.
    return {
        "id": task_id,
        "name": spec.name,
        "queue": spec.queue,
        "priority": spec.priority,
        "args": args,
        "kwargs": kwargs,
        "max_retries": spec.max_retries,
        "retry_policy": spec.retry_policy,
        "good_until": spec.good_until,
        "delay": spec.delay,
        "durable": spec.durable,
        "run_at": spec.run_at,
        "notify_always": spec.notify_always,
        "trace_context": tracing.outgoing(),
        "concurrency_key": spec.concurrency_key,
    }


def insert_tasks(
    conn: Conn, spec: SendSpec, ids: Sequence[UUID], args: Sequence[str], kwargs: Sequence[str], *, chunk: int
) -> None:
    """Insert tasks, one statement per ``chunk`` of them; the caller owns the transaction that
    makes them all or none.

    ``args[i]`` and ``kwargs[i]`` are task ``ids[i]``'s, as JSON text.
    """
    statement = q("insert_tasks")
    for params in _batches(spec, ids, args, kwargs, chunk):
        conn.execute(statement, params)


async def insert_tasks_async(
    conn: AsyncConn,
    spec: SendSpec,
    ids: Sequence[UUID],
    args: Sequence[str],
    kwargs: Sequence[str],
    *,
    chunk: int,
) -> None:
    """insert_tasks on an async connection (inside the caller's async transaction)."""
    statement = q("insert_tasks")
    for params in _batches(spec, ids, args, kwargs, chunk):
        await conn.execute(statement, params)


def _batches(
    spec: SendSpec, ids: Sequence[UUID], args: Sequence[str], kwargs: Sequence[str], chunk: int
) -> Iterator[dict[str, Any]]:
    base = spec.params()
    for start in range(0, len(ids), chunk):
        end = start + chunk
        yield {
            **base,
            "ids": ",".join(map(str, ids[start:end])),
            "args": "[" + ",".join(args[start:end]) + "]",
            "kwargs": "[" + ",".join(kwargs[start:end]) + "]",
            "keys": None if spec.concurrency_keys is None else json.dumps(spec.concurrency_keys[start:end]),
        }


# -- reading one task -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskState:
    """A task's status and its stored result (parsed JSON; None until it has one)."""

    status: TaskStatus
    result: Any


@dataclass(frozen=True, slots=True)
class Heartbeat:
    role: str
    sender_id: str
    hostname: str
    pid: int
    sent_at: datetime


def get_task(conn: Conn, task_id: UUID, *, steps: bool = True) -> TaskInfo | None:
    """The task's row, its finished attempts and (``steps``) its recorded steps and, PENDING,
    its current sleep or wait: separate statements, so an outcome or a step recorded between
    them can show in a later list and not yet in the row. ``steps=False``: neither steps nor
    suspension read (``TaskInfo.steps`` empty, ``TaskInfo.suspension`` None)."""
    from tether.broker.rows import TaskInfo

    row = conn.execute(q("get_task"), {"id": task_id}).fetchone()
    if row is None:
        return None
    attempts = get_attempts(conn, task_id)
    if not steps:
        return TaskInfo.from_row(row, attempts)
    # Only a PENDING task can be suspended: the others skip the statement.
    suspension = (
        suspension_states(conn, [str(task_id)]).get(str(task_id)) if row["status"] == "PENDING" else None
    )
    return TaskInfo.from_row(row, attempts, list_steps(conn, task_id), suspension)


def get_status(conn: Conn, task_id: UUID) -> TaskState | None:
    row = conn.execute(q("get_status"), {"id": task_id}).fetchone()
    return None if row is None else TaskState(TaskStatus(row["status"]), row["result"])


def watch_task(conn: Conn, task_id: UUID) -> TaskState | None:
    """As get_status, and ask for a 'tether_done' notification when the task finishes."""
    row = conn.execute(q("watch_task"), {"id": task_id}).fetchone()
    return None if row is None else TaskState(TaskStatus(row["status"]), row["result"])


def get_attempts(conn: Conn, task_id: UUID) -> list[AttemptInfo]:
    """The task's finished attempts, first first."""
    from tether.broker.rows import AttemptInfo

    rows = conn.execute(q("get_attempts"), {"id": task_id}).fetchall()
    return [with_status(AttemptInfo, row, TaskStatus, "outcome") for row in rows]


def get_heartbeats(conn: Conn, task_id: UUID, limit: int) -> list[Heartbeat]:
    """The task's latest ``limit`` heartbeats (either role), newest first."""
    rows = conn.execute(q("get_heartbeats"), {"id": task_id, "limit": limit}).fetchall()
    return [Heartbeat(**row) for row in rows]


# -- cancelling -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cancelled:
    """What cancel_task did: ``status`` CANCELLED (it had not started) or RUNNING (the cancel
    is requested); ``workflow_id`` is set when the task is a workflow step."""

    id: UUID
    status: TaskStatus
    workflow_id: UUID | None
    claimed_by_worker_id: str | None
    cancel_requested_at: datetime
    cancel_requested_by: str | None


#: cancel_task's answer, as PostgresBroker.run_request records it.
CANCEL_ANSWER: Answer[Cancelled | None] = Answer(Cancelled | None)


def cancel_task(conn: Conn, task_id: UUID, by: str | None) -> Cancelled | None:
    """PENDING or CLAIMED -> CANCELLED; RUNNING: the cancel requested (its worker told). None if
    the task was in none of these states (ended, or no such task)."""
    row = conn.execute(q("cancel_task"), {"id": task_id, "by": by}).fetchone()
    if row is None:
        return None
    del row["told"]
    return with_status(Cancelled, row, TaskStatus)


# -- listings and counts ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Failure:
    """A FAILED task, for the dashboard (its error message cut to 300 characters)."""

    id: UUID
    name: str
    queue: str
    attempt: int
    retry_count: int
    error_code: str | None
    error_message: str | None
    failed_at: datetime | None
    claimed_by_worker_id: str | None


def recent_failures(conn: Conn, limit: int) -> list[Failure]:
    """The latest ``limit`` FAILED tasks, newest first."""
    return [Failure(**row) for row in conn.execute(q("recent_failures"), {"limit": limit}).fetchall()]


def count_status_of(conn: Conn, task_ids: Sequence[UUID]) -> dict[TaskStatus, int]:
    """How many of these tasks are in each status (statuses none is in are absent)."""
    rows = conn.execute(q("count_status_of"), {"ids": list(task_ids)}).fetchall()
    return {TaskStatus(row["status"]): row["n"] for row in rows}


# -- the demo's questions -----------------------------------------------------


def find_worker_by_pid(conn: Conn, *, pid: int, hostname: str) -> str | None:
    """The id of the latest active worker registered with this pid on this host."""
    row = conn.execute(q("find_worker_by_pid"), {"pid": pid, "hostname": hostname}).fetchone()
    return None if row is None else str(row["id"])


def database_now(conn: Conn) -> datetime:
    """The database's clock (its transaction's now())."""
    row = conn.execute(q("database_now")).fetchone()
    assert row is not None  # SELECT now() always has one row
    now: datetime = row["now"]
    return now
