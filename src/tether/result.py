"""Outcomes of tasks: TaskStatus, ErrorCode, TaskError and TaskResult.

ErrorCode and TaskError are defined in tether.task_error (tether.errors needs them
too) and are exported from here, where users import them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

from tether.errors import TaskFailed
from tether.task_error import ErrorCode, TaskError

T = TypeVar("T")
E = TypeVar("E", bound="TaskError")


class TaskStatus(StrEnum):
    """The states of a task, as stored in ``tether_tasks.status``."""

    PENDING = "PENDING"
    CLAIMED = "CLAIMED"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"

    @property
    def is_terminal(self) -> bool:
        return self in TASK_TERMINAL_STATES


TASK_TERMINAL_STATES: frozenset[TaskStatus] = frozenset(
    {TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.EXPIRED}
)


class WorkflowStatus(StrEnum):
    """The states of a workflow, as stored in ``tether_workflows.status``."""

    RUNNING = "RUNNING"
    PAUSED = "PAUSED"  # a step failed under on_error='pause' (or pause() was called)
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in WORKFLOW_TERMINAL_STATES


WORKFLOW_TERMINAL_STATES: frozenset[WorkflowStatus] = frozenset(
    {WorkflowStatus.COMPLETED, WorkflowStatus.FAILED, WorkflowStatus.CANCELLED}
)


class StepStatus(StrEnum):
    """The states of a workflow step, as stored in ``tether_workflow_tasks.status``.

    WAITING for dependencies; READY but held (the workflow is paused); ENQUEUED
    (its task exists: see the task's own status); then one of the four ends.
    """

    WAITING = "WAITING"
    READY = "READY"
    ENQUEUED = "ENQUEUED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    SKIPPED = "SKIPPED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (StepStatus.COMPLETED, StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.CANCELLED)


_MISSING: Any = object()


@dataclass(frozen=True, slots=True, init=False)
class TaskResult(Generic[T, E]):
    """Either ``ok`` (a value, which may be None) or ``err`` (a TaskError), never both."""

    _ok: Any = field(default=_MISSING, repr=False)
    _err: Any = field(default=None, repr=False)

    def __init__(self, ok: Any = _MISSING, err: TaskError | None = None) -> None:
        if err is not None and ok is not _MISSING:
            raise ValueError("TaskResult takes either ok= or err=, not both")
        if err is not None and not isinstance(err, TaskError):
            raise TypeError(f"TaskResult(err=...) must be a TaskError, got {type(err).__name__}")
        if err is None and ok is _MISSING:
            ok = None
        object.__setattr__(self, "_ok", ok if err is None else _MISSING)
        object.__setattr__(self, "_err", err)

    @property
    def is_ok(self) -> bool:
        return self._err is None

    @property
    def is_err(self) -> bool:
        return self._err is not None

    @property
    def ok(self) -> T:
        """The value; raises ValueError on an error result (read ``err`` first)."""
        if self._err is not None:
            raise ValueError(f"result is an error ({self._err.code}: {self._err.message}), not ok")
        return self._ok  # type: ignore[no-any-return]

    @property
    def err(self) -> E | None:
        return self._err  # type: ignore[no-any-return]

    def unwrap(self) -> T:
        """The value, or a TaskFailed exception carrying the error."""
        if self._err is not None:
            raise TaskFailed(self._err)
        return self._ok  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        if self._err is not None:
            return f"TaskResult(err={self._err!r})"
        return f"TaskResult(ok={self._ok!r})"


__all__ = [
    "TASK_TERMINAL_STATES",
    "WORKFLOW_TERMINAL_STATES",
    "ErrorCode",
    "StepStatus",
    "TaskError",
    "TaskResult",
    "TaskStatus",
    "WorkflowStatus",
]
