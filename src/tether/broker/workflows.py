"""Workflows (workflows.sql): starting one, advancing it, pausing, resuming, cancelling,
reconciling, pruning and reading it.

The locking rule of workflows.sql holds for every writer: lock the workflow
(``lock_workflow``) in the transaction before touching its steps. The callers own the
transactions; each function here runs one statement.

Rows come back as frozen dataclasses whose fields are the statement's columns, in the
statement's order (so ``dataclasses.asdict`` gives the row as it was), statuses as their
enums (WorkflowStatus, StepStatus). They are built with ``cls(**row)``: one call per row, the
cheapest way from psycopg's dict rows. A workflow read whole is a WorkflowInfo with its
StepInfo steps (broker/rows.py), public as ``tether.WorkflowInfo``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict

from tether import tracing
from tether.broker.queries import q
from tether.broker.types import AsyncConn, Conn, Row, with_status
from tether.result import StepStatus, WorkflowStatus

if TYPE_CHECKING:
    # The public row types (rows.py), imported by the reads that return them on first use:
    # a worker and a send never build them.
    from tether.broker.rows import StepInfo, WorkflowInfo, WorkflowSummary

WorkflowId = uuid.UUID | str

# -- starting ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NewWorkflow:
    id: uuid.UUID
    name: str
    on_error: str
    output_node: int | None
    steps_total: int


@dataclass(frozen=True, slots=True)
class StepFeed:
    """A parameter of a step fed by another step's result."""

    node: int
    task: str  # the feeding step's task id: enqueue_steps finds it by that key
    mode: str  # "value": its ok value; "result": the whole result, failures too


@dataclass(frozen=True, slots=True)
class NewStep:
    node: int
    node_name: str
    task_id: str
    task_name: str
    queue: str
    priority: int
    args: Any  # JSON: the encoded positional arguments
    kwargs: Any  # JSON: the encoded keyword arguments
    args_from: dict[str, StepFeed]
    max_retries: int
    retry_policy: dict[str, Any] | None
    depends_on: list[int]
    dependents: list[str]  # task ids
    join_mode: str
    run_anyway: bool
    unique_key: str | None = None  # taken when the step's task is enqueued (docs/tasks.md#unique-sends)
    unique_for_s: float | None = None  # its window, in seconds
    concurrency_key: str | None = None  # its task's (docs/limits.md)


@dataclass(frozen=True, slots=True)
class Enqueued:
    """What enqueue_steps did: steps enqueued, and the task ids of those refused.

    A refused step's unique key was held by another task: its task was written FAILED
    with UNIQUE_KEY_HELD, and the step is to be settled in the same transaction.
    """

    count: int
    refused: list[str]


def insert_workflow(conn: Conn, workflow: NewWorkflow) -> None:
    conn.execute(q("insert_workflow"), _workflow_params(workflow))


async def insert_workflow_async(conn: AsyncConn, workflow: NewWorkflow) -> None:
    """insert_workflow on an async connection (a start inside the caller's async transaction)."""
    await conn.execute(q("insert_workflow"), _workflow_params(workflow))


def _workflow_params(workflow: NewWorkflow) -> dict[str, Any]:
    return {
        "id": workflow.id,
        "name": workflow.name,
        "on_error": workflow.on_error,
        "output_node": workflow.output_node,
        "steps_total": workflow.steps_total,
        "trace_context": tracing.outgoing(),
    }


def insert_workflow_steps(conn: Conn, workflow_id: WorkflowId, steps: Sequence[NewStep]) -> None:
    """Every step in one statement, sent as one JSON array."""
    conn.execute(q("insert_workflow_steps"), _steps_params(workflow_id, steps))


async def insert_workflow_steps_async(
    conn: AsyncConn, workflow_id: WorkflowId, steps: Sequence[NewStep]
) -> None:
    await conn.execute(q("insert_workflow_steps"), _steps_params(workflow_id, steps))


def _steps_params(workflow_id: WorkflowId, steps: Sequence[NewStep]) -> dict[str, Any]:
    document = [
        {
            "node": s.node,
            "node_name": s.node_name,
            "task_id": s.task_id,
            "task_name": s.task_name,
            "queue": s.queue,
            "priority": s.priority,
            "args": s.args,
            "kwargs": s.kwargs,
            "args_from": {
                param: {"node": f.node, "as": f.mode, "task": f.task} for param, f in s.args_from.items()
            },
            "max_retries": s.max_retries,
            "retry_policy": s.retry_policy,
            "depends_on": s.depends_on,
            "dependents": s.dependents,
            "join_mode": s.join_mode,
            "run_anyway": s.run_anyway,
            "unique_key": s.unique_key,
            "unique_for": None if s.unique_for_s is None else f"{s.unique_for_s} seconds",
            "concurrency_key": s.concurrency_key,
        }
        for s in steps
    ]
    return {"workflow_id": workflow_id, "steps": json.dumps(document, separators=(",", ":"))}


# -- advancing ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LockedWorkflow:
    id: uuid.UUID
    name: str
    status: WorkflowStatus
    on_error: str


@dataclass(frozen=True, slots=True)
class ChangedStep:
    """A step a statement moved (settled, or a dependent counted down): its new status."""

    task_id: uuid.UUID
    node: int
    status: StepStatus
    dependents: list[uuid.UUID]  # task ids


@dataclass(frozen=True, slots=True)
class WaitingStep:
    """A WAITING dependent's counters, before the ends that are being counted."""

    task_id: uuid.UUID
    node: int
    waiting_on: int
    deps_ok: int
    deps_failed: int
    join_mode: str
    run_anyway: bool


class DependentUpdate(TypedDict):
    """A WAITING dependent's new counters and status (SKIPPED also stores why).

    A TypedDict, not a dataclass: ``update_dependents`` sends the updates as one JSON
    document, and a dict goes into it as it is, with no copy per dependent (an advance
    of a step with 1,000 dependents builds 1,000 of these).
    """

    waiting_on: int
    deps_ok: int
    deps_failed: int
    status: StepStatus


def lock_workflow(conn: Conn, workflow_id: WorkflowId) -> LockedWorkflow | None:
    """In the caller's transaction: lock the workflow's row (None: there is no such workflow)."""
    row = conn.execute(q("lock_workflow"), {"id": workflow_id}).fetchone()
    return None if row is None else with_status(LockedWorkflow, row, WorkflowStatus)


def plan_as_lookups(conn: Conn) -> None:
    """For the rest of the caller's transaction: joins as primary-key probes (see workflows.sql)."""
    conn.execute(q("plan_as_lookups"))


def settle_steps(conn: Conn, workflow_id: WorkflowId, task_ids: list[str]) -> list[ChangedStep]:
    """ENQUEUED steps (of ``task_ids``) whose task has ended take its outcome; the ones settled."""
    rows = conn.execute(q("settle_steps"), {"workflow_id": workflow_id, "task_ids": task_ids}).fetchall()
    return [with_status(ChangedStep, r, StepStatus) for r in rows]


def waiting_dependents(conn: Conn, workflow_id: WorkflowId, task_ids: list[str]) -> list[WaitingStep]:
    """The steps of ``task_ids`` that still wait, with their counters."""
    rows = conn.execute(
        q("waiting_dependents"), {"workflow_id": workflow_id, "task_ids": task_ids}
    ).fetchall()
    return [WaitingStep(**r) for r in rows]


def update_dependents(
    conn: Conn, workflow_id: WorkflowId, updates: dict[str, DependentUpdate]
) -> list[ChangedStep]:
    """Write each still-WAITING step's update (by task id); the steps written."""
    rows = conn.execute(
        q("update_dependents"),
        {"workflow_id": workflow_id, "task_ids": list(updates), "changes": json.dumps(updates)},
    ).fetchall()
    return [with_status(ChangedStep, r, StepStatus) for r in rows]


def account_steps(conn: Conn, workflow_id: WorkflowId, *, done: int, failed: int) -> WorkflowStatus | None:
    """Count ``done`` more finished steps (``failed`` of them failed) and move the workflow on
    (PAUSED, COMPLETED, FAILED; notifying waiters when it ends); its status afterwards."""
    row = conn.execute(
        q("account_steps"), {"workflow_id": workflow_id, "done": done, "failed": failed}
    ).fetchone()
    return WorkflowStatus(row["status"]) if row else None


def enqueue_steps(conn: Conn, workflow_id: WorkflowId, task_ids: list[str]) -> Enqueued:
    """Turn these READY steps into tasks (their fed arguments filled in), taking their keys."""
    row = conn.execute(q("enqueue_steps"), {"workflow_id": workflow_id, "task_ids": task_ids}).fetchone()
    return _enqueued(row)


async def enqueue_steps_async(conn: AsyncConn, workflow_id: WorkflowId, task_ids: list[str]) -> Enqueued:
    cursor = await conn.execute(q("enqueue_steps"), {"workflow_id": workflow_id, "task_ids": task_ids})
    return _enqueued(await cursor.fetchone())


def _enqueued(row: Row | None) -> Enqueued:
    if row is None:
        return Enqueued(0, [])
    return Enqueued(int(row["enqueued"]), [str(t) for t in row["refused"] or ()])


def ready_steps(conn: Conn, workflow_id: WorkflowId) -> list[str]:
    """The task ids of every READY step of the workflow (reads the whole workflow)."""
    return [str(r["task_id"]) for r in conn.execute(q("ready_steps"), {"workflow_id": workflow_id})]


async def ready_steps_async(conn: AsyncConn, workflow_id: WorkflowId) -> list[str]:
    cursor = await conn.execute(q("ready_steps"), {"workflow_id": workflow_id})
    return [str(r["task_id"]) for r in await cursor.fetchall()]


# -- pausing, resuming, cancelling -------------------------------------------------------------


def pause_workflow(conn: Conn, workflow_id: WorkflowId) -> bool:
    """RUNNING -> PAUSED; False if it was not RUNNING."""
    return bool(conn.execute(q("pause_workflow"), {"id": workflow_id}).fetchall())


def resume_workflow(conn: Conn, workflow_id: WorkflowId) -> bool:
    """PAUSED -> RUNNING; False if it was not PAUSED."""
    return bool(conn.execute(q("resume_workflow"), {"id": workflow_id}).fetchall())


def cancel_workflow(conn: Conn, workflow_id: WorkflowId) -> bool:
    """RUNNING or PAUSED -> CANCELLED (notifying waiters); False if it had ended."""
    return bool(conn.execute(q("cancel_workflow"), {"id": workflow_id}).fetchall())


def cancel_unstarted_steps(conn: Conn, workflow_id: WorkflowId) -> int:
    """Steps with no task yet end CANCELLED; how many."""
    return len(conn.execute(q("cancel_unstarted_steps"), {"id": workflow_id}).fetchall())


def cancel_step_tasks(conn: Conn, workflow_id: WorkflowId) -> list[str]:
    """Cancel the not-started tasks of ENQUEUED steps; their task ids (the steps settle later)."""
    return [str(r["id"]) for r in conn.execute(q("cancel_step_tasks"), {"id": workflow_id}).fetchall()]


# -- reconciling and pruning -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StuckStep:
    workflow_id: uuid.UUID
    task_id: uuid.UUID


def workflow_of_task(conn: Conn, task_id: uuid.UUID | str) -> uuid.UUID | None:
    """The workflow a task is a step of (None: not a step, or no such task)."""
    row = conn.execute(q("workflow_of_task"), {"id": task_id}).fetchone()
    return row["workflow_id"] if row else None


def stuck_steps(conn: Conn, limit: int) -> list[StuckStep]:
    """Steps still ENQUEUED although their task has ended, by workflow."""
    return [StuckStep(**r) for r in conn.execute(q("stuck_steps"), {"limit": limit}).fetchall()]


def cancelled_leftovers(conn: Conn, limit: int) -> list[uuid.UUID]:
    """CANCELLED workflows with a step task waiting to run again."""
    return [r["workflow_id"] for r in conn.execute(q("cancelled_leftovers"), {"limit": limit}).fetchall()]


def unfinished_workflows(conn: Conn, limit: int) -> list[uuid.UUID]:
    """Open workflows whose steps have all finished, oldest first."""
    return [r["id"] for r in conn.execute(q("unfinished_workflows"), {"limit": limit}).fetchall()]


def prune_workflows(conn: Conn, age: timedelta, limit: int) -> int:
    """Delete up to ``limit`` workflows finished longer than ``age`` ago, their steps and the
    steps' tasks; how many workflows."""
    return conn.execute(q("prune_workflows"), {"age": age, "limit": limit}).rowcount


# -- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkflowState:
    """A workflow's status, and what its result is made of (``output_node``: the step whose
    result it is; None: every final step's)."""

    id: uuid.UUID
    name: str
    status: WorkflowStatus
    output_node: int | None

    @classmethod
    def from_row(cls, row: Row) -> WorkflowState:
        return cls(row["id"], row["name"], WorkflowStatus(row["status"]), row["output_node"])


@dataclass(frozen=True, slots=True)
class StepResult:
    node_name: str
    result: Any


@dataclass(frozen=True, slots=True)
class FailedStep:
    node_name: str
    error_code: str | None
    result: Any


def watch_workflow(conn: Conn, workflow_id: WorkflowId) -> WorkflowState | None:
    """Ask for a notification when the workflow ends; its state now (None: no such workflow)."""
    row = conn.execute(q("watch_workflow"), {"id": workflow_id}).fetchone()
    return WorkflowState.from_row(row) if row else None


def workflow_state(conn: Conn, workflow_id: WorkflowId) -> WorkflowState | None:
    """The workflow's state (None: no such workflow)."""
    found = workflow_statuses(conn, [workflow_id])
    return found[0] if found else None


def get_workflow(conn: Conn, workflow_id: WorkflowId) -> WorkflowInfo | None:
    """The workflow and every step, by node (two statements, as the handle's info() reads it)."""
    from tether.broker.rows import WorkflowInfo

    row = conn.execute(q("get_workflow"), {"id": workflow_id}).fetchone()
    if row is None:
        return None
    return WorkflowInfo.from_rows(row, _step_rows(conn, workflow_id))


def get_workflow_steps(conn: Conn, workflow_id: WorkflowId) -> list[StepInfo]:
    """Every step, by node."""
    from tether.broker.rows import StepInfo

    rows = _step_rows(conn, workflow_id)
    names = {r["node"]: r["node_name"] for r in rows}
    return [StepInfo.from_row(r, names) for r in rows]


def _step_rows(conn: Conn, workflow_id: WorkflowId) -> list[Row]:
    return conn.execute(q("get_workflow_steps"), {"id": workflow_id}).fetchall()


def workflow_output(conn: Conn, workflow_id: WorkflowId, output_node: int | None) -> list[StepResult]:
    """The output step's result, or (``output_node`` None) every final step's, by node."""
    rows = conn.execute(q("workflow_output"), {"id": workflow_id, "output_node": output_node}).fetchall()
    return [StepResult(**r) for r in rows]


def workflow_failures(conn: Conn, workflow_id: WorkflowId) -> list[FailedStep]:
    """The first 50 steps that ended FAILED or CANCELLED, in the order they ended."""
    return [FailedStep(**r) for r in conn.execute(q("workflow_failures"), {"id": workflow_id}).fetchall()]


def list_workflows(
    conn: Conn, *, status: WorkflowStatus | None, name: str | None, limit: int
) -> list[WorkflowSummary]:
    """The newest workflows, filtered by exact status and name when given."""
    from tether.broker.rows import WorkflowSummary

    rows = conn.execute(q("list_workflows"), {"status": status, "name": name, "limit": limit}).fetchall()
    return [with_status(WorkflowSummary, r, WorkflowStatus) for r in rows]


def workflow_statuses(conn: Conn, ids: Sequence[WorkflowId]) -> list[WorkflowState]:
    """The state of each of these workflows that exists, by id."""
    rows = conn.execute(q("workflow_statuses"), {"ids": [str(i) for i in ids]}).fetchall()
    return [WorkflowState.from_row(r) for r in rows]
