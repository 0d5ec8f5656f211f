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
the code after a step may rely on it being stored.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from tether.broker.claims import TaskPayload
from tether.broker.steps import StepKey
from tether.worker.recorder import Recorder


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


class StepWriter:
    """An async child's step reads and writes: one connection (opened at the first step) and one thread."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="tether-step-writer")

    def for_task(self, task: TaskPayload) -> TaskSteps:
        return TaskSteps(self, task)

    def close(self) -> None:
        self.thread.shutdown(wait=True)  # a step under way is written first
        self.recorder.close()


class TaskSteps:
    """The steps of one task of an async child: from the loop (step_async) or from a thread of
    the task (a sync task, or asyncio.to_thread), which waits for its turn."""

    def __init__(self, writer: StepWriter, task: TaskPayload) -> None:
        self.writer = writer
        self.task = task

    def load(self) -> dict[StepKey, str]:
        return self.writer.thread.submit(self.writer.recorder.load_steps, self.task).result()

    def write(self, name: str, occurrence: int, result: str) -> str | None:
        recorder = self.writer.recorder
        return self.writer.thread.submit(recorder.write_step, self.task, name, occurrence, result).result()

    async def load_async(self) -> dict[StepKey, str]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.writer.thread, self.writer.recorder.load_steps, self.task)

    async def write_async(self, name: str, occurrence: int, result: str) -> str | None:
        loop = asyncio.get_running_loop()
        recorder = self.writer.recorder
        return await loop.run_in_executor(
            self.writer.thread, recorder.write_step, self.task, name, occurrence, result
        )
