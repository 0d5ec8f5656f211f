"""The worker's child processes: spawning them, reading their messages, seeing them die.

A child's death is seen at once through its process sentinel (no polling, no
staleness threshold): the worker then records the task the child held and
starts a replacement.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from tether.broker.claims import TaskPayload
from tether.config import LogFormat
from tether.log_fields import about_tasks
from tether.log_setup import LogSetup
from tether.metrics import rules
from tether.result import TaskError
from tether.worker import protocol
from tether.worker.async_child import async_child_main
from tether.worker.child import child_main
from tether.worker.lanes import Kind, Lanes
from tether.worker.pipe_writer import PipeWriter
from tether.worker.start_method import ChildContext, child_context

log = logging.getLogger("tether.worker.supervisor")


@dataclass(eq=False)
class ChildSlot:
    """One child process: its kind, its pipe and whether it is ready. The tasks it holds are in Holdings."""

    index: int
    kind: Kind
    process: BaseProcess
    conn: Connection
    ready: bool = False
    # Why the worker killed this child: the error of each task it was killed for (a time
    # limit), and what to tell of its other tasks (a hang, a neighbour's time limit). Both
    # empty: it died by itself.
    killed_for: dict[str, TaskError] = field(default_factory=dict)
    crash_reason: str | None = None
    # The recovery rule (tether.metrics.rules) of the worker's kill, for the tasks it recorded
    # as crashed that killed_for does not name; None: it died by itself (dead_child).
    killed_as: str | None = None
    has_message: Callable[[], bool] = field(init=False)
    # What the main process sends the child: a message can outgrow the pipe's buffer while
    # the child is busy (big arguments), so it is never written blocking (pipe_writer.py).
    writer: PipeWriter = field(init=False)

    def __post_init__(self) -> None:
        self.has_message = protocol.message_waiting(self.conn)
        self.writer = PipeWriter(self.conn, f"{self.kind} child {self.index}")

    @property
    def pid(self) -> int | None:
        return self.process.pid


OnMessage = Callable[[ChildSlot, dict[str, Any]], None]
OnExit = Callable[[ChildSlot, int | None], None]


class Supervisor:
    def __init__(
        self,
        *,
        lanes: Lanes,
        app_path: str,
        url: str,
        worker_id: str,
        log_level: int,
        on_message: OnMessage,
        on_exit: OnExit,
        log_format: LogFormat = "human",
        context: ChildContext | None = None,
    ) -> None:
        # Never a plain fork of the main process: it holds an event loop, threads and open
        # sockets that a forked child must not inherit (tether.worker.start_method).
        self._ctx = context or child_context("spawn", app_path)
        self.lanes = lanes
        self.processes = lanes.processes
        self.app_path = app_path
        self.url = url
        self.worker_id = worker_id
        self.log_level = log_level
        self.log_format = log_format  # children write their lines as the main process does
        self.on_message = on_message
        self.on_exit = on_exit
        self.slots: dict[int, ChildSlot] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # One monotonic timestamp per slot, written by the child's heartbeat thread.
        # CLOCK_MONOTONIC is shared by all processes of the machine.
        self.stamps = self._ctx.Array("d", lanes.processes, lock=False)
        # The cancel board: per slot, the 16 bytes of the id of the task whose cancel was
        # requested. A sync child's task code reads its slot (RunningTask.cancel_requested)
        # without a message: the child's one thread is busy running that code.
        self.cancels = self._ctx.Array("B", protocol.CANCEL_ID_BYTES * lanes.processes, lock=False)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for index in range(self.processes):
            self.spawn(index)

    async def start_async(self) -> None:
        """start(), each child made off the event loop: with a fork server, the first start
        waits until the server has imported tether and the app (a few hundred ms at worst),
        and each fork is tens of ms on a busy machine, which must not hold up the loop's other
        start-up work (the worker connects, registers and listens meanwhile)."""
        self._loop = asyncio.get_running_loop()
        for index in range(self.processes):
            self._started(await asyncio.to_thread(self._make, index))

    def kind_of(self, index: int) -> Kind:
        """Slots 0..sync_processes-1 hold sync children, the rest async ones."""
        return "sync" if index < self.lanes.sync_processes else "async"

    def spawn(self, index: int) -> ChildSlot:
        return self._started(self._make(index))

    def _make(self, index: int) -> ChildSlot:
        """Start child ``index``'s process (any thread); _started() then follows it (the loop's)."""
        parent_end, child_end = self._ctx.Pipe(duplex=True)
        kind = self.kind_of(index)
        args: tuple[Any, ...] = (
            child_end,
            self.app_path,
            self.url,
            self.worker_id,
            os.getpid(),
            LogSetup(self.log_level, self.log_format),
            self.stamps,
            index,
        )
        if kind == "async":
            target: Callable[..., None] = async_child_main
            args += (self.lanes.async_concurrency,)
        else:
            target = child_main
            args += (self.cancels,)
            self.post_cancel(index, None)  # a replacement child starts with a clean slot
        name = f"tether-{kind}-child-{index}"
        process = self._ctx.Process(target=target, args=args, name=name, daemon=True)
        self.stamps[index] = time.monotonic()  # a new child is fresh until it proves otherwise
        process.start()
        child_end.close()
        return ChildSlot(index, kind, process, parent_end)

    def _started(self, slot: ChildSlot) -> ChildSlot:
        assert self._loop is not None
        index, process, parent_end, kind = slot.index, slot.process, slot.conn, slot.kind
        self.slots[index] = slot
        self._loop.add_reader(parent_end.fileno(), self._readable, slot)
        self._loop.add_reader(process.sentinel, self._exited, slot)
        log.debug("started %s child %d (pid %s)", kind, index, process.pid)
        return slot

    def _readable(self, slot: ChildSlot) -> None:
        try:
            while slot.has_message():
                msg = protocol.recv(slot.conn)
                self.on_message(slot, msg)
        except (EOFError, OSError):
            # The pipe closed: the child is gone; the sentinel callback handles it.
            assert self._loop is not None
            self._loop.remove_reader(slot.conn.fileno())

    def _exited(self, slot: ChildSlot) -> None:
        assert self._loop is not None
        self._loop.remove_reader(slot.process.sentinel)
        try:
            # Messages the child wrote before dying still count (e.g. a DONE).
            self._readable(slot)
            self._loop.remove_reader(slot.conn.fileno())
        except (ValueError, OSError):
            pass
        slot.process.join(timeout=1)
        code = slot.process.exitcode
        slot.writer.close()
        slot.conn.close()
        if self.slots.get(slot.index) is slot:
            del self.slots[slot.index]
        self.on_exit(slot, code)

    def send(self, slot: ChildSlot, op: str, **fields: Any) -> bool:
        """Send a message to a child without waiting for it to read (pipe_writer.py). False: the
        child is gone and the message will not arrive (its exit is seen and handled)."""
        return slot.writer.write(protocol.framed(op, **fields))

    def post_cancel(self, index: int, task_id: str | None) -> None:
        """Write the task whose cancel was requested on sync slot ``index``'s cancel board (None: clear)."""
        size = protocol.CANCEL_ID_BYTES
        self.cancels[index * size : (index + 1) * size] = (
            uuid.UUID(task_id).bytes if task_id is not None else bytes(size)
        )

    def clear_cancel(self, index: int, task_id: str) -> None:
        """Sync slot ``index``'s task ``task_id`` ended: clear the board if it names that task, so
        a later run of the same task (retried by hand) on this slot is not taken for cancelled.
        A request already written for the slot's next task is left alone."""
        size = protocol.CANCEL_ID_BYTES
        if bytes(self.cancels[index * size : (index + 1) * size]) == uuid.UUID(task_id).bytes:
            self.post_cancel(index, None)

    def tell_cancel(self, slot: ChildSlot, task_id: str) -> None:
        """Tell a child that the cancel of ``task_id`` was requested: a sync child through its
        cancel board, an async child with a CANCEL message (it cancels the coroutine)."""
        if slot.kind == "async":
            self.send(slot, protocol.CANCEL, id=task_id)
        else:
            self.post_cancel(slot.index, task_id)

    def stamp_age(self, slot: ChildSlot) -> float:
        """Seconds since the child's heartbeat thread last stamped its slot."""
        return time.monotonic() - float(self.stamps[slot.index])

    def alive(self) -> list[ChildSlot]:
        return list(self.slots.values())

    def kill_hung(self, limit_s: float, running: Callable[[int], list[TaskPayload]]) -> None:
        """Kill every child running tasks whose heartbeat has not been stamped for ``limit_s``.

        A sync child is then hung (or a C call holds the GIL); an async child's event loop is
        blocked (a task ran blocking code). ``running(slot)``: its running tasks, none when
        it runs nothing or is frozen on purpose. The exit is then seen and recorded like any
        other crash.
        """
        for slot in self.alive():
            tasks = running(slot.index)
            if not tasks or not slot.process.is_alive():
                continue
            age = self.stamp_age(slot)
            if age > limit_s:
                if slot.kind == "async":
                    slot.crash_reason = (
                        f"its async child's event loop was blocked for {age:.0f}s (a task ran blocking "
                        "code: time.sleep, CPU-bound work or sync I/O); the child was killed"
                    )
                else:
                    slot.crash_reason = (
                        f"its process stopped its heartbeat for {age:.0f}s (hung) and was killed"
                    )
                slot.killed_as = rules.HUNG_CHILD
                log.error(
                    "%s child %d (pid %s) running %d task(s) (%s) has not stamped its heartbeat for %.1fs "
                    "(%s): killing it",
                    slot.kind,
                    slot.index,
                    slot.pid,
                    len(tasks),
                    ", ".join(f"{t.id} ({t.name})" for t in tasks[:5]),
                    age,
                    "its event loop is blocked" if slot.kind == "async" else "hung, or the GIL is held",
                    extra=about_tasks(tasks),
                )
                slot.process.kill()

    def kill_all(self) -> None:
        for slot in self.alive():
            if slot.process.is_alive():
                slot.process.kill()
