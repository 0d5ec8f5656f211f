"""Routes 'task finished' notifications to the handles waiting in this process.

One background thread per process LISTENs on 'tether_done' and wakes the waiter
for that task id. Waiters also re-read the row every result_poll_interval_ms,
so a lost notification (connection drop, server restart) only delays a result.
The checks and results around a wait that TaskHandle and WorkflowHandle share
(the timeout given to get(), the WAIT_TIMEOUT result) are here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg

from tether.result import ErrorCode, TaskError, TaskResult

if TYPE_CHECKING:
    from tether.broker import PostgresBroker

log = logging.getLogger("tether.waiter")

Wake = Callable[[], None]
R = TypeVar("R")


class ResultListener:
    def __init__(self, broker: PostgresBroker) -> None:
        self._broker = broker
        self._lock = threading.Lock()
        self._waiters: dict[str, list[Wake]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.listening = threading.Event()

    def subscribe(self, task_id: str, wake: Wake) -> None:
        with self._lock:
            self._waiters.setdefault(task_id, []).append(wake)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="tether-result-listener", daemon=True)
                self._thread.start()

    def unsubscribe(self, task_id: str, wake: Wake) -> None:
        with self._lock:
            wakes = self._waiters.get(task_id)
            if wakes and wake in wakes:
                wakes.remove(wake)
                if not wakes:
                    del self._waiters[task_id]

    def wait_listening(self, timeout: float) -> bool:
        return self.listening.wait(timeout)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                with self._broker.connect() as conn:
                    conn.execute("LISTEN tether_done")
                    self.listening.set()
                    # What finished before LISTEN took effect notified nobody (the first
                    # connection, or a reconnection): every waiter looks at its row again.
                    self._wake_all()
                    backoff = 0.1
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self._wake(note.payload)
                        with self._lock:
                            if not self._waiters:
                                # Nobody waits: let the thread and its connection go.
                                self._thread = None
                                self.listening.clear()
                                return
            except (psycopg.Error, OSError, ConnectionError) as exc:
                self.listening.clear()
                log.warning("result listener lost its connection (%s); retrying in %.1fs", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _wake_all(self) -> None:
        with self._lock:
            task_ids = list(self._waiters)
        for task_id in task_ids:
            self._wake(task_id)

    def _wake(self, task_id: str) -> None:
        with self._lock:
            wakes = list(self._waiters.get(task_id, ()))
        for wake in wakes:
            try:
                wake()
            except RuntimeError as exc:  # e.g. the waiter's event loop already closed
                log.debug("could not wake a waiter for %s: %s", task_id, exc)


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
