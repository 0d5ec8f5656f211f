"""An app of ``async def`` tasks (and one sync task) for the async executor's tests.

A worker started on it without options runs one async child and, for ``double``, sync
children (worker/lanes.py). Tasks that carry a token write it to the ledger (the
ledger's row also names the process that ran the code), as in tests/apps/basic.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from tests.apps.basic import ledger
from tether import AppConfig, ErrorCode, RetryPolicy, TaskError, TaskResult, Tether, current_task
from tether.progress import report_progress

app = Tether(AppConfig(queues=["default", "other"]))

# Retried once after a crash, a second later: chaos tests see each task's crash recorded once.
CRASH_RETRY = RetryPolicy.fixed(1, max_retries=1, auto_retry_for=[ErrorCode.WORKER_CRASHED])


@app.task("nap")
async def nap(seconds: float, token: str = "") -> TaskResult[int, TaskError]:
    if token:
        # In a thread: the ledger's commit (and its WAL flush) must not block the loop.
        await asyncio.to_thread(ledger, token)
    await asyncio.sleep(seconds)
    return TaskResult(ok=os.getpid())


@app.task("nap_once", retry_policy=CRASH_RETRY)
async def nap_once(seconds: float, token: str = "") -> TaskResult[int, TaskError]:
    """Naps on its first attempt only: a retry after a crash returns at once."""
    if token:
        await asyncio.to_thread(ledger, token)
    running = current_task()
    assert running is not None
    if running.retry_count == 0:
        await asyncio.sleep(seconds)
    return TaskResult(ok=os.getpid())


@app.task("block")
async def block(seconds: float) -> None:
    """Blocks the event loop: the mistake the executor must survive."""
    time.sleep(seconds)  # noqa: ASYNC251 - on purpose


@app.task("limited", time_limit=0.5)
async def limited(seconds: float) -> None:
    await asyncio.sleep(seconds)


@app.task("stubborn", time_limit=0.5)
async def stubborn() -> None:
    """Ignores its cancellation: only a kill ends it."""
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            continue


@app.task("boom")
async def boom(message: str) -> None:
    await asyncio.sleep(0)
    raise ValueError(message)


@app.task("whoami")
async def whoami(pause: float) -> dict[str, Any]:
    """What current_task() says inside a task, before and after other tasks ran meanwhile."""
    before = current_task()
    report_progress("started", 0.0)
    await asyncio.sleep(pause)
    after = current_task()
    in_thread = await asyncio.to_thread(current_task)
    assert before is not None and after is not None and in_thread is not None
    return {"before": str(before.id), "after": str(after.id), "thread": str(in_thread.id)}


@app.task("double")
def double(value: int, token: str = "") -> TaskResult[int, TaskError]:
    if token:
        ledger(token)
    return TaskResult(ok=value * 2)


@app.task("sync_nap")
def sync_nap(seconds: float) -> int:
    """A sync task that holds its child a while: each of two sent together gets a child."""
    time.sleep(seconds)
    return os.getpid()
