"""A tether task's row and attempts as Django's TaskResult: what get_result and refresh() return.

    tether status          Django TaskResultStatus
    PENDING, CLAIMED    -> READY        (waiting, for its first run or a retry)
    RUNNING             -> RUNNING
    COMPLETED           -> SUCCESSFUL
    FAILED, CANCELLED,  -> FAILED       (it raised, crashed, expired or was cancelled)
    EXPIRED

Fields: ``enqueued_at`` is the row's ``sent_at`` (when enqueue() ran, database time);
``started_at`` the first run's start; ``last_attempted_at`` the latest run's start;
``finished_at`` when it reached its terminal state. ``worker_ids`` holds one tether
worker id per run that started (a run in progress does not count, as Django's
``attempts`` says); ``errors`` one TaskError per failed attempt, oldest first.
"""

from __future__ import annotations

import builtins
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from django.conf import settings
from django.tasks import TaskResult, TaskResultStatus
from django.tasks.base import TaskError
from django.utils import timezone

from tether import codec
from tether.app import Tether
from tether.broker import tasks
from tether.broker.rows import AttemptInfo, TaskInfo
from tether.contrib.django.errors import CODE_CLASSES, TetherTaskError, class_path
from tether.result import ErrorCode, TaskStatus
from tether.result import TaskError as TetherError

STATUSES: dict[TaskStatus, Any] = {
    TaskStatus.PENDING: TaskResultStatus.READY,
    TaskStatus.CLAIMED: TaskResultStatus.READY,
    TaskStatus.RUNNING: TaskResultStatus.RUNNING,
    TaskStatus.COMPLETED: TaskResultStatus.SUCCESSFUL,
    TaskStatus.FAILED: TaskResultStatus.FAILED,
    TaskStatus.CANCELLED: TaskResultStatus.FAILED,
    TaskStatus.EXPIRED: TaskResultStatus.FAILED,
}


def parse_result_id(result_id: Any) -> uuid.UUID | None:
    """The task id a Django result id stands for (its text form), or None if it is not one."""
    if isinstance(result_id, uuid.UUID):
        return result_id
    try:
        return uuid.UUID(str(result_id))
    except ValueError:
        return None


def read(app: Tether, task_id: uuid.UUID) -> TaskInfo | None:
    """The task's row and attempts (one pooled connection), or None if there is no such task.
    Its steps are not read: Django's TaskResult has no place for them."""
    return app.broker.run(lambda conn: tasks.get_task(conn, task_id, steps=False))


def to_django(row: TaskInfo, task: Any, backend_alias: str, queues: set[str]) -> Any:
    """Django's TaskResult for the task ``row``; ``task`` is the Django Task named by the row."""
    status = row.status
    attempts = _settled_attempts(row, row.attempts)
    ran = [a for a in attempts if a.started_at is not None]
    result = decoded_result(row)
    # The row's queue and priority are what this run was sent with (Task.using at enqueue).
    changes: dict[str, Any] = {"backend": backend_alias, "priority": row.priority}
    if row.queue in queues:
        changes["queue_name"] = row.queue
    django_result = TaskResult(
        task=task.using(**changes),
        id=str(row.id),
        status=STATUSES[status],
        enqueued_at=django_time(row.sent_at),
        started_at=django_time(ran[0].started_at if ran else row.started_at),
        finished_at=django_time(_finished_at(row)),
        last_attempted_at=django_time(row.started_at or (ran[-1].started_at if ran else None)),
        args=codec.decode(row.args),
        kwargs=codec.decode(row.kwargs),
        backend=backend_alias,
        errors=_errors(row, attempts, result),
        worker_ids=[a.worker_id or "" for a in ran],
    )
    if status is TaskStatus.COMPLETED and result is not None and result.is_ok:
        object.__setattr__(django_result, "_return_value", result.ok)
    return django_result


def django_time(value: datetime | None) -> datetime | None:
    """A database time as Django shows it: aware with USE_TZ, else naive in settings.TIME_ZONE."""
    if value is None or settings.USE_TZ:
        return value
    naive: datetime = timezone.make_naive(value, timezone.get_default_timezone())
    return naive


def decoded_result(row: TaskInfo) -> Any:
    """The stored tether TaskResult (a retry-pending row keeps its last failure), or None."""
    return None if row.stored_result is None else codec.decode_result(row.stored_result)


def _settled_attempts(row: TaskInfo, attempts: Sequence[AttemptInfo]) -> list[AttemptInfo]:
    """The attempts the row already reflects.

    The row and its attempts are two reads: an outcome recorded between them adds an
    attempt for a run the row still shows CLAIMED or RUNNING. That run is reported as
    it was when the row was read.
    """
    if row.status in (TaskStatus.CLAIMED, TaskStatus.RUNNING):
        return [a for a in attempts if a.attempt < row.attempt]
    return list(attempts)


def _finished_at(row: TaskInfo) -> Any:
    return row.completed_at or row.failed_at or row.cancelled_at or row.expired_at


def _errors(row: TaskInfo, attempts: list[AttemptInfo], result: Any) -> list[Any]:
    """One Django TaskError per failed attempt; the row's own failure when no attempt ran."""
    latest: TetherError | None = result.err if result is not None and not result.is_ok else None
    errors = []
    for attempt in attempts:
        if attempt.outcome != TaskStatus.FAILED:
            continue
        code = attempt.error_code or ErrorCode.UNHANDLED_EXCEPTION
        if latest is not None and attempt.attempt == row.attempt and str(latest.code) == code:
            errors.append(django_error(latest))  # the stored result has the details
        else:
            errors.append(django_error(TetherError(code, attempt.error_message or "")))
    if not errors and latest is not None:  # EXPIRED, CANCELLED: no code ran, no attempt row
        errors.append(django_error(latest))
    return errors


def django_error(error: TetherError) -> Any:
    """A tether error as Django's TaskError: the exception's class path and traceback."""
    data = error.data
    if error.code == ErrorCode.UNHANDLED_EXCEPTION and isinstance(data, dict) and "type" in data:
        module = data.get("module")
        name = str(data["type"])
        path = f"{module}.{name}" if module else _builtin_or_unknown(name)
        return TaskError(exception_class_path=path, traceback=str(data.get("traceback") or error.message))
    if error.code == ErrorCode.UNHANDLED_EXCEPTION:
        # An earlier attempt: its message is "<Type>: <text>"; only builtins can be named.
        name = error.message.partition(":")[0].strip()
        return TaskError(exception_class_path=_builtin_or_unknown(name), traceback=error.message)
    cls = CODE_CLASSES.get(str(error.code), TetherTaskError)
    return TaskError(exception_class_path=class_path(cls), traceback=f"{error.code}: {error.message}")


def _builtin_or_unknown(name: str) -> str:
    found = getattr(builtins, name, None)
    if isinstance(found, type) and issubclass(found, BaseException):
        return f"builtins.{name}"
    return class_path(CODE_CLASSES[ErrorCode.UNHANDLED_EXCEPTION])


def running_result(row: TaskInfo, task: Any, backend_alias: str, queues: set[str], worker_id: str) -> Any:
    """The TaskResult of the run in progress (for TaskContext and the task_started signal).

    As Django's immediate backend does, the running worker is counted in ``worker_ids``,
    so ``TaskContext.attempt`` is the number of this run, from 1.
    """
    result = to_django(row, task, backend_alias, queues)
    object.__setattr__(result, "status", TaskResultStatus.RUNNING)
    result.worker_ids.append(worker_id)
    return result
