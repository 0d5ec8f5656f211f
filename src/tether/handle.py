"""TaskHandle: what send() returns; waits for, inspects and cancels one task."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tether import cancelling
from tether.app_view import AppView
from tether.broker import tasks
from tether.cancelling import CancelReply
from tether.errors import TaskNotFoundError
from tether.offload import in_thread
from tether.result import ErrorCode, TaskError, TaskResult, TaskStatus
from tether.result_wait import check_timeout, timed_out, wait_for, wait_for_async

if TYPE_CHECKING:
    # Public as tether.AttemptInfo and tether.TaskInfo (and importable from here, as always:
    # __getattr__ below imports them on first use).
    from tether.broker.rows import AttemptInfo as AttemptInfo
    from tether.broker.rows import TaskInfo as TaskInfo
    from tether.broker.rows import TaskStepInfo as TaskStepInfo
    from tether.broker.rows import TaskSuspension as TaskSuspension

    # Imported by retry() on first use: retrying brings the retry and reopen statement
    # groups (ten row dataclasses), which neither a send nor a worker needs.
    from tether.retrying import RetryAnswer

T = TypeVar("T")


class TaskHandle(Generic[T]):
    """One task: wait for it, read it, cancel it.

    ``deduplicated`` says what the send that made this handle did: False, it created the
    task; True, a unique send found its key held and this handle is for the task holding
    it; None, the handle was not made by a send (``app.handle(id)``), so there is nothing
    to say.
    """

    def __init__(
        self, app: AppView, task_id: uuid.UUID, name: str | None = None, *, deduplicated: bool | None = None
    ) -> None:
        self.app = app
        self.id = task_id
        self.name = name
        self.deduplicated = deduplicated

    def __repr__(self) -> str:
        dedup = ", deduplicated" if self.deduplicated else ""
        return f"TaskHandle({self.name or 'task'}, id={self.id}{dedup})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TaskHandle) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    # -- reading -------------------------------------------------------------

    def status(self) -> TaskStatus:
        return _status(self.id, self._get_status())

    async def status_async(self) -> TaskStatus:
        return _status(self.id, await in_thread(self._get_status))

    def info(self) -> TaskInfo:
        """The task's row, its finished attempts, its recorded steps (``info.steps``: name,
        occurrence, attempt, when, size; docs/durable-steps.md#seeing-the-steps) and its
        current durable sleep or wait (``info.suspension``, a TaskSuspension; None when it
        neither sleeps nor waits). Raises TaskNotFoundError for an unknown id."""
        info = self.app.broker.run(lambda conn: tasks.get_task(conn, self.id))
        if info is None:
            raise _not_found(self.id)
        return info

    async def info_async(self) -> TaskInfo:
        return await in_thread(self.info)

    def cancel(self, *, by: str | None = None) -> CancelReply:
        """Cancel the task, whatever it is doing (docs/tasks.md#cancelling-a-running-task).

        Not started (PENDING, CLAIMED): CANCELLED now, CancelReply.CANCELLED. RUNNING: the
        cancel is requested and its code told within a second, CancelReply.REQUESTED; it
        ends CANCELLED when its code stops, or killed after the cancel grace period, unless
        it completes first. Ended: nothing changes, CancelReply.ALREADY_ENDED (falsy).
        ``by``: who asks, kept on the row and in the task's error message.

        A workflow step cancelled this way ends CANCELLED in its workflow, which
        then treats it as a step that did not complete (its on_error applies).
        """
        return cancelling.cancel_task(self.app.broker, self.id, by=by).reply

    async def cancel_async(self, *, by: str | None = None) -> CancelReply:
        return await in_thread(lambda: self.cancel(by=by))

    def retry(self, *, by: str | None = None, from_scratch: bool = False) -> RetryAnswer:
        """Run a FAILED, CANCELLED or EXPIRED task again (docs/tasks.md#retrying-by-hand).

        It becomes PENDING, due now, as a new attempt, with its retry policy's whole budget
        again; its earlier attempts stay in its history. It keeps its recorded steps, so the
        new attempt resumes after the last one; ``from_scratch=True`` deletes them in the
        same transaction and every step runs again
        (docs/durable-steps.md#retrying-from-the-last-step). Any other status changes nothing:
        ``retried`` is False and ``reason`` says why. A workflow step reopens its workflow
        where the rules allow (docs/workflows.md#retrying-a-step). ``by``: who asks (logged).
        Raises TaskNotFoundError for an unknown id.
        """
        from tether.retrying import retry_task

        return retry_task(self.app.broker, self.id, by=by, from_scratch=from_scratch)

    async def retry_async(self, *, by: str | None = None, from_scratch: bool = False) -> RetryAnswer:
        return await in_thread(lambda: self.retry(by=by, from_scratch=from_scratch))

    # -- waiting -------------------------------------------------------------

    def get(self, timeout: float | None = None) -> TaskResult[T, TaskError]:
        """Wait for the outcome. On timeout: an err result with WAIT_TIMEOUT (the task goes on)."""
        check_timeout(timeout)
        poll = self.app.config.result_poll_interval_ms / 1000
        found = wait_for(self.app.result_listener, str(self.id), self._watch, self._read, timeout, poll)
        return found if found is not None else timed_out(timeout)

    async def get_async(self, timeout: float | None = None) -> TaskResult[T, TaskError]:
        check_timeout(timeout)
        poll = self.app.config.result_poll_interval_ms / 1000
        found = await wait_for_async(
            self.app.result_listener, str(self.id), self._watch_async, self._read_async, timeout, poll
        )
        return found if found is not None else timed_out(timeout)

    def _get_status(self) -> tasks.TaskState | None:
        return self.app.broker.run(lambda conn: tasks.get_status(conn, self.id))

    def _watch_status(self) -> tasks.TaskState | None:
        return self.app.broker.run(lambda conn: tasks.watch_task(conn, self.id))

    def _watch(self) -> TaskResult[T, TaskError] | None:
        return _result_or_missing(self.id, self._watch_status())

    async def _watch_async(self) -> TaskResult[T, TaskError] | None:
        return _result_or_missing(self.id, await in_thread(self._watch_status))

    def _read(self) -> TaskResult[T, TaskError] | None:
        return _result_or_missing(self.id, self._get_status())

    async def _read_async(self) -> TaskResult[T, TaskError] | None:
        return _result_or_missing(self.id, await in_thread(self._get_status))


def _not_found(task_id: uuid.UUID) -> TaskNotFoundError:
    return TaskNotFoundError(
        f"no task with id {task_id} (never sent; sent inside a transaction that has not committed "
        "or was rolled back; or pruned by retention)"
    )


def _status(task_id: uuid.UUID, state: tasks.TaskState | None) -> TaskStatus:
    if state is None:
        raise _not_found(task_id)
    return state.status


def _result_or_missing(
    task_id: uuid.UUID, state: tasks.TaskState | None
) -> TaskResult[Any, TaskError] | None:
    if state is None:
        return TaskResult(
            err=TaskError(
                ErrorCode.TASK_NOT_FOUND,
                f"no task with id {task_id} (never sent; sent inside a transaction that has not "
                "committed or was rolled back; or pruned by retention)",
            )
        )
    from tether.broker.rows import result_from_row

    return result_from_row(state.status, state.result)


if not TYPE_CHECKING:  # for a type checker, the names are imported above

    def __getattr__(name: str) -> object:
        """broker/rows.py's types, imported on first use (a send and a worker never build
        them): ``from tether.handle import AttemptInfo`` works as before."""
        if name in ("AttemptInfo", "TaskInfo", "TaskStepInfo", "TaskSuspension"):
            value = getattr(__import__("tether.broker.rows", fromlist=[name]), name)
            globals()[name] = value  # the next lookup is a plain one
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
