"""Entry point of an async child process: many ``async def`` tasks at once in one event loop.

The child keeps every promise a sync child keeps, per task: it starts each task with a
fenced write before any of its code runs, and records each outcome itself (rule 4). What
changes is that writes are batched: whatever became ready while the previous write was
in flight (outcomes of tasks that ended, starts of tasks waiting for a free slot) goes
in the next write, one statement and one commit (broker ``write_batch``), each row still
under its own fence. So at 100 tasks in flight a commit carries tens of tasks, not one.

The event loop itself stamps the child's heartbeat slot. A task that blocks the loop
(``time.sleep``, CPU-bound work, sync I/O) stops the stamps for every task of the child;
past the hang threshold the worker's main process kills the child and records all its
tasks, as for a hung sync child. A late stamp is logged as soon as the loop runs again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from tether import tracing
from tether.broker.claims import OutcomeWrite, TaskPayload
from tether.broker.types import DatabaseError
from tether.current import set_cancel_probe, set_current_task_in_context
from tether.log_fields import about_tasks
from tether.log_setup import LogSetup
from tether.progress import set_reporter_in_context
from tether.result import TaskStatus
from tether.worker import protocol
from tether.worker.child import ParentGuard, begin_child, running_task
from tether.worker.execute import Executor, internal_failure
from tether.worker.heap import freeze_start_up
from tether.worker.progress_reports import ProgressWriter
from tether.worker.recorder import Recorder
from tether.worker.step_writes import StepWriter

log = logging.getLogger("tether.worker.async_child")

STAMP_EVERY_S = 0.5  # the loop stamps its heartbeat slot this often
LATE_STAMP_WARNING_S = 1.0  # a stamp this late means a task blocked the loop: say so


def async_child_main(
    conn: Connection,
    app_path: str,
    url: str,
    worker_id: str,
    parent_pid: int,
    log_setup: LogSetup,
    stamps: Any,
    index: int,
    concurrency: int,
) -> None:
    guard, app = begin_child("async child", parent_pid, log_setup, app_path, worker_id)
    recorder = Recorder(url, worker_id, app.config, role="child")
    # Progress reports on a connection of their own: a report that waits (a lost
    # connection, a row held by another session) holds up no start or outcome.
    progress = ProgressWriter(Recorder(url, worker_id, app.config, role="child-progress"))
    # Steps on a connection of their own too (worker/step_writes.py), opened at the first step.
    steps = StepWriter(Recorder(url, worker_id, app.config, role="child-steps"))
    child = AsyncChild(conn, Executor(app), recorder, progress, guard, stamps, index, concurrency, steps)
    freeze_start_up()  # as a sync child (heap.py)
    try:
        asyncio.run(child.serve())
    finally:
        steps.close()
        progress.close()
        recorder.close()


class AsyncChild:
    def __init__(
        self,
        conn: Connection,
        executor: Executor,
        recorder: Recorder,
        progress: ProgressWriter,
        guard: ParentGuard,
        stamps: Any,
        index: int,
        concurrency: int,
        steps: StepWriter,
    ) -> None:
        self.conn = conn
        self.steps = steps
        self.executor = executor
        self.recorder = recorder
        self.progress = progress
        self.guard = guard
        self.stamps = stamps
        self.index = index
        self.concurrency = concurrency
        self.waiting: deque[TaskPayload] = deque()  # handed to us, not started
        self.running: dict[str, asyncio.Task[None]] = {}  # started, code running
        # Tasks whose cancel was requested (CANCEL messages): RunningTask.cancel_requested
        # reads this, from the loop or from a sync task's thread.
        self.cancel_requested: set[str] = set()
        self.running_names: dict[str, str] = {}  # the task name of each running task
        self.ran_s: dict[str, float] = {}  # seconds each finished task's code ran, until told
        set_cancel_probe(self.cancel_requested.__contains__)
        self.finished: list[OutcomeWrite] = []  # code ended, outcome not yet written
        self.stopping = False
        self.parent_gone = False
        self._wake = asyncio.Event()
        # The writes run in one thread of their own: the loop goes on running tasks
        # meanwhile, and what ends during a write waits for the next one.
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="tether-batch-writer")
        # Messages to the main process go through a thread too: a big one may wait for the
        # main process to read, and the loop must go on reading what the main process
        # sends meanwhile (both waiting on each other's full pipe would be a deadlock).
        self._outbox = ThreadPoolExecutor(1, thread_name_prefix="tether-to-main")
        self._has_message = protocol.message_waiting(conn)
        self._stamp_due = 0.0

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        if self.executor.traced:
            # Before any run starts: each run's asyncio task inherits this context, in which an
            # unsampled run's send is current without a span or attach of its own.
            tracing.follow_runs()
        loop.add_reader(self.conn.fileno(), self._read)
        self._stamp()
        self._send(protocol.READY)
        try:
            await self._write_loop()
        finally:
            if not self.parent_gone:
                loop.remove_reader(self.conn.fileno())
            self._writes.shutdown(wait=True)
            self._outbox.shutdown(wait=True)  # the last batch reaches the main process before we exit

    def _send(self, op: str, **fields: Any) -> None:
        def send() -> None:
            try:
                protocol.send(self.conn, op, **fields)
            except (OSError, ValueError) as exc:
                log.warning("could not tell the worker's main process %r: %s", op, exc)

        self._outbox.submit(send)

    # -- what the main process says ---------------------------------------------------

    def _read(self) -> None:
        try:
            while self._has_message():
                msg = protocol.recv(self.conn)
                if msg["op"] == protocol.RUN_MANY:
                    self.waiting.extend(msg["tasks"])
                elif msg["op"] == protocol.CANCEL:
                    self._cancel(msg["id"])
                elif msg["op"] == protocol.STOP:
                    self.stopping = True
        except (EOFError, OSError) as exc:
            # The main process is gone (PR_SET_PDEATHSIG kills us unless a write is in
            # flight): finish that write, then stop.
            log.warning("lost the worker's main process (%s)", exc)
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.parent_gone = True
        self._wake.set()

    def _cancel(self, task_id: str) -> None:
        """A task's cancel was requested: cancel its coroutine. A sync task running in a thread
        cannot be interrupted: it is told through current_task().cancel_requested only, and the
        worker kills this child if it goes on past the grace period."""
        running = self.running.get(task_id)
        if running is None:
            return  # it ended meanwhile (or never started here: a cancel before the start wins)
        self.cancel_requested.add(task_id)
        found = self.executor.app.find_task(self.running_names[task_id])
        if found is not None and found.is_async:
            # Soon, not now: a task created in this turn of the loop has not run its first
            # step, and a cancel then would skip _run's body (and its outcome) entirely.
            asyncio.get_running_loop().call_soon(running.cancel)

    # -- the heartbeat slot -------------------------------------------------------------

    def _stamp(self) -> None:
        now = time.monotonic()
        late = now - self._stamp_due if self._stamp_due else 0.0
        if late > LATE_STAMP_WARNING_S:
            log.warning(
                "the event loop was blocked for %.1fs with %d task(s) running: a task ran blocking "
                "code (time.sleep, CPU-bound work, sync I/O); run such code as a sync task or in "
                "asyncio.to_thread",
                late,
                len(self.running),
            )
        self.stamps[self.index] = now
        self._stamp_due = now + STAMP_EVERY_S
        asyncio.get_running_loop().call_later(STAMP_EVERY_S, self._stamp)

    # -- running tasks ------------------------------------------------------------------

    async def _run(self, payload: TaskPayload) -> None:
        # Each asyncio task has its own context: these are seen by this task's code only.
        set_current_task_in_context(
            running_task(payload, self.recorder.worker_id, self.steps.for_task(payload))
        )
        progress = self.progress.for_task(payload)
        set_reporter_in_context(progress)
        began = time.monotonic()
        try:
            outcome = await self.executor.run_async(payload)
            # The reports it made without waiting are written before its outcome ends the
            # RUNNING row they are written to.
            await progress.flushed()
        except asyncio.CancelledError:
            raise  # the child is going away: its supervisor (or a reaper) records the task
        except Exception as exc:  # a bug of ours must not pass as the task's crash
            outcome = internal_failure(payload, exc)
        del self.running[payload.id]
        del self.running_names[payload.id]
        self.cancel_requested.discard(payload.id)
        self.finished.append(OutcomeWrite(payload, outcome))
        self.ran_s[payload.id] = time.monotonic() - began
        self._wake.set()

    # -- writing ------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            outcomes, self.finished = self.finished, []
            starts: list[TaskPayload] = []
            releases: list[TaskPayload] = []
            if self.stopping or self.parent_gone:
                releases, self.waiting = list(self.waiting), deque()
            else:
                free = self.concurrency - len(self.running)
                while self.waiting and len(starts) < free:
                    starts.append(self.waiting.popleft())
            if (outcomes or starts or releases) and not await self._write(outcomes, starts, releases):
                return
            if (self.stopping or self.parent_gone) and not self.running and not self.finished:
                return

    async def _write(
        self, outcomes: list[OutcomeWrite], starts: list[TaskPayload], releases: list[TaskPayload]
    ) -> bool:
        """One batch: outcomes and starts in one statement, then tell the main process. False: stop."""
        loop = asyncio.get_running_loop()
        # The outcomes are worth more than the supervisor: dying with it now would turn
        # finished tasks into crashes, so the death signal is off for the write's duration.
        self.guard.disarm()
        try:
            recorded, started = await loop.run_in_executor(
                self._writes, self.recorder.write_batch, outcomes, starts
            )
            if releases:
                released = await loop.run_in_executor(self._writes, self.recorder.release, releases)
                log.info(
                    "gave back %d task(s) that never started",
                    len(released),
                    extra=about_tasks([t for t in releases if t.id in released]),
                )
        except DatabaseError as exc:
            # The database stayed away longer than the recorder retries: these tasks stay as
            # they are and the reaper recovers them when their heartbeats go stale.
            log.error(
                "could not write %d outcome(s) and %d start(s) (%s); the reaper will recover them",
                len(outcomes),
                len(starts),
                exc,
                extra=about_tasks([w.task for w in outcomes] + starts),
            )
            recorded, started = {}, set()
        if not self.guard.parent_alive():
            log.warning(
                "%d outcome(s) recorded after the worker's main process died; exiting",
                len(recorded),
                extra=about_tasks([w.task for w in outcomes if w.task.id in recorded]),
            )
            given_back = [t for t in starts if t.id in started]  # started here, none of their code ran
            for task in given_back:
                await loop.run_in_executor(self._writes, self.recorder.unstart, task)
            self.parent_gone = True
            return False
        self.guard.arm()
        for task in starts:
            if task.id in started:
                self.running[task.id] = loop.create_task(self._run(task), name=f"tether-task-{task.id}")
                self.running_names[task.id] = task.name
        self._tell(outcomes, starts, recorded, started, releases)
        return True

    def _tell(
        self,
        outcomes: list[OutcomeWrite],
        starts: list[TaskPayload],
        recorded: dict[str, TaskStatus],
        started: set[str],
        releases: list[TaskPayload],
    ) -> None:
        self._send(
            protocol.BATCH,
            started=[t.id for t in starts if t.id in started],
            lost=[t.id for t in starts if t.id not in started],
            done=[[w.task.id, _reported(w, recorded.get(w.task.id))] for w in outcomes],
            released=[t.id for t in releases],
            # For the worker's metrics (tether.metrics): the main process counts for its children.
            ran=[[w.outcome.error_code, self.ran_s.pop(w.task.id, None)] for w in outcomes],
        )


def _reported(write: OutcomeWrite, settled: TaskStatus | None) -> str:
    """The status a BATCH reports for one outcome (metrics: SUSPENDED, LOST: its fence missed)."""
    if settled is None:
        return "LOST"
    return "SUSPENDED" if settled is TaskStatus.PENDING and write.outcome.suspension else settled
