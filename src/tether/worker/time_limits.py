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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tether.broker.claims import TaskPayload
from tether.result import ErrorCode, TaskError
from tether.worker.supervisor import ChildSlot

log = logging.getLogger("tether.worker.time_limits")


class TimeLimits:
    def __init__(
        self, limit_for: Callable[[str], float | None], running: Callable[[int], TaskPayload | None]
    ) -> None:
        """limit_for(name): a task name's limit in seconds; running(slot): the task a child runs."""
        self._limit_for = limit_for
        self._running = running
        self._timers: dict[ChildSlot, asyncio.TimerHandle] = {}

    def started(self, slot: ChildSlot, task: TaskPayload) -> None:
        """``task`` now runs in ``slot``: arm its limit, if it has one."""
        self.finished(slot)
        limit = self._limit_for(task.name)
        if limit is None:
            return
        self._timers[slot] = asyncio.get_running_loop().call_later(
            limit, self._expired, slot, task.id, task.attempt, limit
        )

    def finished(self, slot: ChildSlot) -> None:
        """The slot's task ended (or its child did): its limit no longer applies."""
        timer = self._timers.pop(slot, None)
        if timer is not None:
            timer.cancel()

    def _expired(self, slot: ChildSlot, task_id: str, attempt: int, limit: float) -> None:
        self._timers.pop(slot, None)
        task = self._running(slot.index)
        # Only the attempt the timer was armed for: never a later task of the same child.
        if task is None or task.id != task_id or task.attempt != attempt:
            return
        if not slot.process.is_alive():
            return  # it died by itself; the supervisor records that as a crash
        slot.killed_for = TaskError(
            ErrorCode.TIME_LIMIT_EXCEEDED,
            f"task {task.name!r} was still running after its time limit of {limit:g}s; "
            "its process was killed",
            {"time_limit_s": limit},
        )
        log.error(
            "task %s (%s) attempt %d exceeded its time limit of %gs: killing child %d (pid %s)",
            task.id,
            task.name,
            task.attempt,
            limit,
            slot.index,
            slot.pid,
        )
        slot.process.kill()  # the supervisor sees the exit and records slot.killed_for
