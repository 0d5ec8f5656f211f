"""The rows the broker reads that users read too, one type per shape, public under their
tether names; and the list rows that share their columns (TaskSummary, WorkflowSummary).

``tether.TaskInfo``, ``tether.AttemptInfo``, ``tether.TaskStepInfo`` (a checkpointed step of a
task), ``tether.TaskSuspension`` (its current durable sleep or wait), ``tether.QueueInfo``,
``tether.WorkflowInfo``, ``tether.StepInfo`` (a workflow's step) and the bulk retry's
``RetrySample`` are defined here, where the broker can build them without importing the
handles (which import the broker), and re-exported from the modules users import them from
(``tether.handle``, ``tether.queue_control``, ``tether.workflow.handle``,
``tether.retrying``). The broker's statements return them directly: no second class copies
their fields.

A row becomes its type once, at the broker's boundary: a status column becomes its enum of
tether.result (TaskStatus, WorkflowStatus, StepStatus: StrEnums, so they compare equal to
their text and are written to JSON and to the database as it; ``with_status`` for the
broker's other rows), and a stored result becomes a TaskResult.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Literal, TypeVar

from tether.broker.types import Row
from tether.broker.types import with_status as with_status  # where it was defined before
from tether.codec import decode_result
from tether.result import ErrorCode, StepStatus, TaskError, TaskResult, TaskStatus, WorkflowStatus

R = TypeVar("R")


# -- tasks --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptInfo:
    """One finished attempt of a task (tether_task_attempts)."""

    attempt: int
    worker_id: str | None
    hostname: str | None
    pid: int | None
    started_at: datetime | None
    finished_at: datetime
    outcome: TaskStatus  # COMPLETED, FAILED or CANCELLED; PENDING: it slept or waited (suspended)
    will_retry: bool
    error_code: str | None
    error_message: str | None
    # A durable sleep or wait for an event ended the attempt (docs/durable-steps.md): the task
    # was due again at resume_at (a wait: its timeout), event_key the event it waited for.
    suspended: bool = False
    resume_at: datetime | None = None
    event_key: str | None = None


@dataclass(frozen=True, slots=True)
class TaskStepInfo:
    """One checkpointed step a task recorded (tether_task_steps, docs/durable-steps.md): its
    name, which call of that name it was (``occurrence``, 0 for the first), the attempt that
    ran it and when its record was written, and ``size``, the bytes of its result's JSON as
    stored (the result itself is not read: it can be up to 1 MiB)."""

    name: str
    occurrence: int
    attempt: int
    written_at: datetime
    size: int


@dataclass(frozen=True, slots=True)
class TaskSuspension:
    """What a PENDING task after a durable sleep or a wait for an event waits for
    (docs/durable-steps.md): ``TaskInfo.suspension``, tether task ID, tether tasks and the
    dashboard's task page. Read by broker/suspensions.py's ``suspension_states``.

    ``kind`` is "sleep" or "event"; ``run_at`` when the task is due (a sleep's end, a wait's
    timeout, or now once its event came); ``until`` a wait's timeout (None: no timeout);
    ``waiting`` False once the event came and the task is due to resume; ``after_step`` the
    last step of its own the task completed (None: none yet).
    """

    task_id: str
    run_at: datetime  # when it is due
    event_key: str | None  # None: a sleep
    waiting: bool  # a wait still open (False: its event came, it is due)
    until: datetime | None  # the wait's timeout (None: none, or a sleep: see run_at)
    after_step: str | None  # the last step of its own it completed (None: none yet)

    @property
    def kind(self) -> Literal["sleep", "event"]:
        return "sleep" if self.event_key is None else "event"

    def describe(self) -> str:
        """The line tether task ID and the dashboard show after "Suspended: "."""
        after = f"after step {self.after_step!r}" if self.after_step else "before any step"
        if self.event_key is None:
            return f"sleeping until {_when(self.run_at)} ({after})"
        if not self.waiting:
            return f"event {self.event_key!r} delivered: resuming ({after})"
        timeout = "no timeout" if self.until is None else f"timeout at {_when(self.until)}"
        return f"waiting for event {self.event_key!r} ({timeout}; {after})"

    def as_json(self) -> dict[str, object]:
        """For tether task ID --json and /api/tasks/<id>: the fields, the kind and the line
        describe() gives."""
        return {
            "kind": self.kind,
            "run_at": self.run_at,
            "event_key": self.event_key,
            "waiting": self.waiting,
            "until": self.until,
            "after_step": self.after_step,
            "state": self.describe(),
        }

    def short(self) -> str:
        """For a list's status column (tether tasks)."""
        if self.event_key is None:
            return f"sleeping until {self.run_at:%H:%M:%S}"
        return f"waiting for {self.event_key!r}" if self.waiting else "event delivered"


def _when(at: datetime) -> str:
    return at.isoformat(sep=" ", timespec="seconds")


@dataclass(frozen=True, slots=True)
class TaskCore:
    """The columns every task row starts with: the task, where it stands, who holds it."""

    id: uuid.UUID
    name: str
    queue: str
    priority: int
    status: TaskStatus
    attempt: int
    retry_count: int
    max_retries: int
    error_code: str | None
    claimed_by_worker_id: str | None


@dataclass(frozen=True, slots=True)
class TaskSummary(TaskCore):
    """A task in a list: a row of `tether tasks` and of the dashboard's task pages."""

    sent_at: datetime
    started_at: datetime | None
    finished_at: datetime | None  # when it reached its end state
    workflow_id: uuid.UUID | None  # set when the task is a workflow step
    cancel_requested_at: datetime | None


@dataclass(frozen=True, slots=True)
class TaskInfo(TaskCore):
    """One task's row, with its attempts and its recorded steps. All timestamps are database time.

    ``result`` is the outcome as a TaskResult, None while the task is not terminal. The
    fields after ``cancel_requested_by`` are the row as stored, for the CLI, the dashboard
    and Django: the arguments as their JSON (codec tags kept), the retry policy, when the
    task is due, and ``stored_result``, the result column as stored (a task waiting for a
    retry keeps its last failure there).
    """

    good_until: datetime | None
    unique_key: str | None  # the key it was sent with (docs/tasks.md#unique-sends), or None
    sent_at: datetime
    enqueued_at: datetime
    claimed_at: datetime | None
    started_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    cancelled_at: datetime | None
    expired_at: datetime | None
    next_retry_at: datetime | None
    updated_at: datetime
    progress: dict[str, Any] | None
    progress_at: datetime | None
    result: TaskResult[Any, TaskError] | None
    attempts: tuple[AttemptInfo, ...]
    schedule_name: str | None = None  # sent by this schedule (app.periodic) ...
    schedule_slot: datetime | None = None  # ... for this slot (UTC); None for other tasks
    cancel_requested_at: datetime | None = None  # when a cancel was first asked for (or None) ...
    cancel_requested_by: str | None = None  # ... and by whom, when known
    run_at: datetime | None = None  # when it is (or was) due
    args: Any = None  # the positional arguments as stored (JSON)
    kwargs: Any = None  # the keyword arguments as stored (JSON)
    retry_policy: dict[str, Any] | None = None  # its RetryPolicy as stored (JSON), if any
    stored_result: Any = None  # the result column as stored (JSON)
    # Its checkpointed steps in the order recorded (docs/durable-steps.md#seeing-the-steps).
    steps: tuple[TaskStepInfo, ...] = ()
    # A PENDING task after a durable sleep or a wait: what it waits for; None otherwise
    # (docs/durable-steps.md#seeing-the-steps).
    suspension: TaskSuspension | None = None

    @classmethod
    def from_row(
        cls,
        row: Row,
        attempts: Sequence[AttemptInfo],
        steps: Sequence[TaskStepInfo] = (),
        suspension: TaskSuspension | None = None,
    ) -> TaskInfo:
        """A get_task row (its result column named stored_result), the task's attempts and
        steps, and its current sleep or wait."""
        status = row["status"] = TaskStatus(row["status"])
        return cls(
            **row,
            result=result_from_row(status, row["stored_result"]),
            attempts=tuple(attempts),
            steps=tuple(steps),
            suspension=suspension,
        )

    def as_stored(self) -> dict[str, Any]:
        """The row as stored, for JSON (``tether task --json``, the dashboard's task): every
        field but ``attempts`` and ``steps``, with ``result`` the stored JSON and
        ``suspension`` as TaskSuspension.as_json gives it (or None)."""
        shown = {name: getattr(self, name) for name in _STORED_FIELDS}
        shown["result"] = self.stored_result
        shown["suspension"] = None if self.suspension is None else self.suspension.as_json()
        return shown


_STORED_FIELDS = tuple(
    f.name
    for f in fields(TaskInfo)
    if f.name not in ("result", "attempts", "stored_result", "steps", "suspension")
)


def result_from_row(status: TaskStatus, stored: Any) -> TaskResult[Any, TaskError] | None:
    """The TaskResult a row in ``status`` with this stored result stands for; None while the
    task is not terminal."""
    if not status.is_terminal:
        return None
    if stored is not None:
        return decode_result(stored)
    if status is TaskStatus.EXPIRED:
        return TaskResult(
            err=TaskError(ErrorCode.TASK_EXPIRED, "good_until passed before a worker claimed it")
        )
    if status is TaskStatus.CANCELLED:
        return TaskResult(err=TaskError(ErrorCode.TASK_CANCELLED, "cancelled before it ran"))
    return TaskResult(
        err=TaskError(ErrorCode.RESULT_NOT_AVAILABLE, f"task is {status.value} but has no stored result")
    )


@dataclass(frozen=True, slots=True)
class RetrySample:
    """A task a bulk retry's filter matches, as it was before the retry (``finished_at``:
    when it ended; ``workflow_id``: the workflow of a step)."""

    id: uuid.UUID
    name: str
    queue: str
    status: TaskStatus
    error_code: str | None
    finished_at: datetime
    workflow_id: uuid.UUID | None = None
    unique_key: str | None = None


# -- queues -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """One queue as ``tether queues`` shows it.

    counts: tasks per status, every status present (0 when none). oldest_pending_age_s:
    how long the oldest PENDING task that is due has waited since it became due, in
    database time (None: none is due). paused_at / paused_by: since when and by whom the
    queue is paused (None when it is not, or when nobody was named). estimated: the
    statuses whose count is an estimate (on a large table: the finished ones, and PENDING
    beyond 1,000; see docs/operations.md#counts-on-a-large-database); empty when every
    count is exact.
    """

    queue: str
    counts: dict[str, int]
    oldest_pending_age_s: float | None
    paused: bool
    paused_at: datetime | None
    paused_by: str | None
    estimated: tuple[str, ...] = ()

    @classmethod
    def from_row(cls, row: Row) -> QueueInfo:
        """A queue_overview row, whose counts leave out the statuses with no task."""
        counted = row["counts"]
        row["counts"] = {status.value: int(counted.get(status.value, 0)) for status in TaskStatus}
        return cls(**row)


# -- workflows ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepInfo:
    """One step of a workflow as stored, with its task's status once it has a task."""

    node: int
    name: str
    task_name: str
    task_id: uuid.UUID
    status: StepStatus
    task_status: TaskStatus | None  # None until the step is enqueued
    depends_on: tuple[str, ...]  # the names of the steps it waits for
    join: str
    run_anyway: bool
    attempt: int | None
    error_code: str | None
    result: TaskResult[Any, TaskError] | None  # None until the step ends
    enqueued_at: datetime | None
    finished_at: datetime | None
    queue: str = ""  # its task's queue
    retry_count: int | None = None  # its task's retries so far (None until it has a task)

    @classmethod
    def from_row(cls, row: Row, names: dict[int, str]) -> StepInfo:
        """A get_workflow_steps row; ``names``: every step's name by node."""
        status = StepStatus(row["status"])
        stored = row["result"]
        task_status = row["task_status"]
        return cls(
            node=row["node"],
            name=row["node_name"],
            task_name=row["task_name"],
            task_id=row["task_id"],
            status=status,
            task_status=None if task_status is None else TaskStatus(task_status),
            depends_on=tuple(names[d] for d in row["depends_on"]),
            join=row["join_mode"],
            run_anyway=row["run_anyway"],
            attempt=row["attempt"],
            error_code=row["error_code"],
            result=decode_result(stored) if status.is_terminal and stored is not None else None,
            enqueued_at=row["enqueued_at"],
            finished_at=row["finished_at"],
            queue=row["queue"],
            retry_count=row["retry_count"],
        )


@dataclass(frozen=True, slots=True)
class WorkflowSummary:
    """A workflow's own row: a row of ``tether workflows`` and of the dashboard's list."""

    id: uuid.UUID
    name: str
    status: WorkflowStatus
    on_error: str
    steps_total: int
    steps_done: int
    steps_failed: int
    created_at: datetime
    updated_at: datetime
    paused_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class WorkflowInfo(WorkflowSummary):
    """A workflow and every step, by node. ``output_node``: the step whose result is the
    workflow's (None: every final step's, by name)."""

    steps: tuple[StepInfo, ...]
    output_node: int | None = None

    @classmethod
    def from_rows(cls, row: Row, steps: Sequence[Row]) -> WorkflowInfo:
        """A get_workflow row and its get_workflow_steps rows."""
        names = {s["node"]: s["node_name"] for s in steps}
        row["status"] = WorkflowStatus(row["status"])
        return cls(**row, steps=tuple(StepInfo.from_row(s, names) for s in steps))


__all__ = [
    "AttemptInfo",
    "QueueInfo",
    "RetrySample",
    "StepInfo",
    "TaskCore",
    "TaskInfo",
    "TaskStepInfo",
    "TaskSummary",
    "WorkflowInfo",
    "WorkflowSummary",
    "result_from_row",
    "with_status",
]
