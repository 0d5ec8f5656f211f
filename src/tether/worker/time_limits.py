"""Per-task time limits: a child still running its task when the limit passes is killed.

A heartbeat only proves that a task's process is alive. A task blocked forever on a socket
without a timeout keeps heartbeating and would stay RUNNING for ever. A time limit
(``@app.task(..., time_limit=...)``) bounds that. When it passes, the child is killed
(SIGKILL: a blocked call cannot be interrupted reliably from outside), and the supervisor
records the task as failed with TIME_LIMIT_EXCEEDED. That failure is retried if the
task's policy lists the code.

The clock starts when the main process learns that the child started the task (its
STARTED message, or the DONE that started the next task in the same statement). That is
a few milliseconds after the database's started_at.

An async task in an async child is first cancelled by the child itself at its limit
(recorded as TIME_LIMIT_EXCEEDED, the other tasks of the child go on); only if it has not
ended ``cancel_grace_s`` later is the child killed, with every task it runs (the one
that overran as TIME_LIMIT_EXCEEDED, the others as WORKER_CRASHED).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tether.broker.claims import TaskPayload
from tether.log_fields import about_task
from tether.metrics import rules
from tether.worker.execute import time_limit_error
from tether.worker.supervisor import ChildSlot

log = logging.getLogger("tether.worker.time_limits")


class TimeLimits:
    def __init__(
        self,
        limit_for: Callable[[str], tuple[float, bool] | None],
        running: Callable[[int], list[TaskPayload]],
        cancel_grace_s: float,
    ) -> None:
        """limit_for(name): a task name's limit in seconds and whether it is async, or None;
        running(slot): the tasks a child runs; cancel_grace_s: how long an async task
        cancelled at its limit may take to end before its child is killed."""
        self._limit_for = limit_for
        self._running = running
        self.cancel_grace_s = cancel_grace_s
        self._timers: dict[tuple[ChildSlot, str], asyncio.TimerHandle] = {}

    def started(self, slot: ChildSlot, task: TaskPayload) -> None:
        """``task`` now runs in ``slot``: arm its limit, if it has one."""
        if slot.kind == "sync":
            self.finished(slot)  # a sync child runs one task: whatever ran there has ended
        found = self._limit_for(task.name)
        if found is None:
            return
        limit, is_async = found
        # An async child cancels an async task at its limit itself; the kill is the fallback.
        # A sync task has no such step: it is killed at the limit.
        cancelled_first = slot.kind == "async" and is_async
        kill_after = limit + self.cancel_grace_s if cancelled_first else limit
        self._timers[(slot, task.id)] = asyncio.get_running_loop().call_later(
            kill_after, self._expired, slot, task.id, task.attempt, limit, cancelled_first
        )

    def finished(self, slot: ChildSlot, task_id: str | None = None) -> None:
        """A task of ``slot`` ended (None: every task of the slot, or its child is gone)."""
        keys = [(slot, task_id)] if task_id is not None else [k for k in self._timers if k[0] is slot]
        for key in keys:
            timer = self._timers.pop(key, None)
            if timer is not None:
                timer.cancel()

    def _expired(
        self, slot: ChildSlot, task_id: str, attempt: int, limit: float, cancelled_first: bool
    ) -> None:
        self._timers.pop((slot, task_id), None)
        # Only the attempt the timer was armed for: never a later task of the same child.
        task = next((t for t in self._running(slot.index) if t.id == task_id and t.attempt == attempt), None)
        if task is None:
            return
        if not slot.process.is_alive():
            return  # it died by itself; the supervisor records that as a crash
        what_then = "its process was killed"
        if cancelled_first:
            what_then = f"it did not end within {self.cancel_grace_s:g}s of being cancelled and {what_then}"
        slot.killed_for[task.id] = time_limit_error(task.name, limit, what_then)
        slot.killed_as = rules.TIME_LIMIT
        log.error(
            "task %s (%s) attempt %d exceeded its time limit of %gs: killing %s child %d (pid %s)",
            task.id,
            task.name,
            task.attempt,
            limit,
            slot.kind,
            slot.index,
            slot.pid,
            extra=about_task(task),
        )
        if slot.kind == "async":
            slot.crash_reason = (
                f"its async child was killed because task {task.id} ({task.name}) overran its time limit"
            )
        slot.process.kill()  # the supervisor sees the exit and records slot.killed_for
