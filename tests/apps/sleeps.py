"""The app the durable sleep and event tests run (docs/durable-steps.md#durable-sleep).

Every step writes ``<token>:<step>`` to the chaos ledger (tests/apps/chaos.py), so a test
counts how many times each step's code ran, across attempts and processes.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from tests.apps.chaos import CRASH_RETRY, ledger
from tether import (
    AppConfig,
    ErrorCode,
    QueueLimits,
    RetryPolicy,
    RunningTask,
    TaskError,
    TaskResult,
    Tether,
    current_task,
)
from tether.errors import EventTimeoutError

# "one": at most one task in flight (docs/limits.md): a sleeping task must not hold that slot.
app = Tether(AppConfig(queues=["default", "one"], queue_limits={"one": QueueLimits(max_in_flight=1)}))

#: One retry of a crash or of TRANSIENT, at once: a sleep must not use it up.
ONE_RETRY = RetryPolicy.fixed(
    0.1, max_retries=1, auto_retry_for=[ErrorCode.WORKER_CRASHED, "TRANSIENT"], jitter=0
)


def running() -> RunningTask:
    task = current_task()
    assert task is not None
    return task


def mark(token: str, step: str, value: Any) -> Any:
    ledger(f"{token}:{step}")
    return value


async def mark_async(token: str, step: str, value: Any) -> Any:
    await asyncio.to_thread(ledger, f"{token}:{step}")
    return value


@app.task("nap", retry_policy=CRASH_RETRY)
def nap(token: str, seconds: float) -> TaskResult[dict[str, Any], TaskError]:
    """A step, a durable sleep, a step."""
    task = running()
    before = task.step("before", mark, token, "before", 1)
    task.sleep(timedelta(seconds=seconds))
    after = task.step("after", mark, token, "after", 2)
    return TaskResult(ok={"sum": before + after, "attempt": task.attempt, "retry_count": task.retry_count})


@app.task("quick")
def quick(token: str) -> str:
    ledger(f"{token}:quick")
    return "quick"


@app.task("naps_then_fails_once", retry_policy=ONE_RETRY)
def naps_then_fails_once(token: str, naps: int, seconds: float) -> TaskResult[dict[str, Any], TaskError]:
    """``naps`` sleeps in a loop (one name per loop turn: the n-th sleep), then a TRANSIENT error on
    the first run past them: its one retry must still be there, however many sleeps it took."""
    task = running()
    for i in range(naps):
        task.step("nap", mark, token, f"nap{i}", i)
        task.sleep(seconds)
    if task.step("failed", mark, token, "failed", task.retry_count) == 0 and task.retry_count == 0:
        return TaskResult(err=TaskError("TRANSIENT", "once"))
    return TaskResult(ok={"retry_count": task.retry_count, "attempt": task.attempt})


@app.task("wait_event")
def wait_event(token: str, key: str, timeout: float | None) -> TaskResult[Any, TaskError]:
    """A step, a wait for ``key``, a step; returns the payload."""
    task = running()
    task.step("before", mark, token, "before", 1)
    payload = task.wait_for_event(key, timeout=timeout)
    task.step("after", mark, token, "after", 2)
    return TaskResult(ok={"payload": payload, "attempt": task.attempt})


@app.task("wait_catches")
def wait_catches(key: str, timeout: float) -> TaskResult[Any, TaskError]:
    """A timeout the task handles."""
    try:
        return TaskResult(ok={"payload": running().wait_for_event(key, timeout=timeout)})
    except EventTimeoutError as exc:
        return TaskResult(ok={"timed_out": exc.code, "key": exc.key, "message": str(exc)})


@app.task("wait_uncaught")
def wait_uncaught(key: str, timeout: float) -> Any:
    """A timeout the task lets through: FAILED with EVENT_TIMEOUT."""
    return running().wait_for_event(key, timeout=timeout)


@app.task("bad_waits")
def bad_waits() -> list[str]:
    """Bad arguments, each refused with an error naming it (nothing suspended)."""
    task = running()
    errors = []
    for call in (
        lambda: task.sleep(-1),
        lambda: task.sleep("soon"),  # type: ignore[arg-type]
        lambda: task.wait_for_event("", timeout=1),
        lambda: task.wait_for_event("k", timeout=-5),
        lambda: task.wait_for_event("two\nlines", timeout=1),
    ):
        try:
            call()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


@app.task("nap_async", retry_policy=CRASH_RETRY)
async def nap_async(token: str, seconds: float) -> TaskResult[dict[str, Any], TaskError]:
    task = running()
    before = await task.step_async("before", mark_async, token, "before", 1)
    await task.sleep_async(seconds)
    after = await task.step_async("after", mark_async, token, "after", 2)
    return TaskResult(ok={"sum": before + after, "attempt": task.attempt})


@app.task("wait_event_async")
async def wait_event_async(token: str, key: str, timeout: float | None) -> TaskResult[Any, TaskError]:
    task = running()
    await task.step_async("before", mark_async, token, "before", 1)
    payload = await task.wait_for_event_async(key, timeout=timeout)
    await task.step_async("after", mark_async, token, "after", 2)
    return TaskResult(ok={"payload": payload, "attempt": task.attempt})


@app.task("held_nap", retry_policy=CRASH_RETRY)
def held_nap(token: str, hold_s: float, seconds: float) -> TaskResult[dict[str, Any], TaskError]:
    """A step, then holds its process ``hold_s`` on its first run only (outside any step: for a
    freeze), then sleeps: a zombie attempt reaches its sleep after the task was recovered
    elsewhere (its steps read at its first step, before the live attempt stored its sleep)."""
    import time

    task = running()
    task.step("first", mark, token, "first", 1)
    if ledger(f"{token}:held") == 1:
        time.sleep(hold_s)
    task.sleep(seconds)
    return TaskResult(ok={"attempt": task.attempt})
