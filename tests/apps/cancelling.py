"""An app for the tests of cancelling running tasks (docs/tasks.md#cancelling-a-running-task).

Sync tasks run in sync children, async ones in an async child. Every task writes its token
to the ledger when its code starts (tests/apps/basic.py), so a test can count runs and
see that a cancelled task is never run again. RETRY_ALL retries every failure: a task
that ends CANCELLED despite it shows that a cancel is never retried.
"""

from __future__ import annotations

import asyncio
import os
import time

from tests.apps.basic import ledger
from tether import AppConfig, ErrorCode, RetryPolicy, Tether, current_task
from tether.current import RunningTask

app = Tether(AppConfig(queues=["default"]))

RETRY_ALL = RetryPolicy.fixed(
    1, max_retries=3, auto_retry_for=[ErrorCode.WORKER_CRASHED, ErrorCode.UNHANDLED_EXCEPTION]
)


def _me() -> RunningTask:
    running = current_task()
    assert running is not None
    return running


@app.task("cooperative", retry_policy=RETRY_ALL)
def cooperative(token: str) -> None:
    """Checks for a cancel between small steps of work, as a long task should."""
    ledger(token)
    while True:
        _me().raise_if_cancelled()
        time.sleep(0.01)


@app.task("ignores", retry_policy=RETRY_ALL, cancel_grace=1)
def ignores(token: str) -> None:
    """Never looks: only the kill after its 1 s grace period ends it."""
    ledger(token)
    time.sleep(3600)


@app.task("deaf_forever", retry_policy=RETRY_ALL, cancel_grace=3600)
def deaf_forever(token: str) -> None:
    """Ignores a cancel for an hour: the worker dies first in the tests that use it."""
    ledger(token)
    time.sleep(3600)


@app.task("fails_when_cancelled", retry_policy=RETRY_ALL)
def fails_when_cancelled(token: str) -> None:
    """Sees the request and fails with an error of its own (a retryable one)."""
    ledger(token)
    while not _me().cancel_requested:
        time.sleep(0.01)
    raise ValueError("stopping, as asked")


@app.task("finishes_anyway")
def finishes_anyway(token: str) -> str:
    """Sees the request and completes all the same: a completion stands."""
    ledger(token)
    while not _me().cancel_requested:
        time.sleep(0.01)
    return "done anyway"


@app.task("quick")
def quick(value: int) -> int:
    return os.getpid() if value < 0 else value


@app.task("short", retry_policy=RETRY_ALL)
def short(token: str, seconds: float) -> str:
    """Runs briefly: cancels race its completion."""
    ledger(token)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _me().raise_if_cancelled()
        time.sleep(0.001)
    return token


@app.task("snooze", retry_policy=RETRY_ALL)
async def snooze(token: str) -> int:
    await asyncio.to_thread(ledger, token)
    await asyncio.sleep(3600)
    return os.getpid()


@app.task("nap")
async def nap(token: str, seconds: float) -> int:
    await asyncio.to_thread(ledger, token)
    await asyncio.sleep(seconds)
    return os.getpid()


@app.task("deaf", retry_policy=RETRY_ALL, cancel_grace=1)
async def deaf(token: str) -> None:
    """Swallows its cancellation: only the kill of its child ends it."""
    await asyncio.to_thread(ledger, token)
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue
