"""Running one task's code in a child process and turning what happened into an Outcome."""

from __future__ import annotations

import asyncio
import inspect
import logging
import traceback
import typing
from typing import Any

from tether import codec, outcomes, tracing
from tether.app import Tether
from tether.broker.claims import TaskPayload
from tether.current import cancel_requested_for
from tether.errors import EventTimeoutError, SerializationError, TaskCancelledError, TaskSuspended
from tether.log_fields import about_task
from tether.outcomes import Outcome
from tether.result import ErrorCode, TaskError, TaskResult, TaskStatus
from tether.task import Task

log = logging.getLogger("tether.worker.execute")

# How often an async task run in a sync child looks at the cancel board.
CANCEL_CHECK_S = 0.2

# Hints that JSON already produces exactly; converting them would only cost time.
_PLAIN_HINTS: frozenset[Any] = frozenset(
    {inspect.Parameter.empty, Any, int, str, float, bool, dict, list, type(None), None}
)


class Executor:
    """Executes payloads against one app; keeps per-task decoding plans and an event loop."""

    def __init__(self, app: Tether) -> None:
        self.app = app
        self.traced = app.config.tracing  # each run in a CONSUMER span (tether.tracing)
        self._plans: dict[str, dict[str, Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, payload: TaskPayload) -> Outcome:
        """Run the task's code here, one task at a time (a sync child)."""
        if self.traced:
            return tracing.process(payload, lambda: self._run(payload))
        return self._run(payload)

    def _run(self, payload: TaskPayload) -> Outcome:
        prepared = self.prepare(payload)
        if isinstance(prepared, Outcome):
            return prepared
        task, args, kwargs = prepared
        try:
            value = self._call(task, args, kwargs, payload.id)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            if isinstance(exc, TaskSuspended):
                return suspended(exc)
            if _is_cancellation(exc, payload.id):
                return cancelled(payload)
            return self.outcome_of_error(payload, exc)
        return self.outcome_of(payload, value)

    async def run_async(self, payload: TaskPayload) -> Outcome:
        """_run_async (below), in a CONSUMER span when tracing is on. It must be awaited in an
        asyncio task made for this run (AsyncChild's): the span's context is made current in
        that task's own copy of the context and is not detached (tracing.enter_run)."""
        if not self.traced or (span := tracing.enter_run(payload)) is None:
            return await self._run_async(payload)  # untraced, or an unsampled send's run
        try:
            outcome = await self._run_async(payload)
        except BaseException:  # cancelled: the child is going away, the recovery is recorded elsewhere
            span.end()
            raise
        tracing.leave_run(span, outcome)
        return outcome

    async def _run_async(self, payload: TaskPayload) -> Outcome:
        """Run the task's code in this event loop, among others (an async child).

        An async task's time limit cancels its coroutine here; the worker's main process
        kills the child if it has not ended a grace period later. A sync task sent to a
        worker without sync children runs in a thread, which cannot be cancelled: its
        limit is the kill. A cancel request (the child cancels the coroutine) ends it
        CANCELLED; any other cancellation from outside (the child stopping) propagates.
        """
        prepared = self.prepare(payload)
        if isinstance(prepared, Outcome):
            return prepared
        task, args, kwargs = prepared
        limit = task.time_limit if task.is_async else None
        try:
            if not task.is_async:
                value = await asyncio.to_thread(task.fn, *args, **kwargs)
            elif limit is None:
                value = await task.fn(*args, **kwargs)
            else:
                async with asyncio.timeout(limit) as scope:
                    value = await task.fn(*args, **kwargs)
        except asyncio.CancelledError:
            if cancel_requested_for(payload.id):
                return cancelled(payload)
            raise  # the child is going away
        except BaseException as exc:
            if isinstance(exc, TaskSuspended):
                return suspended(exc)
            if isinstance(exc, TaskCancelledError):
                return cancelled(payload)
            if limit is not None and isinstance(exc, TimeoutError) and scope.expired():
                log.error(
                    "task %s (%s) attempt %d exceeded its time limit of %gs: cancelled",
                    payload.id,
                    payload.name,
                    payload.attempt,
                    limit,
                    extra=about_task(payload),
                )
                return failure(payload, time_limit_error(payload.name, limit, "it was cancelled"))
            if isinstance(exc, KeyboardInterrupt):
                raise
            return self.outcome_of_error(payload, exc)
        return self.outcome_of(payload, value)

    def prepare(self, payload: TaskPayload) -> tuple[Task[Any, Any], list[Any], dict[str, Any]] | Outcome:
        """The task and its decoded arguments, or the failure that ends it before it runs."""
        task = self.app.find_task(payload.name)
        if task is None:
            return failure(
                payload,
                TaskError(
                    ErrorCode.TASK_NOT_REGISTERED,
                    f"no task named {payload.name!r} is registered in this worker's app",
                ),
            )
        try:
            args, kwargs = self._decode(task, payload)
        except SerializationError as exc:
            return failure(payload, TaskError(ErrorCode.BAD_ARGUMENTS, str(exc)))
        return task, args, kwargs

    def outcome_of_error(self, payload: TaskPayload, exc: BaseException) -> Outcome:
        """An exception the task's code raised: a FAILED outcome with its traceback (an
        EventTimeoutError it let through: the code EVENT_TIMEOUT, its retry policy decides)."""
        if isinstance(exc, EventTimeoutError):
            data = {"key": exc.key, "timeout_s": exc.timeout_s}
            return failure(payload, TaskError(ErrorCode.EVENT_TIMEOUT, str(exc), data))
        log.info(
            "task %s (%s) raised %s", payload.name, payload.id, type(exc).__name__, extra=about_task(payload)
        )
        return failure(
            payload,
            TaskError(
                ErrorCode.UNHANDLED_EXCEPTION,
                f"{type(exc).__name__}: {exc}",
                {
                    "type": type(exc).__qualname__,
                    "module": type(exc).__module__,  # with "type", the class's import path
                    "traceback": "".join(traceback.format_exception(exc)),
                },
            ),
        )

    def outcome_of(self, payload: TaskPayload, value: Any) -> Outcome:
        """What the task's code returned: COMPLETED, or FAILED (retried by its policy) for an err."""
        result = value if isinstance(value, TaskResult) else TaskResult(ok=value)
        try:
            result_json = codec.encode_result(result, what=f"result of task {payload.name!r}")
        except SerializationError as exc:
            return failure(payload, TaskError(ErrorCode.RESULT_NOT_SERIALIZABLE, str(exc)))
        if result.is_ok:
            return Outcome(TaskStatus.COMPLETED, result_json, None, None, None)
        err = result.err
        assert err is not None
        delay = outcomes.retry_delay(payload.retry_policy, payload.retry_count, str(err.code))
        return Outcome(TaskStatus.FAILED, result_json, str(err.code), err.message, delay)

    def _call(self, task: Task[Any, Any], args: list[Any], kwargs: dict[str, Any], task_id: str) -> Any:
        if not task.is_async:
            return task.fn(*args, **kwargs)
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        loop = self._loop
        running = loop.create_task(task.fn(*args, **kwargs))

        # An async task run in a sync child: this process's one thread is in the loop, so
        # the loop itself looks at the cancel board and cancels the coroutine when asked.
        def watch_cancel() -> None:
            if cancel_requested_for(task_id):
                running.cancel()
            elif not running.done():
                watching[0] = loop.call_later(CANCEL_CHECK_S, watch_cancel)

        watching = [loop.call_later(CANCEL_CHECK_S, watch_cancel)]
        try:
            return loop.run_until_complete(running)
        finally:
            watching[0].cancel()

    def _decode(self, task: Task[Any, Any], payload: TaskPayload) -> tuple[list[Any], dict[str, Any]]:
        args = codec.loads(payload.args)
        kwargs = codec.loads(payload.kwargs)
        try:
            # The code may have changed since the task was sent: check before calling.
            bound = task.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise SerializationError(f"stored arguments no longer fit task {task.name!r}: {exc}") from None
        plan = self._plan(task)
        if not plan:
            return args, kwargs
        for pname, hint in plan.items():
            if pname in bound.arguments:
                bound.arguments[pname] = _convert(
                    bound.arguments[pname], hint, what=f"argument {pname!r} of task {task.name!r}"
                )
        return list(bound.args), dict(bound.kwargs)

    def _plan(self, task: Task[Any, Any]) -> dict[str, Any]:
        """Which parameters need converting to their annotated type (dataclasses, models, ...)."""
        plan = self._plans.get(task.name)
        if plan is None:
            try:
                hints = typing.get_type_hints(task.fn)
            except Exception as exc:
                log.warning(
                    "task %s: cannot resolve type hints (%s); arguments stay as decoded", task.name, exc
                )
                hints = {}
            plan = {
                name: hints[name]
                for name, param in task.signature.parameters.items()
                if name in hints
                and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
                and _needs_conversion(hints[name])
            }
            self._plans[task.name] = plan
        return plan


def _convert(value: Any, hint: Any, *, what: str) -> Any:
    """A decoded argument as its annotated type; a TaskResult (a workflow step fed the whole
    result of a dependency) is rebuilt, its ok value converted to the first type argument."""
    if hint is TaskResult or typing.get_origin(hint) is TaskResult:
        result = codec.result_from_decoded(value)
        type_args = typing.get_args(hint)
        if result.is_ok and type_args:
            return TaskResult(ok=codec.decode_as(result.ok, type_args[0], what=f"{what} (ok value)"))
        return result
    return codec.decode_as(value, hint, what=what)


def _needs_conversion(hint: Any) -> bool:
    try:
        return hint not in _PLAIN_HINTS
    except TypeError:  # unhashable hint
        return True


def _is_cancellation(exc: BaseException, task_id: str) -> bool:
    """The task stopped on its cancel request: it raised TaskCancelledError, or its coroutine
    was cancelled because of the request."""
    return isinstance(exc, TaskCancelledError) or (
        isinstance(exc, asyncio.CancelledError) and cancel_requested_for(task_id)
    )


def suspended(exc: TaskSuspended) -> Outcome:
    """The task's code slept or began to wait for an event (tether.suspending)."""
    return outcomes.suspended(outcomes.Suspension(exc.name, exc.occurrence, exc.delay_s, exc.key))


def cancelled(payload: TaskPayload) -> Outcome:
    """The task's code stopped on a cancel request (the database adds who asked)."""
    log.info(
        "task %s (%s) attempt %d stopped on its cancel request",
        payload.id,
        payload.name,
        payload.attempt,
        extra=about_task(payload),
    )
    return outcomes.cancelled("cancelled while running")


def failure(payload: TaskPayload, error: TaskError) -> Outcome:
    return outcomes.failure(error, payload.retry_policy, payload.retry_count)


def time_limit_error(name: str, limit: float, what_then: str) -> TaskError:
    """TIME_LIMIT_EXCEEDED for a task still running at its limit; what_then: what was done."""
    return TaskError(
        ErrorCode.TIME_LIMIT_EXCEEDED,
        f"task {name!r} was still running after its time limit of {limit:g}s; {what_then}",
        {"time_limit_s": limit},
    )


def internal_failure(payload: TaskPayload, exc: BaseException) -> Outcome:
    """An error in tether's own handling of a task (not in its code): recorded, never fatal."""
    log.exception(
        "internal error while running task %s (%s)", payload.id, payload.name, extra=about_task(payload)
    )
    error = TaskError(ErrorCode.UNHANDLED_EXCEPTION, f"tether internal error: {type(exc).__name__}: {exc}")
    return failure(payload, error)
