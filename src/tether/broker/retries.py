"""Retrying ended tasks by hand (retries.sql): finding them by filter, putting them back to
PENDING, and reopening a retried workflow step's part of its workflow.

The rules (what is retried, what is refused and why) live in tether.retrying and
tether.workflow.reopen; each function here runs one statement in the caller's transaction.
Rows come back as frozen dataclasses whose fields are the statement's columns, in its order,
statuses as their enums.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypedDict

from tether.broker.queries import q
from tether.broker.rows import RetrySample, with_status
from tether.broker.types import Conn
from tether.result import StepStatus, TaskStatus, WorkflowStatus

#: The statuses a task can be retried from.
RETRYABLE = (TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.EXPIRED)


@dataclass(frozen=True, slots=True)
class TaskToRetry:
    """What a retry by id reads first: the task's status, its workflow and its unique key."""

    id: uuid.UUID
    name: str
    status: TaskStatus
    workflow_id: uuid.UUID | None
    unique_key: str | None


@dataclass(frozen=True, slots=True)
class Criteria:
    """A bulk retry's filter, resolved: absolute times (database time), statuses in upper case."""

    statuses: tuple[TaskStatus, ...]
    queue: str | None
    name: str | None
    error_code: str | None
    since: datetime | None
    until: datetime | None

    def params(self) -> dict[str, Any]:
        return {
            "statuses": list(self.statuses),
            "queue": self.queue,
            "name": self.name,
            "error_code": self.error_code,
            "since": self.since,
            "until": self.until,
        }


@dataclass(frozen=True, slots=True)
class Retried:
    """One task that retry_tasks found in a retryable status: retried, or the key's holder."""

    id: uuid.UUID
    retried: bool
    holder: uuid.UUID | None  # not retried: this task holds its unique key
    queues_woken: int


def task_to_retry(conn: Conn, task_id: uuid.UUID) -> TaskToRetry | None:
    row = conn.execute(q("retry_task_state"), {"id": task_id}).fetchone()
    return None if row is None else with_status(TaskToRetry, row, TaskStatus)


def lock_task(conn: Conn, task_id: uuid.UUID) -> TaskToRetry | None:
    """In the caller's transaction, after the task's workflow: lock the task's row."""
    row = conn.execute(q("lock_task_for_retry"), {"id": task_id}).fetchone()
    return None if row is None else with_status(TaskToRetry, row, TaskStatus)


def find_candidates(
    conn: Conn, criteria: Criteria, *, after: uuid.UUID | None, limit: int
) -> list[RetrySample]:
    """Up to ``limit`` tasks matching ``criteria`` with an id after ``after``, in id order."""
    params = {**criteria.params(), "after": after, "limit": limit}
    rows = conn.execute(q("find_retry_candidates"), params).fetchall()
    return [with_status(RetrySample, row, TaskStatus) for row in rows]


def count_candidates(conn: Conn, criteria: Criteria) -> int:
    row = conn.execute(q("count_retry_candidates"), criteria.params()).fetchone()
    assert row is not None  # count(*) always has a row
    return int(row["n"])


def retry_tasks(
    conn: Conn,
    task_ids: Sequence[uuid.UUID],
    *,
    statuses: Sequence[TaskStatus] = RETRYABLE,
    workflow_id: uuid.UUID | None = None,
    from_scratch: bool = False,
) -> list[Retried]:
    """Put the tasks of ``task_ids`` still in one of ``statuses`` back to PENDING (retries.sql).

    Plain tasks when ``workflow_id`` is None; else steps of that workflow, whose row the
    caller has locked in this transaction. The retried tasks keep their recorded steps
    (their next attempt resumes after them), unless ``from_scratch``: then the same
    statement deletes them. Returns one row per task found in one of ``statuses`` (in no
    particular order); tasks in another status are not in the answer.
    """
    params = {
        "ids": list(task_ids),
        "statuses": list(statuses),
        "workflow_id": workflow_id,
        "from_scratch": from_scratch,
    }
    return [Retried(**row) for row in conn.execute(q("retry_tasks"), params).fetchall()]


# -- workflow steps ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepToReopen:
    """A workflow step as reopening reads it: where it stands and its counters."""

    task_id: uuid.UUID
    node: int
    node_name: str
    status: StepStatus
    depends_on: list[int]  # nodes
    dependents: list[uuid.UUID]  # task ids
    join_mode: str
    run_anyway: bool
    waiting_on: int
    deps_ok: int
    deps_failed: int
    enqueued_at: datetime | None  # set once the step has a task
    finished_at: datetime | None


class StepChange(TypedDict):
    """A step's new status and counters (``was``: the status it is planned from; ``reopen``:
    its result, error code and end time are cleared)."""

    was: StepStatus
    status: StepStatus
    waiting_on: int
    deps_ok: int
    deps_failed: int
    reopen: bool


def steps(conn: Conn, workflow_id: uuid.UUID, task_ids: Sequence[uuid.UUID | str]) -> list[StepToReopen]:
    """Steps of the workflow by task id (unknown ids are left out)."""
    rows = conn.execute(
        q("step_for_retry"), {"workflow_id": workflow_id, "task_ids": [str(t) for t in task_ids]}
    ).fetchall()
    return [with_status(StepToReopen, row, StepStatus) for row in rows]


def step_statuses(conn: Conn, workflow_id: uuid.UUID, nodes: Sequence[int]) -> dict[int, StepStatus]:
    """The status of each of these steps (by node)."""
    rows = conn.execute(q("step_statuses"), {"workflow_id": workflow_id, "nodes": list(nodes)}).fetchall()
    return {int(row["node"]): StepStatus(row["status"]) for row in rows}


def reopen_steps(conn: Conn, workflow_id: uuid.UUID, changes: dict[str, StepChange]) -> int:
    """Write each step's change (each guarded by the status it was planned from); how many were written."""
    rows = conn.execute(
        q("reopen_steps"),
        {"workflow_id": workflow_id, "task_ids": list(changes), "changes": json.dumps(changes)},
    ).fetchall()
    return len(rows)


def reopen_workflow(conn: Conn, workflow_id: uuid.UUID, *, done: int, failed: int) -> WorkflowStatus | None:
    """Count ``done`` steps as unfinished again (``failed`` of them had failed); the workflow's
    status afterwards (a FAILED one is RUNNING again)."""
    row = conn.execute(
        q("reopen_workflow"), {"workflow_id": workflow_id, "done": done, "failed": failed}
    ).fetchone()
    return None if row is None else WorkflowStatus(row["status"])
