"""Checkpointed steps of a running task (steps.sql): load them once per attempt, write each one
fenced; and list what a task recorded (``tether task ID``, the dashboard, ``handle.info()``).

A step write names the attempt and the owner like an outcome write (claims.Fence): an
attempt that lost its task (recovered elsewhere while it was frozen) matches no row and
adds nothing, and the function says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from uuid import UUID

from tether.broker.queries import q
from tether.broker.types import Conn

if TYPE_CHECKING:
    # The public row types (rows.py), imported by the reads that return them on first use:
    # a worker and a send never build them.
    from tether.broker.rows import TaskStepInfo

#: A stored step: (name, occurrence) -> its result as JSON text.
StepKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class StepWritten:
    """What a step write did: held (the attempt still holds its task) and the stored JSON text
    (None when nothing was written: lost, or the row was already ours)."""

    held: bool
    stored: str | None


def load_steps(conn: Conn, task_id: str) -> dict[StepKey, str]:
    """Every step of the task stored so far: (name, occurrence) -> result JSON text."""
    rows = conn.execute(q("load_steps"), {"id": task_id}).fetchall()
    return {(row["name"], row["occurrence"]): row["result"] for row in rows}


def write_step(
    conn: Conn, *, task_id: str, attempt: int, worker_id: str, name: str, occurrence: int, result: str
) -> StepWritten:
    """Store one completed step, fenced by the attempt and the owner; one statement."""
    params = {
        "id": task_id,
        "attempt": attempt,
        "worker_id": worker_id,
        "name": name,
        "occurrence": occurrence,
        "result": result,
    }
    row = conn.execute(q("write_step"), params).fetchone()
    assert row is not None  # the statement always returns one row
    return StepWritten(bool(row["held"]), row["stored"])


@dataclass(frozen=True, slots=True)
class StepToWrite:
    """One completed step of a task, for write_steps."""

    task_id: str
    attempt: int
    name: str
    occurrence: int
    result: str  # JSON text


def write_steps(
    conn: Conn, *, worker_id: str, steps: list[StepToWrite]
) -> dict[tuple[str, str, int], str | None]:
    """Store many steps (of tasks held by ``worker_id``) in one statement, each fenced by its
    attempt. Returns, for each (task_id, name, occurrence) whose attempt still holds its task,
    the stored JSON text (None: the row was already there, our own earlier commit); the steps
    of attempts that lost their task are absent."""
    params = {
        "worker_id": worker_id,
        "ids": [s.task_id for s in steps],
        "attempts": [s.attempt for s in steps],
        "names": [s.name for s in steps],
        "occurrences": [s.occurrence for s in steps],
        "results": [s.result for s in steps],
    }
    rows = conn.execute(q("write_steps"), params).fetchall()
    return {(r["task_id"], r["name"], r["occurrence"]): r["stored"] for r in rows}


def list_steps(conn: Conn, task_id: UUID | str) -> list[TaskStepInfo]:
    """The steps the task recorded, in the order recorded: name, occurrence, the attempt that
    ran it, when, and its result's size in bytes (measured by the database: results are not
    read). Empty for a task with no steps, or no such task."""
    rows = conn.execute(q("list_steps"), {"id": task_id}).fetchall()
    from tether.broker.rows import TaskStepInfo

    return [TaskStepInfo(**row) for row in rows]
