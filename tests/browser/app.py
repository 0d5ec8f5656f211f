"""The app the dashboard's browser tests run: tasks that finish, fail, crash with a traceback,
fail once and then work (one of them after two checkpointed steps), sleep durably after a
step, run until cancelled, and kill the child running them."""

from __future__ import annotations

import os
import time

from tether import AppConfig, TaskError, TaskResult, Tether, current_task

app = Tether(AppConfig(queues=["default", "images"]))


@app.task("ui.add")
def add(a: int, b: int) -> TaskResult[int, TaskError]:
    return TaskResult(ok=a + b)


@app.task("ui.fail")
def fail(code: str, message: str = "it failed") -> TaskResult[None, TaskError]:
    return TaskResult(err=TaskError(code, message, {"hint": "look at <b>this</b>"}))


@app.task("ui.boom")
def boom(message: str) -> TaskResult[None, TaskError]:
    raise RuntimeError(message)


@app.task("ui.fails_once")
def fails_once(label: str) -> TaskResult[str, TaskError]:
    """Fails on its first attempt; any later attempt (a retry by hand) completes."""
    me = current_task()
    assert me is not None
    if me.attempt <= 1:
        return TaskResult(err=TaskError("NOT_YET", f"{label}: the first attempt always fails"))
    return TaskResult(ok=f"{label} worked on attempt {me.attempt}")


@app.task("ui.steps_fail_once")
def steps_fail_once(label: str) -> TaskResult[str, TaskError]:
    """Two checkpointed steps, then fails on its first attempt; a retry by hand completes."""
    me = current_task()
    assert me is not None
    me.step("fetch", lambda: {"label": label, "rows": list(range(10))})
    me.step("total", lambda: 45)
    if me.attempt <= 1:
        return TaskResult(err=TaskError("NOT_YET", f"{label}: the first attempt always fails"))
    return TaskResult(ok=f"{label} worked on attempt {me.attempt}")


@app.task("ui.naps")
def naps(seconds: float) -> TaskResult[str, TaskError]:
    """A checkpointed step, a durable sleep of ``seconds`` (the task PENDING meanwhile), done."""
    me = current_task()
    assert me is not None
    me.step("fetch", lambda: 1)
    me.sleep(seconds)
    return TaskResult(ok="rested")


@app.task("ui.until_cancelled")
def until_cancelled(limit_s: float = 60.0) -> TaskResult[str, TaskError]:
    """Runs (reporting progress) until its cancel is requested, or ``limit_s`` passes."""
    me = current_task()
    assert me is not None
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        me.raise_if_cancelled()
        time.sleep(0.05)
    return TaskResult(ok="never cancelled")


@app.task("ui.crash")
def crash() -> TaskResult[None, TaskError]:
    """Its child process dies mid-task: the worker recovers it (the rule dead_child)."""
    os._exit(13)
