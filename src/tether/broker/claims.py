"""Worker-side task transitions (claims.sql): claim, start, record an outcome, give back.

Every write after the claim is fenced (a `Fence`): it names the status it expects, the
attempt number the claim produced and the owner. A write from a worker that lost its
claim matches no row and changes nothing; the functions say so by returning False.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tether.broker.queries import q
from tether.broker.types import AsyncConn, Conn, Row
from tether.outcomes import Outcome
from tether.result import TaskStatus

# Read once, for the path every outcome takes: on Python 3.11 reading an enum member through
# its class costs ~0.2 us and parsing one from its text (TaskStatus(text)) ~0.8 us.
_COMPLETED = TaskStatus.COMPLETED
_STATUS_OF: dict[str, TaskStatus] = {status.value: status for status in TaskStatus}


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
    # Seconds from the moment it became due (run_at) to its claim, by the database's clock:
    # the queue wait metric (docs/monitoring.md). None when not read from a claim.
    waited_s: float | None = None
    # The W3C trace context it was sent with (tracing enabled), for the run's CONSUMER span.
    trace_context: str | None = None

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
            waited_s=row.get("waited_s"),
            trace_context=row.get("trace_context"),
        )


@dataclass(frozen=True, slots=True)
class Fence:
    """What a write must match: the row's status, the claim's attempt number and owner."""

    task_id: str
    attempt: int
    worker_id: str
    expect: TaskStatus


@dataclass(frozen=True, slots=True)
class Recorded:
    """What an outcome write did: its fenced write matched, the next task started, and the
    status the row settled in (None when nothing matched; PENDING: a retry)."""

    recorded: bool
    next_started: bool
    settled: TaskStatus | None = None


@dataclass(frozen=True, slots=True)
class FenceState:
    """Who holds a task now, and which process wrote its current attempt's outcome."""

    status: TaskStatus
    attempt: int
    owner: str | None
    recorded_by_pid: int | None  # None: no outcome yet, or a reaper wrote it

    @classmethod
    def from_row(cls, row: Row) -> FenceState:
        return cls(
            TaskStatus(row["status"]), row["attempt"], row["claimed_by_worker_id"], row["recorded_by_pid"]
        )


@dataclass(frozen=True, slots=True)
class Place:
    """Where a row sits in one queue's claim order: its priority band, then (run_at, id)."""

    queue: str
    priority: int
    run_at: datetime
    id: str


@dataclass(frozen=True, slots=True)
class Claimed:
    """What one claim took: the tasks, each one's place in the claim order, and the places a
    mark may move to (those of taken rows with no row of their band read but left before them)."""

    tasks: list[TaskPayload]
    places: list[Place]  # one per task, in the same order
    advances: list[Place]


async def claim_tasks(
    conn: AsyncConn,
    *,
    worker_id: str,
    queues: list[str],
    limit: int,
    skip_names: list[str],
    async_names: list[str] | None = None,
    async_limit: int = 0,
    after: Sequence[Place] = (),
) -> Claimed:
    """Claim due PENDING tasks of ``queues`` (best priority first): up to ``async_limit`` whose
    name is in ``async_names`` and up to ``limit`` others, from the first ``limit + async_limit``
    rows in queue order. ``after``: marks, at most one per queue and priority; that band of
    that queue is read from just after its mark only (claims.sql says why)."""
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
            "mark_queues": [m.queue for m in after],
            "mark_priorities": [m.priority for m in after],
            "mark_run_ats": [m.run_at for m in after],
            "mark_ids": [m.id for m in after],
        },
    )
    # In claim order: an UPDATE returns its rows in whatever order its plan met them, and the
    # worker hands tasks to its children in the order given (a batch sent in one order would
    # otherwise start in another).
    rows = sorted(await cur.fetchall(), key=lambda row: (-row["priority"], row["run_at"], row["id"]))
    places = [Place(row["queue"], row["priority"], row["run_at"], str(row["id"])) for row in rows]
    return Claimed(
        [TaskPayload.from_row(row) for row in rows],
        places,
        [place for place, row in zip(places, rows, strict=True) if row["advance"]],
    )


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

    A completion goes through complete_task (a sync child's hot path); any other outcome
    through write_batch, which applies the cancel rule: a failure of a task whose cancel
    was requested settles as CANCELLED. hostname/pid: the process that ran the code (None
    for a reaper).
    """
    if outcome.status is not _COMPLETED:
        written = _write_rows(
            conn,
            worker_id=fence.worker_id,
            hostname=hostname,
            pid=pid,
            rows=[(fence.task_id, fence.attempt, fence.expect, outcome)],
            starts=[start_next] if start_next is not None else [],
        )
        return Recorded(
            fence.task_id in written.settled,
            start_next is not None and start_next.id in written.started,
            written.settled.get(fence.task_id),
        )
    params: dict[str, Any] = {
        "next_id": start_next.id if start_next is not None else None,
        "next_attempt": start_next.attempt if start_next is not None else None,
        "id": fence.task_id,
        "attempt": fence.attempt,
        "worker_id": fence.worker_id,
        "expect": fence.expect,
        "result": outcome.result_json,
        "hostname": hostname,
        "pid": pid,
    }
    row = conn.execute(q("complete_task"), params).fetchone()
    recorded = bool(row and row["recorded"])
    return Recorded(recorded, bool(row and row["next_started"]), _COMPLETED if recorded else None)


@dataclass(frozen=True, slots=True)
class OutcomeWrite:
    """One outcome of a batch: the task, what happened, and the status its row must have."""

    task: TaskPayload
    outcome: Outcome
    expect: TaskStatus = TaskStatus.RUNNING


@dataclass(frozen=True, slots=True)
class BatchWritten:
    """What a batch write matched: the status each recorded task settled in (PENDING: a
    retry; CANCELLED: a cancellation, or a failure of a task whose cancel was requested),
    and the ids started."""

    settled: dict[str, TaskStatus]
    started: frozenset[str]

    @property
    def recorded(self) -> frozenset[str]:
        return frozenset(self.settled)


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
    rows = [(w.task.id, w.task.attempt, w.expect, w.outcome) for w in outcomes]
    return _write_rows(conn, worker_id=worker_id, hostname=hostname, pid=pid, rows=rows, starts=starts)


def _write_rows(
    conn: Conn,
    *,
    worker_id: str,
    hostname: str | None,
    pid: int | None,
    rows: Sequence[tuple[str, int, TaskStatus, Outcome]],
    starts: Sequence[TaskPayload],
) -> BatchWritten:
    """write_batch of (task id, attempt, expected status, outcome) rows."""
    params: dict[str, Any] = {
        "worker_id": worker_id,
        "hostname": hostname,
        "pid": pid,
        "ids": [r[0] for r in rows],
        "attempts": [r[1] for r in rows],
        "expects": [r[2] for r in rows],
        "statuses": [r[3].status for r in rows],
        "results": [r[3].result_json for r in rows],
        "error_codes": [r[3].error_code for r in rows],
        "delays": [r[3].retry_delay_s for r in rows],
        "start_ids": [t.id for t in starts],
        "start_attempts": [t.attempt for t in starts],
    }
    row = conn.execute(q("write_batch"), params).fetchone()
    if row is None:
        return BatchWritten({}, frozenset())
    settled = {
        task_id: _STATUS_OF[status] for task_id, status in zip(row["recorded"], row["settled"], strict=True)
    }
    return BatchWritten(settled, frozenset(row["started"]))


def read_fences(conn: Conn, task_ids: Sequence[str]) -> dict[str, FenceState]:
    """read_fence for many tasks; a task that no longer exists is absent."""
    rows = conn.execute(q("get_fences"), {"ids": list(task_ids)}).fetchall()
    return {row["id"]: FenceState.from_row(row) for row in rows}


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
    return None if row is None else FenceState.from_row(row)
