"""Running tasks whose cancel was requested: tell the task's process, and kill it if the
task's code goes on past its cancel grace period (docs/tasks.md#cancelling-a-running-task).

The worker hears of a request from its listener (``cancel <worker id> <task id>`` on
tether_control, within milliseconds) or, if that notification was missed, from its
next heartbeat's answer. It tells the child that holds the task: a sync child through
its slot of the supervisor's cancel board (the task's code reads
``current_task().cancel_requested``), an async child with a CANCEL message (it cancels
the task's coroutine). If the child still holds the task when the grace period ends
(the task's ``cancel_grace``, else the worker's ``cancel_grace_s``), the child is killed
(SIGKILL) and replaced; the supervisor records the task CANCELLED, and an async child's
other tasks as crashed (retried by their policy).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tether.log_fields import about_task
from tether.metrics import rules
from tether.result import ErrorCode, TaskError
from tether.worker.holdings import Holdings
from tether.worker.supervisor import ChildSlot, Supervisor

log = logging.getLogger("tether.worker.cancels")


class Cancels:
    def __init__(self, holdings: Holdings, supervisor: Supervisor, grace_for: Callable[[str], float]) -> None:
        """grace_for(name): how long a task of that name may go on after the request, in seconds."""
        self.holdings = holdings
        self.supervisor = supervisor
        self.grace_for = grace_for
        # One grace period per attempt (a task retried by hand later is a new attempt).
        self._timers: dict[tuple[str, int], asyncio.TimerHandle] = {}

    def request(self, task_id: str) -> None:
        """The cancel of ``task_id`` was requested: tell its child and arm the grace period.

        A repeated request (or the heartbeat's fallback) changes nothing: the child was
        told, and the first grace period stands. A task no child holds here any more has ended, or its
        child died and its crash is being recorded (the cancel rule applies there too).
        """
        index = self.holdings.child_holding(task_id)
        slot = self.supervisor.slots.get(index) if index is not None else None
        if slot is None:
            log.debug(
                "cancel of task %s requested, but no child of this worker holds it",
                task_id,
                extra={"task_id": task_id},
            )
            return
        task = next((t for t in self.holdings.of_child(slot.index) if t.id == task_id), None)
        if task is None:
            return
        if (task_id, task.attempt) in self._timers:
            return  # told already: telling again would cancel a coroutine's clean-up too
        self.supervisor.tell_cancel(slot, task_id)
        grace = self.grace_for(task.name)
        log.info(
            "task %s (%s) attempt %d: cancel requested; told %s child %d (pid %s), killing it in %gs "
            "if the task goes on",
            task.id,
            task.name,
            task.attempt,
            slot.kind,
            slot.index,
            slot.pid,
            grace,
            extra=about_task(task),
        )
        loop = asyncio.get_running_loop()
        self._timers[(task_id, task.attempt)] = loop.call_later(
            grace, self._grace_over, slot, task_id, task.attempt, grace
        )

    def _grace_over(self, slot: ChildSlot, task_id: str, attempt: int, grace: float) -> None:
        self._timers.pop((task_id, attempt), None)
        held = next((t for t in self.holdings.of_child(slot.index) if t.id == task_id), None)
        if (
            held is None
            or held.attempt != attempt
            or self.supervisor.slots.get(slot.index) is not slot
            or not slot.process.is_alive()
        ):
            return  # it stopped in time (or its child died by itself: that exit is recorded)
        slot.killed_for[task_id] = TaskError(
            ErrorCode.TASK_CANCELLED,
            f"cancelled while running; its code went on for {grace:g}s after the request and its "
            "process was killed",
            {"cancel_grace_s": grace},
        )
        slot.killed_as = rules.CANCELLED_WHILE_RUNNING
        if slot.kind == "async":
            slot.crash_reason = (
                f"its async child was killed because task {task_id} ({held.name}) did not stop within "
                f"{grace:g}s of its cancel request"
            )
        log.error(
            "task %s (%s) attempt %d did not stop within %gs of its cancel request: killing %s child %d "
            "(pid %s)",
            task_id,
            held.name,
            attempt,
            grace,
            slot.kind,
            slot.index,
            slot.pid,
            extra=about_task(held),
        )
        slot.process.kill()  # the supervisor sees the exit, records slot.killed_for, starts a new child
