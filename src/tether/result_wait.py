"""Waiting in a handle until a row reaches a state: a notification first, the poll as fallback.

Shared by TaskHandle and WorkflowHandle, with the checks and results around a wait (the
timeout given to get(), the WAIT_TIMEOUT result). The notifications come through the
process's ResultListener (result_listener.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tether.result import ErrorCode, TaskError, TaskResult
from tether.result_listener import ResultListener, Wake

R = TypeVar("R")


def threadsafe_async_event(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Wake:
    def wake() -> None:
        loop.call_soon_threadsafe(event.set)

    return wake


def wait_for(
    listener: ResultListener,
    key: str,
    first: Callable[[], R | None],
    again: Callable[[], R | None],
    timeout: float | None,
    poll_s: float,
) -> R | None:
    """Wait until ``again()`` returns something (None on timeout).

    ``first()`` asks for a notification and looks once; after subscribing, one
    more look catches what ended in between (it notified nobody). Then every
    notification for ``key``, or every ``poll_s`` at the latest, looks again.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    found = first()
    if found is not None:
        return found
    woken = threading.Event()
    listener.subscribe(key, woken.set)
    try:
        found = again()
        while found is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            woken.wait(poll_s if left is None else min(poll_s, left))
            woken.clear()
            found = again()
        return found
    finally:
        listener.unsubscribe(key, woken.set)


async def wait_for_async(
    listener: ResultListener,
    key: str,
    first: Callable[[], Awaitable[R | None]],
    again: Callable[[], Awaitable[R | None]],
    timeout: float | None,
    poll_s: float,
) -> R | None:
    """wait_for for an event loop: the same looks, awaited."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    found = await first()
    if found is not None:
        return found
    woken = asyncio.Event()
    wake = threadsafe_async_event(loop, woken)
    listener.subscribe(key, wake)
    try:
        found = await again()
        while found is None:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken.wait(), poll_s if left is None else min(poll_s, left))
            woken.clear()
            found = await again()
        return found
    finally:
        listener.unsubscribe(key, wake)


def check_timeout(timeout: float | None) -> None:
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0  # NaN too
    ):
        raise ValueError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")


def timed_out(timeout: float | None, what: str = "task") -> TaskResult[Any, TaskError]:
    """What get() returns when the wait ends first: the task (or workflow) itself goes on."""
    return TaskResult(
        err=TaskError(ErrorCode.WAIT_TIMEOUT, f"no outcome within {timeout}s; the {what} goes on")
    )
