"""A task's failure as a value: ErrorCode and TaskError (what ``TaskResult.err`` holds).

Its own module so that tether.errors (TaskFailed carries a TaskError) and
tether.result (``unwrap()`` raises TaskFailed) both import it, and result imports
errors one way only. Users import these names from tether or tether.result.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


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
    UNIQUE_KEY_HELD = "UNIQUE_KEY_HELD"  # a workflow step's unique key was held by another task
    EVENT_TIMEOUT = "EVENT_TIMEOUT"  # wait_for_event's timeout passed with no event (EventTimeoutError)
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
