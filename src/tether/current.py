"""current_task(): what the code of a running task can know about its own run.

A sync child sets a module global around each task it runs (it runs one task at a time,
so threads the task starts see it too). An async child runs many tasks at once in one
event loop: each sets a context variable in its own asyncio task, which asyncio.to_thread
carries over to the threads it runs. Integrations that wrap task
functions need it: the Django backend builds Django's TaskContext from it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from tether.errors import StepError, TaskCancelledError

if TYPE_CHECKING:
    from tether.steps import StepBook

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RunningTask:
    """The task this process is running, as its worker claimed it."""

    id: uuid.UUID
    name: str
    queue: str
    attempt: int  # the claim's fencing token: every claim increments it, so it can have gaps
    retry_count: int  # retries so far: 0 on the first run
    worker_id: str  # the worker holding the claim (tether_workers.id)
    # This attempt's checkpointed steps (tether.steps), set by the child running the task.
    _steps: StepBook | None = field(default=None, repr=False, compare=False)
    # The W3C trace context it was sent with (tracing on): what an async child's unsampled run
    # resolves as its current span only when asked (tether.tracing.follow_runs).
    _trace_context: str | None = field(default=None, repr=False, compare=False)

    def step(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` once for this task, across all its attempts
        (docs/durable-steps.md).

        The first attempt to reach the step calls ``fn`` and stores its JSON result with the
        task (one fenced write) before returning it; a later attempt of the same task (a
        WORKER_CRASHED retry, a retry after an error) gets the stored result back and ``fn``
        is not called. The value returned is the result as stored (decoded from its JSON),
        on the first run too. The n-th call of a name in an attempt maps to the n-th
        stored result of that name (steps in a loop may share a name); a call whose ``fn``
        raised does not count. An exception from ``fn`` stores nothing and goes on up.

        Raises StepError for a bad name (1..200 printable characters, not starting with
        ``tether.``), an ``async def`` fn (use step_async), a call from inside a running event
        loop, or a result over 1 MiB of JSON; SerializationError for a result that is not
        JSON; StepLostError (a BaseException) when this attempt lost its task meanwhile.
        """
        return self._book(name).step(name, fn, *args, **kwargs)

    async def step_async(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step`` for ``async def`` tasks: ``fn`` may be an ``async def`` (awaited) or a plain
        function (called on the loop); the reads and the write wait without blocking the event
        loop. Same rules, errors and guarantee as ``step``."""
        return await self._book(name).step_async(name, fn, *args, **kwargs)

    def sleep(self, seconds: float | timedelta) -> None:
        """Sleep durably (docs/durable-steps.md#durable-sleep): end this attempt, give the worker's
        slot back, and resume as the next attempt of the same task once ``seconds`` (a number or a
        timedelta, 0..366 days) have passed, on any worker, completed steps skipped.

        The sleep is recorded like a step (the n-th sleep of an attempt is occurrence n of
        ``tether.sleep``): the attempt that resumes passes it and goes on after it. It raises
        TaskSuspended (a BaseException: let it through) to end the attempt; the task is PENDING
        meanwhile, counts no retry, and holds no slot. StepError for a bad duration.
        """
        from tether import suspending

        suspending.sleep(self._book("tether.sleep"), seconds)

    async def sleep_async(self, seconds: float | timedelta) -> None:
        """``sleep`` for ``async def`` tasks (its reads wait without blocking the event loop)."""
        from tether import suspending

        await suspending.sleep_async(self._book("tether.sleep"), seconds)

    def wait_for_event(self, key: str, timeout: float | timedelta | None = None) -> Any:
        """Wait durably for the event ``key`` (docs/durable-steps.md#events) and return its payload
        (sent with ``app.send_event(key, payload)`` or ``tether send-event``).

        An event of the key sent earlier and not yet delivered is taken at once. Else the attempt
        ends as a sleep does (the task PENDING, no slot held) and resumes as soon as an event is
        sent, or once ``timeout`` (seconds or a timedelta; None: no timeout) has passed: then it
        raises EventTimeoutError (code EVENT_TIMEOUT), which the task may catch. Recorded like a
        step (occurrence n of ``tether.event``): a later attempt gets the same payload, or the same
        timeout. EventError for a bad key, StepError for a bad timeout.
        """
        from tether import suspending

        return suspending.wait_for_event(self._book("tether.event"), key, timeout)

    async def wait_for_event_async(self, key: str, timeout: float | timedelta | None = None) -> Any:
        """``wait_for_event`` for ``async def`` tasks."""
        from tether import suspending

        return await suspending.wait_for_event_async(self._book("tether.event"), key, timeout)

    def _book(self, name: str) -> StepBook:
        if self._steps is None:
            raise StepError(f"step {name!r}: steps need a task run by a tether worker")
        return self._steps

    @property
    def cancel_requested(self) -> bool:
        """True once a cancel of this task was requested (``handle.cancel()``, ``tether cancel``,
        the dashboard). The worker learns of it within a second and tells the task's process;
        reading it costs no database round trip. Code that checks it should stop soon: it
        ends CANCELLED when it raises (see raise_if_cancelled), and is killed with its
        process after the cancel grace period if it goes on."""
        return _cancel_probe(str(self.id))

    def raise_if_cancelled(self) -> None:
        """Raise TaskCancelledError if a cancel of this task was requested: the task then
        ends CANCELLED (an ``except Exception`` does not catch it)."""
        if self.cancel_requested:
            raise TaskCancelledError(f"task {self.id} ({self.name}): cancel requested")


def _never(task_id: str) -> bool:
    return False


# Set by the child process that runs tasks: asks whether a task's cancel was requested.
_cancel_probe: Callable[[str], bool] = _never


def cancel_requested_for(task_id: str) -> bool:
    """Whether the cancel of ``task_id``, run by this process, was requested."""
    return _cancel_probe(task_id)


def set_cancel_probe(probe: Callable[[str], bool]) -> None:
    """For the child process: how RunningTask.cancel_requested finds out (shared memory in a
    sync child, the cancel messages it received in an async child)."""
    global _cancel_probe
    _cancel_probe = probe


_current: RunningTask | None = None
_current_in_context: ContextVar[RunningTask | None] = ContextVar("tether_current_task", default=None)


def current_task() -> RunningTask | None:
    """The task running here (this asyncio task, or this process), or None outside a task
    run by a tether worker."""
    return _current_in_context.get() or _current


def set_current_task(task: RunningTask | None) -> None:
    """For the one task a sync child runs (process-wide)."""
    global _current
    _current = task


def set_current_task_in_context(task: RunningTask) -> None:
    """For one task of an async child: set inside that task's own asyncio task."""
    _current_in_context.set(task)
