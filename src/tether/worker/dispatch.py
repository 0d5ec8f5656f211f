"""Handing claimed tasks to the children, and following what the children say and do.

The main process never runs a task's code: it hands each claimed task to a child
(RUN), learns that the child started it (STARTED), hands it the next one when asked
(NEXT) or ahead of time, and learns that its outcome is recorded (DONE). An async child
is handed tasks in batches (RUN_MANY) up to its concurrency and its share of prefetch,
and says what it started and recorded in one message per batch write (BATCH). A child
that exits holding tasks has them all recorded as crashed (or released, if they never
started) by the recorder in one statement, and a replacement child is started.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tether import tracing
from tether.broker.claims import TaskPayload
from tether.broker.types import DatabaseError
from tether.log_fields import about_task, about_tasks
from tether.metrics import hooks, rules
from tether.result import ErrorCode, TaskError
from tether.worker import protocol
from tether.worker.holdings import Holdings
from tether.worker.lanes import Lanes
from tether.worker.recorder import Recorder
from tether.worker.supervisor import ChildSlot, Supervisor
from tether.worker.task_set import TaskSet
from tether.worker.time_limits import TimeLimits

log = logging.getLogger("tether.worker.dispatch")

# Tasks handed to a busy child ahead of time (see hand_out).
PUSH_AHEAD = 2
# A dead child's log line names this many task ids per outcome, and counts the others.
IDS_PER_OUTCOME = 10


def outcomes_of(held: list[TaskPayload], verdicts: dict[str, str]) -> str:
    """What became of a dead child's tasks, grouped by outcome: "2 FAILED with WORKER_CRASHED:
    <id>, <id>; 30 retry scheduled after WORKER_CRASHED: <ten ids> and 20 more"."""
    groups: dict[str, list[str]] = {}
    for task in held:
        groups.setdefault(verdicts[task.id], []).append(task.id)
    parts = []
    for verdict, ids in groups.items():
        more = len(ids) - IDS_PER_OUTCOME
        named = ", ".join(ids[:IDS_PER_OUTCOME]) + (f" and {more} more" if more > 0 else "")
        parts.append(f"{len(ids)} {verdict}: {named}")
    return "; ".join(parts)


# The verdicts of record_crashes (and _record_crash) under which no row was recovered here.
_NOT_RECOVERED = ("released", "already settled", "could not be recorded")


def recovery_rules(
    held: list[TaskPayload], verdicts: dict[str, str], killed_for: dict[str, TaskError], killed_as: str | None
) -> list[tuple[TaskPayload, str]]:
    """Each started task of a dead child whose row the recording settled, and the rule that
    applied: the worker's kill for it (time limit, ignored cancel), the kill of its child (hung,
    or a neighbour's time limit or cancel in an async child), or the child's own death."""
    found = []
    for task in held:
        if verdicts[task.id].startswith(_NOT_RECOVERED):
            continue
        error = killed_for.get(task.id)
        if error is None:
            rule = killed_as or rules.DEAD_CHILD
        elif error.code == ErrorCode.TIME_LIMIT_EXCEEDED:
            rule = rules.TIME_LIMIT
        else:
            rule = rules.CANCELLED_WHILE_RUNNING
        found.append((task, rule))
    return found


class Dispatcher:
    def __init__(
        self,
        *,
        lanes: Lanes,
        holdings: Holdings,
        time_limits: TimeLimits,
        recorder: Recorder,
        supervisor: Supervisor,
        on_change: Callable[[], None],
        stopping: asyncio.Event,
        traced: bool = False,
    ) -> None:
        self.lanes = lanes
        self.traced = traced  # a recovery of a dead child's task is a span in its trace (tether.tracing)
        self.holdings = holdings
        self.time_limits = time_limits
        self.recorder = recorder
        self.supervisor = supervisor  # no child before its start(): then there is nothing to do
        self.on_change = on_change  # a slot may have freed up: the claim loop looks again
        self._stopping = stopping  # the worker is stopping: hand out nothing more
        self.tasks_done = 0
        self.no_children = asyncio.Event()
        self.recording = TaskSet("recording a dead child's tasks")

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def idle(self, slot: ChildSlot) -> bool:
        return slot.ready and slot.kind == "sync" and self.holdings.current(slot.index) is None

    def hand_out(self) -> None:
        """Give unhanded tasks to idle children, then push the next ones to busy children."""
        if self.holdings.unhanded_async and not self.stopping:
            self._hand_out_async()
        sup, held = self.supervisor, self.holdings
        sync_children = [slot for slot in sup.alive() if slot.kind == "sync"]
        for slot in sync_children:
            if not held.unhanded or self.stopping:
                return
            if self.idle(slot):
                task = held.next_unhanded()
                assert task is not None
                held.hand(slot.index, task)
                if not sup.send(slot, protocol.RUN, task=task):
                    held.unhand(slot.index)
        # Every child is busy and work is waiting: hand each busy child its next tasks
        # now (PUSH_AHEAD of them, one round of children at a time), so it need not ask
        # and wait for them. With two, the next-but-one is already in the child's pipe
        # when it finishes a short task: the main process's answer is off the child's
        # path. They wait behind the child's current task: that is what prefetch means
        # (--prefetch 0 for long or uneven tasks).
        children = sync_children
        if len(children) < self.lanes.sync_processes or any(
            not s.ready or held.current(s.index) is None for s in children
        ):
            return  # a child is starting, restarting or free: it will take the work itself
        for depth in range(1, PUSH_AHEAD + 1):
            for slot in children:
                if not held.unhanded or self.stopping:
                    return
                if held.queued(slot.index) < depth:
                    task = held.next_unhanded()
                    assert task is not None
                    if sup.send(slot, protocol.RUN, task=task):
                        held.push(slot.index, task)
                    else:
                        held.put_back(task)

    def _hand_out_async(self) -> None:
        """Top every ready async child up to what it may hold, in one message each."""
        held, limit = self.holdings, self.lanes.async_per_child
        for slot in self.supervisor.alive():
            if slot.kind != "async" or not slot.ready or not held.unhanded_async:
                continue
            tasks = held.next_unhanded_async(limit - held.handed_count(slot.index))
            if tasks:
                held.hand_many(slot.index, tasks)
                self.supervisor.send(slot, protocol.RUN_MANY, tasks=tasks)

    def stop_idle_children(self) -> None:
        """Graceful stop: children with nothing to do exit now; busy ones after their task.
        An async child gives back what it has not started and exits once its tasks end."""
        for slot in self.supervisor.alive():
            if self.idle(slot) or (slot.kind == "async" and slot.ready):
                self.supervisor.send(slot, protocol.STOP)

    # -- what the children say ---------------------------------------------------------

    def on_message(self, slot: ChildSlot, msg: dict[str, Any]) -> None:
        held, op = self.holdings, msg["op"]
        if op == protocol.READY:
            slot.ready = True
            if self.stopping:
                self.supervisor.send(slot, protocol.STOP)
        elif op == protocol.STARTED:
            if msg["lost"]:
                held.start_lost(slot.index)
            elif (task := held.started(slot.index)) is not None:
                self.time_limits.started(slot, task)
        elif op == protocol.BATCH:
            self._on_batch(slot, msg)
        elif op == protocol.NEXT:
            self._answer_next(slot)
        elif op == protocol.DONE:
            self.tasks_done += 1
            hooks.finished(held.get(msg["id"]), msg["status"], msg.get("code"), msg.get("run_s"))
            self.time_limits.finished(slot)
            self.supervisor.clear_cancel(slot.index, msg["id"])
            next_started = None if msg["next_id"] is None else not msg["next_lost"]
            running = held.finished(slot.index, msg["id"], next_started)
            if running is not None:
                self.time_limits.started(slot, running)
            if self.stopping and held.current(slot.index) is None:
                self.supervisor.send(slot, protocol.STOP)
        self.hand_out()
        self.on_change()

    def _on_batch(self, slot: ChildSlot, msg: dict[str, Any]) -> None:
        """An async child wrote a batch: what it started, recorded, lost or gave back."""
        held = self.holdings
        for task in held.started_many(slot.index, msg["started"]):
            self.time_limits.started(slot, task)
        hooks.finished_many(held.get, msg["done"], msg.get("ran"))
        ended = [task_id for task_id, _ in msg["done"]] + msg["lost"] + msg["released"]
        for task_id in ended:
            self.time_limits.finished(slot, task_id)
        held.ended_many(slot.index, ended)
        self.tasks_done += len(msg["done"])

    def _answer_next(self, slot: ChildSlot) -> None:
        if self.holdings.queued(slot.index):
            return  # a RUN pushed to this child already answers its question
        if self.stopping:
            self.supervisor.send(slot, protocol.STOP)
        elif (task := self.holdings.next_unhanded()) is not None:
            self.holdings.push(slot.index, task)
            self.supervisor.send(slot, protocol.RUN, task=task)
        else:
            self.supervisor.send(slot, protocol.NONE)

    # -- what the children do -----------------------------------------------------------

    def on_exit(self, slot: ChildSlot, code: int | None) -> None:
        self.time_limits.finished(slot)
        held = self.holdings.child_gone(slot.index)
        if held or not self.stopping:
            log.error(
                "child %d (pid %s) exited with code %s holding %d task(s)",
                slot.index,
                slot.pid,
                code,
                len(held),
                extra=about_tasks(held),
            )
        if held:
            how = slot.crash_reason or "the worker process running this task died"
            who = f"{slot.kind} child {slot.index} (pid {slot.pid})"
            self.recording.start(self._record_crash(who, held, slot.killed_for, how, slot.killed_as))
        if not self.stopping:
            self.supervisor.spawn(slot.index)
        elif not self.supervisor.alive():
            self.no_children.set()

    async def _record_crash(
        self,
        who: str,
        held: list[TaskPayload],
        killed_for: dict[str, TaskError],
        how: str,
        killed_as: str | None = None,
    ) -> None:
        """Every task a dead child held, in one statement: started ones failed or retried, others released.

        One WARNING for the death, whatever the count (an async child may hold hundreds):
        how many tasks ended which way, with their ids up to IDS_PER_OUTCOME; each task
        alone at DEBUG. Its attempt row says the same, task by task.
        """
        try:
            verdicts = await asyncio.to_thread(self.recorder.record_crashes, held, killed_for, how)
        except DatabaseError as exc:
            # The database stayed away longer than the recorder retries: the reaper
            # (here or elsewhere) recovers the tasks by their heartbeats instead.
            verdict = f"could not be recorded ({exc}); the reaper will recover it when it turns stale"
            verdicts = {task.id: verdict for task in held}
        # Always, metrics or not: the dashboard's chart of recoveries tallies them too
        # (metrics/recovery_tally.py).
        for task, rule in recovery_rules(held, verdicts, killed_for, killed_as):
            hooks.recovered(rule)
            if self.traced:
                tracing.recovered(task, rule, verdicts[task.id])
        for task in held:
            self.holdings.forget(task.id, task.attempt)
            log.debug(
                "task %s (%s) attempt %d: %s",
                task.id,
                task.name,
                task.attempt,
                verdicts[task.id],
                extra=about_task(task),
            )
        log.warning(
            "the %d task(s) of dead %s: %s",
            len(held),
            who,
            outcomes_of(held, verdicts),
            extra=about_tasks(held),
        )
        self.on_change()

    async def kill_children(self) -> None:
        """Kill every child still alive and wait until their tasks are recorded."""
        if self.supervisor.alive():
            self.supervisor.kill_all()
            await self.no_children.wait()
        # A killed child's tasks are being recorded (crashed or released): let that finish.
        await self.recording.wait()
