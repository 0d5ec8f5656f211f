"""What happened to an attempt, and the fenced statement that records it.

Shared by the child (the task's own outcome), the worker's main process (a
child that died, a name it cannot run) and the reaper (a worker that went
silent), so every path applies the same retry rules and writes the same rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from tether import codec
from tether.config import RetryPolicy
from tether.errors import SerializationError
from tether.result import ErrorCode, TaskError, TaskResult


@dataclass(frozen=True, slots=True)
class Outcome:
    status: str  # COMPLETED | FAILED
    result_json: str
    error_code: str | None
    error_message: str | None
    retry_delay_s: float | None  # set when the failure will be retried

    @property
    def will_retry(self) -> bool:
        return self.retry_delay_s is not None

    @property
    def settles_as(self) -> str:
        """The status the row has once this outcome is recorded."""
        return "PENDING" if self.will_retry else self.status


def retry_delay(retry_policy_json: str | None, retry_count: int, code: str) -> float | None:
    """Seconds until the retry, when the stored policy retries this code and retries are left."""
    if retry_policy_json is None:
        return None
    policy = RetryPolicy.from_json(json.loads(retry_policy_json))
    if not policy.should_retry(code, retry_count):
        return None
    return policy.delay_seconds(retry_count + 1)


def failure(error: TaskError, retry_policy_json: str | None, retry_count: int) -> Outcome:
    try:
        result_json = codec.encode_result(TaskResult(err=error))
    except SerializationError:
        # Exception messages and error data can hold what jsonb refuses (NUL bytes,
        # lone surrogates, odd objects): keep the code, turn the rest into safe text.
        error = TaskError(error.code, printable(error.message), storable(error.data))
        result_json = codec.encode_result(TaskResult(err=error))
    code = str(error.code)
    return Outcome(
        "FAILED", result_json, code, error.message, retry_delay(retry_policy_json, retry_count, code)
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


@dataclass(frozen=True, slots=True)
class Fence:
    """What a write must match: the row's status, the claim's attempt number and owner."""

    task_id: str
    attempt: int
    worker_id: str
    expect: str


def outcome_statement(
    fence: Fence,
    outcome: Outcome,
    *,
    hostname: str | None,
    pid: int | None,
    start_next: tuple[str, int] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The named statement and parameters that record ``outcome`` under ``fence``.

    ``start_next`` = (task id, attempt) of a task this worker claimed, to be marked
    RUNNING by the same statement. The statement returns one row: recorded, next_started.
    """
    next_id, next_attempt = start_next if start_next is not None else (None, None)
    params: dict[str, Any] = {
        "next_id": next_id,
        "next_attempt": next_attempt,
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
        return "retry_task", params
    params["status"] = outcome.status
    return "finish_task", params


def was_recorded(row: Mapping[str, Any] | None) -> bool:
    """Did an outcome statement's fenced write match (its one row says so)?"""
    return bool(row and row["recorded"])
