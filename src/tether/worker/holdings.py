"""Where each task this worker holds sits in its main process, from claim to recorded outcome.

A task is held from the claim that returned it until its outcome is recorded (or it
is given back, or found lost). Meanwhile it is in exactly one place:

- unhanded: claimed, waiting in the main process for a child;
- a child's current task: handed to that child as the one it runs next or now
  (``running`` once the child said it is RUNNING);
- a child's queue: pushed to a busy child ahead of time; it starts that task in the
  same statement that records its current one;
- an async child's tasks: handed to it, waiting there for a free slot, or running
  (once the child said it is RUNNING).

Unhanded tasks wait in one line per kind of child (lanes.py): a sync task waits for a
sync child, an async task for an async child.

A child's tasks are frozen while the worker isolates itself (its process is stopped).
Every other part of the worker asks and changes these places through this class only.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tether.broker.claims import TaskPayload
from tether.broker.heartbeats import Beat
from tether.log_fields import about_task
from tether.worker.lanes import Kind

log = logging.getLogger("tether.worker.holdings")


@dataclass
class _ChildTasks:
    current: TaskPayload | None = None
    running: bool = False  # current is RUNNING (the child said so)
    queued: deque[TaskPayload] = field(default_factory=deque)  # oldest first, none started
    frozen: bool = False


@dataclass
class _AsyncChildTasks:
    handed: dict[str, TaskPayload] = field(default_factory=dict)  # every task not yet done there
    running: set[str] = field(default_factory=set)  # the ids the child said are RUNNING
    frozen: bool = False


class Holdings:
    def __init__(self) -> None:
        self._unhanded: deque[TaskPayload] = deque()  # waiting for a sync child
        self._unhanded_async: deque[TaskPayload] = deque()  # waiting for an async child
        self._held: dict[str, TaskPayload] = {}
        self._held_async: set[str] = set()  # the held tasks that wait for or run in an async child
        self._children: dict[int, _ChildTasks] = {}
        self._async: dict[int, _AsyncChildTasks] = {}

    def __len__(self) -> int:
        """How many tasks are held, wherever they sit (the claim loop's capacity counts these)."""
        return len(self._held)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._held

    def get(self, task_id: str) -> TaskPayload | None:
        """The task held under ``task_id``, if it is."""
        return self._held.get(task_id)

    # -- claimed, not handed --------------------------------------------------------

    def take(self, task: TaskPayload, kind: Kind = "sync") -> bool:
        """Hold a task just claimed, unhanded. False if this very attempt is held already.

        That happens only after a database crash lost our claim (claims do not wait for
        the flush) and this worker claimed it again: the copy held is kept, since a
        second copy would fail its start and unbalance the count.
        """
        held = self._held.get(task.id)
        if held is not None and held.attempt == task.attempt:
            log.warning(
                "task %s attempt %d claimed again while held here; keeping one",
                task.id,
                task.attempt,
                extra=about_task(task),
            )
            return False
        self._held[task.id] = task
        if kind == "async":
            self._held_async.add(task.id)
            self._unhanded_async.append(task)
        else:
            self._unhanded.append(task)
        return True

    def held(self, kind: Kind) -> int:
        """How many of the tasks held are of the kind that ``kind`` children run."""
        return len(self._held_async) if kind == "async" else len(self._held) - len(self._held_async)

    def _drop(self, task_id: str) -> None:
        self._held.pop(task_id, None)
        self._held_async.discard(task_id)

    @property
    def unhanded(self) -> int:
        """Unhanded tasks waiting for a sync child (see unhanded_async)."""
        return len(self._unhanded)

    @property
    def unhanded_async(self) -> int:
        return len(self._unhanded_async)

    def unhanded_tasks(self) -> list[TaskPayload]:
        return list(self._unhanded) + list(self._unhanded_async)

    def next_unhanded(self) -> TaskPayload | None:
        return self._unhanded.popleft() if self._unhanded else None

    def next_unhanded_async(self, most: int) -> list[TaskPayload]:
        """Up to ``most`` unhanded async tasks, oldest first, taken out of the line."""
        line = self._unhanded_async
        return [line.popleft() for _ in range(min(most, len(line)))]

    def put_back(self, task: TaskPayload) -> None:
        """A task taken with next_unhanded could not be handed: first in line again."""
        self._unhanded.appendleft(task)

    def let_go_unhanded(self, queue: str | None = None) -> list[TaskPayload]:
        """Stop holding every unhanded task (of ``queue`` only, if given): they are given
        back, or dropped. Returns them."""
        tasks = []
        for line in (self._unhanded, self._unhanded_async):
            going = [t for t in line if queue is None or t.queue == queue]
            for task in going:
                line.remove(task)
                self._drop(task.id)
            tasks += going
        return tasks

    # -- handed to a child ----------------------------------------------------------

    def _child(self, slot: int) -> _ChildTasks:
        return self._children.setdefault(slot, _ChildTasks())

    def current(self, slot: int) -> TaskPayload | None:
        """The task handed to child ``slot`` as the one it runs (starting, running or finishing)."""
        child = self._children.get(slot)
        return child.current if child is not None else None

    def running(self, slot: int) -> TaskPayload | None:
        """Child ``slot``'s task if the child said it is RUNNING, else None."""
        child = self._children.get(slot)
        return child.current if child is not None and child.running else None

    def queued(self, slot: int) -> int:
        child = self._children.get(slot)
        return len(child.queued) if child is not None else 0

    def of_child(self, slot: int) -> list[TaskPayload]:
        """Every task handed to child ``slot``: its current one, then its queue (an async
        child's: all it holds)."""
        if (tasks := self._async.get(slot)) is not None:
            return list(tasks.handed.values())
        child = self._children.get(slot)
        if child is None:
            return []
        return ([child.current] if child.current is not None else []) + list(child.queued)

    def hand(self, slot: int, task: TaskPayload) -> None:
        """``task`` (from next_unhanded) is now child ``slot``'s current task."""
        child = self._child(slot)
        assert child.current is None, f"child {slot} already has a task"
        child.current, child.running = task, False

    def unhand(self, slot: int) -> TaskPayload | None:
        """Undo hand(): the child never got the task; it is first in line again."""
        child = self._child(slot)
        task, child.current = child.current, None
        if task is not None:
            self._unhanded.appendleft(task)
        return task

    def push(self, slot: int, task: TaskPayload) -> None:
        """``task`` (from next_unhanded) waits in child ``slot``'s queue."""
        self._child(slot).queued.append(task)

    def started(self, slot: int) -> TaskPayload | None:
        """The child said its current task is RUNNING; returns that task."""
        child = self._child(slot)
        child.running = child.current is not None
        return child.current

    def start_lost(self, slot: int) -> None:
        """The child could not start its current task: the claim was gone (cancelled before it
        ran, or recovered elsewhere). Not held any more.

        The child then reads the next RUN in its pipe, if any was pushed, as a fresh task
        (as after a DONE with nothing started): that task is its current one now. Left in
        the queue, it would make the main process take the child's later NEXT as answered
        by a RUN the child has already read, and the two would wait for each other.
        """
        child = self._child(slot)
        if child.current is not None:
            self._drop(child.current.id)
        child.current, child.running = None, False
        if child.queued:
            child.current = child.queued.popleft()

    def finished(self, slot: int, task_id: str, next_started: bool | None) -> TaskPayload | None:
        """The child recorded its task's outcome (or found it lost); returns what runs there now.

        next_started: None when the child started nothing with it; else whether it
        started the oldest task of its queue in the same statement (False: lost).
        """
        self._drop(task_id)
        child = self._child(slot)
        child.current, child.running = None, False
        if next_started is not None and child.queued:
            taken = child.queued.popleft()
            if next_started:
                child.current, child.running = taken, True
            else:
                self._drop(taken.id)
        if child.current is None and child.queued:
            # The child has nothing running and reads the next RUN in its pipe as a fresh
            # task, reporting STARTED for it.
            child.current = child.queued.popleft()
        return child.current if child.running else None

    def child_holding(self, task_id: str) -> int | None:
        """The slot of the child that was handed ``task_id`` (queued, current or running), or None."""
        for slot, tasks in self._async.items():
            if task_id in tasks.handed:
                return slot
        for slot, child in self._children.items():
            if (child.current is not None and child.current.id == task_id) or any(
                t.id == task_id for t in child.queued
            ):
                return slot
        return None

    def running_in(self, slot: int) -> list[TaskPayload]:
        """The tasks child ``slot`` said are RUNNING."""
        if (tasks := self._async.get(slot)) is not None:
            return [tasks.handed[i] for i in tasks.running]
        task = self.running(slot)
        return [task] if task is not None else []

    def child_gone(self, slot: int) -> list[TaskPayload]:
        """Child ``slot`` exited: its tasks stay held until recorded (see forget)."""
        tasks = self.of_child(slot)
        self._children.pop(slot, None)
        self._async.pop(slot, None)
        return tasks

    # -- handed to an async child --------------------------------------------------------

    def _async_child(self, slot: int) -> _AsyncChildTasks:
        return self._async.setdefault(slot, _AsyncChildTasks())

    def handed_count(self, slot: int) -> int:
        """How many tasks async child ``slot`` holds (waiting there, running or finishing)."""
        tasks = self._async.get(slot)
        return len(tasks.handed) if tasks is not None else 0

    def hand_many(self, slot: int, tasks: list[TaskPayload]) -> None:
        """``tasks`` (from next_unhanded_async) are now async child ``slot``'s."""
        handed = self._async_child(slot).handed
        for task in tasks:
            handed[task.id] = task

    def started_many(self, slot: int, task_ids: list[str]) -> list[TaskPayload]:
        """Async child ``slot`` said these are RUNNING; returns those tasks."""
        child = self._async_child(slot)
        started = [child.handed[i] for i in task_ids if i in child.handed]
        child.running.update(t.id for t in started)
        return started

    def ended_many(self, slot: int, task_ids: list[str]) -> None:
        """Async child ``slot`` is done with these (recorded, lost or given back): not held any more."""
        child = self._async_child(slot)
        for task_id in task_ids:
            child.handed.pop(task_id, None)
            child.running.discard(task_id)
            self._drop(task_id)

    def forget(self, task_id: str, attempt: int | None = None) -> None:
        """The task's fate is recorded (or it was given back): not held any more.

        ``attempt``: only that attempt. A task given back (released to PENDING) in a thread
        can be claimed again by this worker before the event loop gets here: that newer
        claim stays held, or it would run unaccounted for (no DONE to match, a wrong count
        of held tasks).
        """
        held = self._held.get(task_id)
        if held is not None and (attempt is None or held.attempt == attempt):
            self._drop(task_id)

    # -- isolation ------------------------------------------------------------------

    def freeze(self, slot: int) -> None:
        if slot in self._async:
            self._async[slot].frozen = True
        else:
            self._child(slot).frozen = True

    def frozen(self, slot: int) -> bool:
        child = self._async.get(slot) or self._children.get(slot)
        return child is not None and child.frozen

    def thaw(self, slot: int) -> None:
        if slot in self._async:
            self._async[slot].frozen = False
        else:
            self._child(slot).frozen = False

    # -- what the database says -----------------------------------------------------

    def lose(self, lost: set[str]) -> list[str]:
        """Tasks the database says are no longer ours: unhanded ones are dropped at once;
        returns the ids of those that children hold (their writes will be fenced off)."""
        for line in (self._unhanded, self._unhanded_async):
            for task in [t for t in line if t.id in lost]:
                line.remove(task)
                self._drop(task.id)
        return [task_id for task_id in lost if task_id in self._held]

    def beat(self, main_pid: int, children: Iterable[int], runner_pid: Callable[[int], int | None]) -> Beat:
        """What the heartbeat reports: every task held, as 'claimer' or 'runner'.

        runner_pid(slot): the child's pid when its runner heartbeat may be relayed (it
        stamped its slot in time, or it is frozen), else None.
        """
        beat = Beat()
        for task in self._unhanded:
            beat.add(task.id, "claimer", main_pid)
        for task in self._unhanded_async:
            beat.add(task.id, "claimer", main_pid)
        for slot in children:
            if (tasks := self._async.get(slot)) is not None:
                pid = runner_pid(slot) if tasks.running else None
                for task in tasks.handed.values():
                    if task.id not in tasks.running:
                        beat.add(task.id, "claimer", main_pid)
                    elif pid is not None:
                        beat.add(task.id, "runner", pid)
                continue
            child = self._children.get(slot)
            if child is None:
                continue
            if child.current is not None:
                if not child.running:
                    beat.add(child.current.id, "claimer", main_pid)
                elif (pid := runner_pid(slot)) is not None:
                    # A frozen child's task is reported too: the answer ('lost' or not)
                    # decides whether it is resumed or killed, right after this beat.
                    beat.add(child.current.id, "runner", pid)
            for task in child.queued:
                beat.add(task.id, "claimer", main_pid)
        return beat
