"""The app the checkpointed steps' tests run (docs/durable-steps.md).

Every step function writes ``<token>:<step>`` to the chaos ledger (tests/apps/chaos.py: it
retries, and each row names the process that wrote it), so a test counts how many times
each step's code ran, across attempts and processes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from tests.apps.chaos import CRASH_RETRY, ledger
from tether import AppConfig, RetryPolicy, RunningTask, TaskError, TaskResult, Tether, current_task

app = Tether(AppConfig(queues=["default"]))

#: One retry, at once, of an error result with the code TRANSIENT.
TRANSIENT_ONCE = RetryPolicy.fixed(0.1, max_retries=1, auto_retry_for=["TRANSIENT"], jitter=0)


def running() -> RunningTask:
    task = current_task()
    assert task is not None
    return task


def mark(token: str, step: str, value: Any, hold_first_s: float = 0.0) -> Any:
    """A step's code: one ledger row; holds ``hold_first_s`` on its first run only."""
    if ledger(f"{token}:{step}") == 1:
        time.sleep(hold_first_s)
    return value


async def mark_async(token: str, step: str, value: Any) -> Any:
    await asyncio.to_thread(ledger, f"{token}:{step}")  # the ledger's commit off the loop
    return value


def three(token: str, hold_in_two_s: float) -> TaskResult[dict[str, Any], TaskError]:
    task = running()
    one = task.step("one", mark, token, "one", 1)
    two = task.step("two", mark, token, "two", 20, hold_first_s=hold_in_two_s)
    three = task.step("three", mark, token, "three", 300)
    return TaskResult(ok={"total": one + two + three, "attempt": task.attempt})


@app.task("three_steps", retry_policy=CRASH_RETRY)
def three_steps(token: str, hold_in_two_s: float = 0.0) -> TaskResult[dict[str, Any], TaskError]:
    """Three steps; the second holds its process on its first run (for a kill). Retries a crash."""
    return three(token, hold_in_two_s)


@app.task("three_steps_no_retry")
def three_steps_no_retry(token: str, hold_in_two_s: float = 0.0) -> TaskResult[dict[str, Any], TaskError]:
    """The same, without a retry policy: a crash ends it FAILED."""
    return three(token, hold_in_two_s)


@app.task("loop_steps", retry_policy=TRANSIENT_ONCE)
def loop_steps(token: str, n: int) -> TaskResult[dict[str, Any], TaskError]:
    """``n`` steps of one name in a loop, a step retried in place after it raised, then a
    retryable error on the first attempt: the retry gets every step back."""
    task = running()
    items = [task.step("item", mark, token, f"item{i}", i * i) for i in range(n)]
    tries = 0

    def flaky() -> str:
        nonlocal tries
        tries += 1
        ledger(f"{token}:flaky")
        if tries == 1:
            raise RuntimeError("first try fails")
        return "steady"

    while True:
        try:
            steady = task.step("flaky", flaky)
            break
        except RuntimeError:
            continue
    if task.retry_count == 0:
        return TaskResult(err=TaskError("TRANSIENT", "once"))
    return TaskResult(ok={"items": items, "flaky": steady, "tries": tries})


async def _never_awaited() -> int:
    return 1


@app.task("bad_steps")
def bad_steps() -> TaskResult[list[str], TaskError]:
    """Each bad use of step(), caught: the errors, in order."""
    task = running()
    tries: list[tuple[Any, Any, Any]] = [
        ("", mark, None),
        (42, mark, None),
        ("x" * 201, mark, None),
        ("tether.sleep", mark, None),
        ("two\nlines", mark, None),
        ("not-callable", "mark", None),
        ("async-fn", _never_awaited, None),
        ("not-json", lambda: object(), None),
        ("too-big", lambda: "x" * (1024 * 1024), None),
    ]
    errors = []
    for name, fn, _ in tries:
        try:
            task.step(name, fn)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return TaskResult(ok=errors)


@app.task("async_steps", retry_policy=TRANSIENT_ONCE)
async def async_steps(token: str) -> TaskResult[dict[str, Any], TaskError]:
    """Async steps (an async fn, a plain fn, two at once under one name), then a retryable error
    on the first attempt: the retry gets them back and runs only the last one."""
    task = running()
    one = await task.step_async("one", mark_async, token, "one", 1)
    plain = await task.step_async("plain", lambda: {"b": 2, "a": 1})
    fan = await asyncio.gather(
        task.step_async("fan", mark_async, token, "fan-a", "a"),
        task.step_async("fan", mark_async, token, "fan-b", "b"),
    )
    if task.retry_count == 0:
        return TaskResult(err=TaskError("TRANSIENT", "once"))
    last = await task.step_async("last", mark_async, token, "last", 300)
    return TaskResult(ok={"one": one, "plain": plain, "fan": fan, "last": last})


@app.task("async_step_refused")
async def async_step_refused() -> TaskResult[str, TaskError]:
    """step() (the sync call) from an async def task: refused, it would block the loop."""
    try:
        running().step("blocking", lambda: 1)
    except Exception as exc:
        return TaskResult(ok=f"{type(exc).__name__}: {exc}")
    return TaskResult(ok="not refused")


@app.task("node_with_steps")
def node_with_steps(value: int, token: str) -> TaskResult[int, TaskError]:
    """A workflow node whose task checkpoints a step."""
    doubled: int = running().step("double", mark, token, "double", value * 2)
    return TaskResult(ok=doubled + 1)


@app.task("steps_then_fail")
def steps_then_fail(token: str) -> TaskResult[dict[str, Any], TaskError]:
    """Two steps (the second's result 1,000 é: 2,002 bytes of JSON, 1,002 characters), then
    an error on the first attempt to get there (no retry policy: FAILED); a retry by hand
    completes."""
    task = running()
    one = task.step("one", mark, token, "one", 1)
    wide = task.step("wide", mark, token, "wide", "é" * 1000)
    if ledger(f"{token}:end") == 1:
        return TaskResult(err=TaskError("ONCE", "fails the first time it gets here"))
    return TaskResult(ok={"one": one, "wide": len(wide)})


@app.task("three_steps_cancellable", cancel_grace=0.5)
def three_steps_cancellable(token: str, hold_in_two_s: float = 0.0) -> TaskResult[dict[str, Any], TaskError]:
    """three_steps, killed 0.5 s after a cancel its code does not hear (it sleeps in step 2)."""
    return three(token, hold_in_two_s)
