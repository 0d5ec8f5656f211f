"""Where a running task's checkpointed steps are read and written, in each kind of child
(tether.steps.StepStore).

A sync child runs one task at a time: its steps go through the child's own connection
(``ChildSteps``), idle while the task's code runs; an ``async def`` task run there waits
for them in a thread, so its own coroutines go on.

An async child runs many tasks in one event loop: its steps go through a ``StepWriter``, a
connection and a thread of their own, as its progress reports do (worker/progress_reports.py)
and for the same reason: a step write that waits (a lost connection retried, a row held by
a recovery) never runs on the loop, and never holds up the batch writes of the other
tasks' starts and outcomes. Unlike a progress report, a step always waits for its write:
the code after a step may rely on it being stored. The writes are batched as the child's
outcomes are: the steps its tasks completed while the previous write was in flight go in
the next one, one statement and one commit (broker ``write_steps``), each row under its own
fence. A batch the database refuses as a whole is written again one step at a time, so
that only the step at fault fails (in its own task).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from tether.broker.claims import TaskPayload
from tether.broker.steps import StepKey
from tether.broker.suspensions import Taken
from tether.broker.types import DatabaseError, OperationalError
from tether.worker.recorder import Recorder

log = logging.getLogger("tether.worker.step_writes")

#: One step to write: (task, name, occurrence, result JSON) and the future its caller waits on.
_Pending = tuple[TaskPayload, str, int, str, "Future[str | None]"]


class ChildSteps:
    """The steps of a sync child's task, on the child's connection."""

    def __init__(self, recorder: Recorder, task: TaskPayload) -> None:
        self.recorder = recorder
        self.task = task

    def load(self) -> dict[StepKey, str]:
        return self.recorder.load_steps(self.task)

    def write(self, name: str, occurrence: int, result: str) -> str | None:
        return self.recorder.write_step(self.task, name, occurrence, result)

    async def load_async(self) -> dict[StepKey, str]:
        return await asyncio.to_thread(self.load)

    async def write_async(self, name: str, occurrence: int, result: str) -> str | None:
        return await asyncio.to_thread(self.write, name, occurrence, result)

    def take_event(self, occurrence: int, key: str) -> Taken:
        return self.recorder.take_event(self.task, occurrence, key)

    async def take_event_async(self, occurrence: int, key: str) -> Taken:
        return await asyncio.to_thread(self.take_event, occurrence, key)


class StepWriter:
    """An async child's step reads and writes: one connection (opened at the first step) and one
    thread; the writes waiting when the thread is free go together in one statement."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="tether-step-writer")
        self._lock = threading.Lock()
        self._waiting: list[_Pending] = []
        self._draining = False  # a drain is queued or running on the thread

    def for_task(self, task: TaskPayload) -> TaskSteps:
        return TaskSteps(self, task)

    def write(self, task: TaskPayload, name: str, occurrence: int, result: str) -> Future[str | None]:
        """Queue a step for the next batch; the future gives its answer (write_step's)."""
        answer: Future[str | None] = Future()
        with self._lock:
            self._waiting.append((task, name, occurrence, result, answer))
            start, self._draining = not self._draining, True
        if start:
            self.thread.submit(self._drain)
        return answer

    def _drain(self) -> None:
        while True:
            with self._lock:
                taken, self._waiting = self._waiting, []
                if not taken:
                    self._draining = False
                    return
            # From here an answer cannot be cancelled; a step whose task was cancelled while it
            # waited (a time limit) is dropped: it counts as interrupted, nothing is stored.
            batch = [pending for pending in taken if pending[4].set_running_or_notify_cancel()]
            if batch:
                self._write(batch)

    def _write(self, batch: list[_Pending]) -> None:
        try:
            answers = self.recorder.write_steps([(t, n, o, r) for t, n, o, r, _ in batch])
        except OperationalError as exc:  # the database stayed away past the recorder's retries
            for *_, answer in batch:
                answer.set_exception(exc)
            return
        except DatabaseError as exc:
            if len(batch) == 1:
                batch[0][4].set_exception(exc)
                return
            log.exception("writing %d steps failed; writing each step alone", len(batch))
            for pending in batch:
                self._write([pending])
            return
        for (*_, answer), stored in zip(batch, answers, strict=True):
            answer.set_result(stored)

    def close(self) -> None:
        self.thread.shutdown(wait=True)  # the steps under way are written first
        self.recorder.close()


class TaskSteps:
    """The steps of one task of an async child: from the loop (step_async) or from a thread of
    the task (a sync task, or asyncio.to_thread), which waits for its answer there."""

    def __init__(self, writer: StepWriter, task: TaskPayload) -> None:
        self.writer = writer
        self.task = task

    def load(self) -> dict[StepKey, str]:
        return self.writer.thread.submit(self.writer.recorder.load_steps, self.task).result()

    def write(self, name: str, occurrence: int, result: str) -> str | None:
        return self.writer.write(self.task, name, occurrence, result).result()

    async def load_async(self) -> dict[StepKey, str]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.writer.thread, self.writer.recorder.load_steps, self.task)

    async def write_async(self, name: str, occurrence: int, result: str) -> str | None:
        return await asyncio.wrap_future(self.writer.write(self.task, name, occurrence, result))

    def take_event(self, occurrence: int, key: str) -> Taken:
        return self.writer.thread.submit(self.writer.recorder.take_event, self.task, occurrence, key).result()

    async def take_event_async(self, occurrence: int, key: str) -> Taken:
        loop = asyncio.get_running_loop()
        recorder = self.writer.recorder
        return await loop.run_in_executor(self.writer.thread, recorder.take_event, self.task, occurrence, key)
