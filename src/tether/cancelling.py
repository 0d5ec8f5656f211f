"""Cancelling a task, whatever its status: the one function behind ``handle.cancel()``,
``tether cancel`` and the dashboard (docs/tasks.md#cancelling-a-running-task).

A task that has not started (PENDING, CLAIMED) is CANCELLED at once. A RUNNING task's
code is executing in some worker's child: the request is recorded on its row and its
worker is told (NOTIFY, with the worker's heartbeat as the fallback), which tells the
task's code. The task ends CANCELLED when its code stops, or when its process is killed
after the cancel grace period; if it completes first, the completion stands. A task
that has ended is left as it is.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from tether.broker import PostgresBroker, tasks
from tether.errors import TaskNotFoundError
from tether.names import check_by
from tether.result import TaskStatus
from tether.workflow import engine

log = logging.getLogger("tether.cancel")


class CancelReply(StrEnum):
    """What a cancel did. Truthy when it did something (CANCELLED or REQUESTED)."""

    CANCELLED = "cancelled"  # it had not started: CANCELLED now, none of its code ran
    REQUESTED = "requested"  # it is RUNNING: its code is told to stop; it ends CANCELLED
    ALREADY_ENDED = "already_ended"  # it had ended (COMPLETED, FAILED, ...): nothing changed

    def __bool__(self) -> bool:
        return self is not CancelReply.ALREADY_ENDED


@dataclass(frozen=True, slots=True)
class CancelAnswer:
    """The answer to one cancel: what it did, the task's status after it, and a sentence."""

    task_id: uuid.UUID
    reply: CancelReply
    status: TaskStatus
    message: str
    requested_at: datetime | None = None  # the first request's time (database clock)
    requested_by: str | None = None  # who asked first, when known
    worker_id: str | None = None  # the worker running it (REQUESTED)


def cancel_task(broker: PostgresBroker, task_id: uuid.UUID, *, by: str | None = None) -> CancelAnswer:
    """Cancel one task (see the module's docstring). ``by``: who asks, kept on the row and in
    the task's error message. Raises TaskNotFoundError for an unknown id."""
    if not isinstance(task_id, uuid.UUID):
        raise TypeError(f"task_id must be a uuid.UUID, got {type(task_id).__name__}")
    check_by(by)
    # run_request: a cancel whose answer was lost with its connection says what it did, not
    # "already ended" (and the workflow of a step it cancelled is still advanced below).
    done = broker.run_request(lambda conn: tasks.cancel_task(conn, task_id, by), tasks.CANCEL_ANSWER)
    if done is None:
        state = broker.run(lambda conn: tasks.get_status(conn, task_id))
        if state is None:
            raise TaskNotFoundError(
                f"no task with id {task_id} (never sent, sent in a transaction not yet committed, "
                "or pruned by retention)"
            )
        status = TaskStatus(state.status)
        return CancelAnswer(
            task_id,
            CancelReply.ALREADY_ENDED,
            status,
            f"task {task_id} had already ended {status.value}; nothing changed",
        )
    who = f" by {by}" if by else ""
    if done.status == TaskStatus.CANCELLED:
        if done.workflow_id is not None:
            workflow_id = done.workflow_id
            broker.run(lambda conn: engine.advance(conn, workflow_id, [task_id]))
        log.info("task %s cancelled%s before it ran", task_id, who, extra={"task_id": str(task_id)})
        return CancelAnswer(
            task_id,
            CancelReply.CANCELLED,
            TaskStatus.CANCELLED,
            f"task {task_id} cancelled before it ran",
            done.cancel_requested_at,
            done.cancel_requested_by,
        )
    log.info(
        "task %s: cancel requested%s; it runs on worker %s",
        task_id,
        who,
        done.claimed_by_worker_id,
        extra={"task_id": str(task_id), "worker_id": done.claimed_by_worker_id},
    )
    return CancelAnswer(
        task_id,
        CancelReply.REQUESTED,
        TaskStatus.RUNNING,
        f"task {task_id} is RUNNING on worker {done.claimed_by_worker_id}: cancel requested; its code is "
        "told within a second and it ends CANCELLED (killed after the cancel grace period if it goes on), "
        "unless it completes first",
        done.cancel_requested_at,
        done.cancel_requested_by,
        done.claimed_by_worker_id,
    )
