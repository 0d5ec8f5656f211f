"""The worker's child processes: spawning them, reading their messages, seeing them die.

A child's death is seen at once through its process sentinel (no polling, no
staleness threshold): the worker then records the task the child held and
starts a replacement.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from tether.result import TaskError
from tether.worker import protocol
from tether.worker.child import child_main
from tether.worker.protocol import TaskPayload

log = logging.getLogger("tether.worker.supervisor")

# spawn, not fork: the main process holds an event loop, threads and open sockets
# that a forked child must not inherit.
_CTX = multiprocessing.get_context("spawn")


@dataclass(eq=False)
class ChildSlot:
    index: int
    process: BaseProcess
    conn: Connection
    ready: bool = False
    running: bool = False  # current is RUNNING (the child said STARTED)
    frozen: bool = False  # SIGSTOPped by the worker's self-fencing
    current: TaskPayload | None = None  # sent to the child: starting, running or finishing
    # Sent to the child ahead of time, oldest first, not started yet: the child starts the
    # oldest in the same commit that records its current task's outcome.
    queued: deque[TaskPayload] = field(default_factory=deque)
    killed_for: TaskError | None = None  # why the worker killed this child (its time limit)
    has_message: Callable[[], bool] = field(init=False)

    def __post_init__(self) -> None:
        self.has_message = protocol.message_waiting(self.conn)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def idle(self) -> bool:
        return self.ready and self.current is None

    def held(self) -> list[TaskPayload]:
        return ([self.current] if self.current is not None else []) + list(self.queued)


OnMessage = Callable[[ChildSlot, dict[str, Any]], None]
OnExit = Callable[[ChildSlot, int | None], None]


class Supervisor:
    def __init__(
        self,
        *,
        processes: int,
        app_path: str,
        url: str,
        worker_id: str,
        log_level: int,
        on_message: OnMessage,
        on_exit: OnExit,
    ) -> None:
        self.processes = processes
        self.app_path = app_path
        self.url = url
        self.worker_id = worker_id
        self.log_level = log_level
        self.on_message = on_message
        self.on_exit = on_exit
        self.slots: dict[int, ChildSlot] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # One monotonic timestamp per slot, written by the child's heartbeat thread.
        # CLOCK_MONOTONIC is shared by all processes of the machine.
        self.stamps = _CTX.Array("d", processes, lock=False)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for index in range(self.processes):
            self.spawn(index)

    def spawn(self, index: int) -> ChildSlot:
        assert self._loop is not None
        parent_end, child_end = _CTX.Pipe(duplex=True)
        process = _CTX.Process(
            target=child_main,
            args=(
                child_end,
                self.app_path,
                self.url,
                self.worker_id,
                os.getpid(),
                self.log_level,
                self.stamps,
                index,
            ),
            name=f"tether-child-{index}",
            daemon=True,
        )
        self.stamps[index] = time.monotonic()  # a new child is fresh until it proves otherwise
        process.start()
        child_end.close()
        slot = ChildSlot(index, process, parent_end)
        self.slots[index] = slot
        self._loop.add_reader(parent_end.fileno(), self._readable, slot)
        self._loop.add_reader(process.sentinel, self._exited, slot)
        log.debug("started child %d (pid %s)", index, process.pid)
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
        slot.conn.close()
        if self.slots.get(slot.index) is slot:
            del self.slots[slot.index]
        self.on_exit(slot, code)

    def send(self, slot: ChildSlot, op: str, **fields: Any) -> bool:
        try:
            protocol.send(slot.conn, op, **fields)
            return True
        except (OSError, ValueError) as exc:
            log.warning("could not write to child %d (pid %s): %s", slot.index, slot.pid, exc)
            return False

    def stamp_age(self, slot: ChildSlot) -> float:
        """Seconds since the child's heartbeat thread last stamped its slot."""
        return time.monotonic() - float(self.stamps[slot.index])

    def alive(self) -> list[ChildSlot]:
        return list(self.slots.values())

    def kill_all(self) -> None:
        for slot in self.alive():
            if slot.process.is_alive():
                slot.process.kill()
