"""What happened to an attempt: the one rule that turns a result, an error or a crash into
an Outcome (final, or a retry after a delay).

Shared by the child (the task's own outcome), the worker's main process (a child that
died, a name it cannot run) and the reaper (a worker that went silent), so every path
applies the same retry rules; `broker.claims.record_outcome` writes any of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tether import codec
from tether.config import RetryPolicy
from tether.errors import SerializationError
from tether.result import ErrorCode, TaskError, TaskResult, TaskStatus


@dataclass(frozen=True, slots=True)
class Suspension:
    """The task slept or began to wait for an event (tether.suspending): its attempt ends and the
    task goes back to PENDING until its due time, recorded under the step (name, occurrence)."""

    name: str  # tether.sleep | tether.event
    occurrence: int
    delay_s: float | None  # the sleep, or the wait's timeout (None: no timeout)
    key: str | None  # the event key of a wait


@dataclass(frozen=True, slots=True)
class Outcome:
    status: TaskStatus  # COMPLETED | FAILED | CANCELLED | PENDING (a suspension)
    result_json: str
    error_code: str | None
    error_message: str | None
    retry_delay_s: float | None  # set when the failure will be retried
    suspension: Suspension | None = None  # set when the task slept or waits (status PENDING)

    @property
    def will_retry(self) -> bool:
        return self.retry_delay_s is not None

    @property
    def settles_as(self) -> TaskStatus:
        """The status the row has once this outcome is recorded."""
        return TaskStatus.PENDING if self.will_retry else self.status


def suspended(suspension: Suspension) -> Outcome:
    """The task's code slept or began to wait: back to PENDING until due, no retry counted."""
    return Outcome(TaskStatus.PENDING, "null", None, None, None, suspension)


def retry_delay(retry_policy_json: str | None, retry_count: int, code: str) -> float | None:
    """Seconds until the retry, when the stored policy retries this code and retries are left."""
    if retry_policy_json is None:
        return None
    policy = RetryPolicy.from_json(json.loads(retry_policy_json))
    if not policy.should_retry(code, retry_count):
        return None
    return policy.delay_seconds(retry_count + 1)


def failure(error: TaskError, retry_policy_json: str | None, retry_count: int) -> Outcome:
    """The task did not complete: FAILED (retried if its policy retries the code), or, for a
    TASK_CANCELLED error, CANCELLED and never retried.

    The database adds one rule when it writes the outcome (claims.sql write_batch): a
    failure of a task whose cancel was requested settles as CANCELLED too. Only the
    database knows of a request the worker has not heard of yet.
    """
    if error.code == ErrorCode.TASK_CANCELLED:
        return cancelled(error.message, error.data)
    try:
        result_json = codec.encode_result(TaskResult(err=error))
    except SerializationError:
        # Exception messages and error data can hold what jsonb refuses (NUL bytes,
        # lone surrogates, odd objects): keep the code, turn the rest into safe text.
        error = TaskError(error.code, printable(error.message), storable(error.data))
        result_json = codec.encode_result(TaskResult(err=error))
    code = str(error.code)
    return Outcome(
        TaskStatus.FAILED, result_json, code, error.message, retry_delay(retry_policy_json, retry_count, code)
    )


def cancelled(message: str, data: Any = None) -> Outcome:
    """TASK_CANCELLED: the task's code stopped on a cancel request (or was killed for
    ignoring one). Final: a cancelled task is never retried."""
    error = TaskError(ErrorCode.TASK_CANCELLED, printable(message), storable(data))
    return Outcome(
        TaskStatus.CANCELLED, codec.encode_result(TaskResult(err=error)), str(error.code), error.message, None
    )


def crashed(retry_policy_json: str | None, retry_count: int, how: str) -> Outcome:
    """WORKER_CRASHED: the code was running and its process is gone or silent."""
    return failure(TaskError(ErrorCode.WORKER_CRASHED, how), retry_policy_json, retry_count)


def printable(text: str) -> str:
    """Text that PostgreSQL's jsonb accepts: no NUL character, no lone surrogates."""
    return text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")


def storable(data: Any) -> Any:
    """Error data made storable while keeping its shape (a traceback stays under its key)."""
    if isinstance(data, str):
        return printable(data)
    if isinstance(data, dict):
        return {printable(str(k)): storable(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [storable(v) for v in data]
    try:
        codec.dumps(data)
        return data
    except SerializationError:
        return printable(repr(data))
