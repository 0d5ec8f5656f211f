"""Worker-side task transitions (claims.sql): claim, start, record an outcome, give back.

Every write after the claim is fenced (a `Fence`): it names the status it expects, the
attempt number the claim produced and the owner. A write from a worker that lost its
claim matches no row and changes nothing; the functions say so by returning False.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tether.broker.queries import q
from tether.broker.types import AsyncConn, Conn, Row
from tether.outcomes import Outcome


@dataclass(frozen=True, slots=True)
class TaskPayload:
    """A claimed task as a child needs it to run (arguments stay JSON text)."""

    id: str
    name: str
    queue: str
    args: str
    kwargs: str
    attempt: int
    retry_count: int
    max_retries: int
    retry_policy: str | None
    workflow_id: str | None = None  # set when the task is a workflow step

    @classmethod
    def from_row(cls, row: Row) -> TaskPayload:
        return cls(
            id=str(row["id"]),
            name=row["name"],
            queue=row["queue"],
            args=row["args"],
            kwargs=row["kwargs"],
            attempt=row["attempt"],
            retry_count=row["retry_count"],
            max_retries=row["max_retries"],
            retry_policy=row["retry_policy"],
            workflow_id=str(row["workflow_id"]) if row.get("workflow_id") else None,
        )


@dataclass(frozen=True, slots=True)
class Fence:
    """What a write must match: the row's status, the claim's attempt number and owner."""

    task_id: str
    attempt: int
    worker_id: str
    expect: str


@dataclass(frozen=True, slots=True)
class Recorded:
    """What an outcome write did: its fenced write matched, and the next task started."""

    recorded: bool
    next_started: bool


@dataclass(frozen=True, slots=True)
class FenceState:
    """Who holds a task now, and which process wrote its current attempt's outcome."""

    status: str
    attempt: int
    owner: str | None
    recorded_by_pid: int | None  # None: no outcome yet, or a reaper wrote it


async def claim_tasks(
    conn: AsyncConn,
    *,
    worker_id: str,
    queues: list[str],
    limit: int,
    skip_names: list[str],
    async_names: list[str] | None = None,
    async_limit: int = 0,
) -> list[TaskPayload]:
    """Claim due PENDING tasks of ``queues`` (best priority first): up to ``async_limit`` whose
    name is in ``async_names`` and up to ``limit`` others, from the first ``limit + async_limit``
    rows in queue order."""
    cur = await conn.execute(
        q("claim_tasks"),
        {
            "queues": queues,
            "limit": limit + async_limit,
            "other_limit": limit,
            "async_limit": async_limit,
            "async_names": async_names or [],
            "worker_id": worker_id,
            "skip_names": skip_names,
        },
    )
    return [TaskPayload.from_row(row) for row in await cur.fetchall()]


def start_task(conn: Conn, task: TaskPayload, worker_id: str) -> bool:
    """CLAIMED -> RUNNING; False if the claim was lost (then the code must not run)."""
    params = {"id": task.id, "attempt": task.attempt, "worker_id": worker_id}
    return bool(conn.execute(q("start_task"), params).fetchall())


def record_outcome(
    conn: Conn,
    fence: Fence,
    outcome: Outcome,
    *,
    hostname: str | None,
    pid: int | None,
    start_next: TaskPayload | None = None,
) -> Recorded:
    """Record ``outcome`` under ``fence``, its attempt row, and start ``start_next``: one statement.

    A failure that will be retried goes back to PENDING after its delay; any other
    outcome is final. hostname/pid: the process that ran the code (None for a reaper).
    """
    params: dict[str, Any] = {
        "next_id": start_next.id if start_next is not None else None,
        "next_attempt": start_next.attempt if start_next is not None else None,
        "id": fence.task_id,
        "attempt": fence.attempt,
        "worker_id": fence.worker_id,
        "expect": fence.expect,
        "result": outcome.result_json,
        "error_code": outcome.error_code,
        "error_message": outcome.error_message,
        "hostname": hostname,
        "pid": pid,
    }
    if outcome.will_retry:
        params["delay"] = timedelta(seconds=outcome.retry_delay_s or 0.0)
        statement = q("retry_task")
    else:
        params["status"] = outcome.status
        statement = q("finish_task")
    row = conn.execute(statement, params).fetchone()
    return Recorded(bool(row and row["recorded"]), bool(row and row["next_started"]))


@dataclass(frozen=True, slots=True)
class OutcomeWrite:
    """One outcome of a batch: the task, what happened, and the status its row must have."""

    task: TaskPayload
    outcome: Outcome
    expect: str = "RUNNING"


@dataclass(frozen=True, slots=True)
class BatchWritten:
    """What a batch write matched: the ids whose outcome was recorded, and those started."""

    recorded: frozenset[str]
    started: frozenset[str]


def write_batch(
    conn: Conn,
    *,
    worker_id: str,
    hostname: str | None,
    pid: int | None,
    outcomes: Sequence[OutcomeWrite],
    starts: Sequence[TaskPayload],
) -> BatchWritten:
    """Record many outcomes and start many tasks in one statement, each row under its own fence.

    A row whose fence does not match (its claim was lost) is left alone; the others are
    written all the same. A task must appear at most once in ``outcomes``.
    """
    params: dict[str, Any] = {
        "worker_id": worker_id,
        "hostname": hostname,
        "pid": pid,
        "ids": [w.task.id for w in outcomes],
        "attempts": [w.task.attempt for w in outcomes],
        "expects": [w.expect for w in outcomes],
        "statuses": [w.outcome.status for w in outcomes],
        "results": [w.outcome.result_json for w in outcomes],
        "error_codes": [w.outcome.error_code for w in outcomes],
        "error_messages": [w.outcome.error_message for w in outcomes],
        "delays": [w.outcome.retry_delay_s for w in outcomes],
        "start_ids": [t.id for t in starts],
        "start_attempts": [t.attempt for t in starts],
    }
    row = conn.execute(q("write_batch"), params).fetchone()
    if row is None:
        return BatchWritten(frozenset(), frozenset())
    return BatchWritten(frozenset(row["recorded"]), frozenset(row["started"]))


def read_fences(conn: Conn, task_ids: Sequence[str]) -> dict[str, FenceState]:
    """read_fence for many tasks; a task that no longer exists is absent."""
    rows = conn.execute(q("get_fences"), {"ids": list(task_ids)}).fetchall()
    return {
        row["id"]: FenceState(
            row["status"], row["attempt"], row["claimed_by_worker_id"], row["recorded_by_pid"]
        )
        for row in rows
    }


def release_claimed(conn: Conn, tasks: list[TaskPayload], worker_id: str) -> set[str]:
    """CLAIMED -> PENDING for tasks whose code never started here; the ids released."""
    params = {"ids": [t.id for t in tasks], "attempts": [t.attempt for t in tasks], "worker_id": worker_id}
    row = conn.execute(q("release_claimed"), params).fetchone()
    return set(row["released_ids"]) if row else set()


def unstart_task(conn: Conn, task: TaskPayload, worker_id: str) -> bool:
    """RUNNING -> PENDING for a task started in the same commit as an outcome, none of its code run."""
    params = {"id": task.id, "attempt": task.attempt, "worker_id": worker_id}
    return bool(conn.execute(q("unstart_task"), params).fetchall())


def read_fence(conn: Conn, task_id: str) -> FenceState | None:
    """After an ambiguous write (connection lost around COMMIT): the row's holder now."""
    row = conn.execute(q("get_fence"), {"id": task_id}).fetchone()
    if row is None:
        return None
    return FenceState(row["status"], row["attempt"], row["claimed_by_worker_id"], row["recorded_by_pid"])
