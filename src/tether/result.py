"""Outcomes of tasks: TaskStatus, ErrorCode, TaskError and TaskResult."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, TypeVar

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


class ErrorCode(StrEnum):
    """Outcome codes tether itself produces. User codes are plain strings."""

    WORKER_CRASHED = "WORKER_CRASHED"
    TASK_EXPIRED = "TASK_EXPIRED"
    TASK_CANCELLED = "TASK_CANCELLED"
    RESULT_NOT_AVAILABLE = "RESULT_NOT_AVAILABLE"
    UNHANDLED_EXCEPTION = "UNHANDLED_EXCEPTION"
    TASK_NOT_REGISTERED = "TASK_NOT_REGISTERED"
    BAD_ARGUMENTS = "BAD_ARGUMENTS"
    RESULT_NOT_SERIALIZABLE = "RESULT_NOT_SERIALIZABLE"
    WAIT_TIMEOUT = "WAIT_TIMEOUT"
    TASK_NOT_FOUND = "TASK_NOT_FOUND"
    TIME_LIMIT_EXCEEDED = "TIME_LIMIT_EXCEEDED"  # still running after the task's time_limit: killed
    # workflows
    DEPENDENCY_FAILED = "DEPENDENCY_FAILED"  # a step skipped because a dependency did not complete
    WORKFLOW_FAILED = "WORKFLOW_FAILED"
    WORKFLOW_CANCELLED = "WORKFLOW_CANCELLED"
    WORKFLOW_NOT_FOUND = "WORKFLOW_NOT_FOUND"


@dataclass(frozen=True, slots=True)
class TaskError:
    """A failure: a code (an ErrorCode or a user string), a message and optional JSON data."""

    code: str
    message: str = ""
    data: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.code, str) or not self.code:
            raise ValueError("TaskError.code must be a non-empty string (an ErrorCode or your own)")
        # Normalise built-in codes to the enum so comparisons with ErrorCode read naturally.
        if self.code in ErrorCode.__members__ and not isinstance(self.code, ErrorCode):
            object.__setattr__(self, "code", ErrorCode(self.code))


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
            from tether.errors import TaskFailed

            raise TaskFailed(self._err)
        return self._ok  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        if self._err is not None:
            return f"TaskResult(err={self._err!r})"
        return f"TaskResult(ok={self._ok!r})"
