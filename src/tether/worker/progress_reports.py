"""Where a running task's progress reports go, in each kind of child (tether.progress.Reporter).

A sync child runs one task at a time: a report is written on the child's own connection
and the call waits for it (``WaitingReporter``). Nothing else of tether runs meanwhile in
that process, so the wait costs the task only; ``report_progress_async`` waits in a
thread, so an ``async def`` task's own coroutines go on.

An async child runs many tasks in one event loop, and a report is a database round trip
that may wait for long (a lost connection is retried for minutes; another session may
hold the task's row). So its reports never run on the loop: they go through the child's
``ProgressWriter``, a connection and a thread of their own. Not the connection of the
child's batch writes either, so a report that waits never holds up the starts and
outcomes of the other tasks. Per task (``TaskProgress``):

- ``report_progress_async`` waits for its report in the writer's thread;
- ``report_progress`` on the loop does not wait: it keeps the report as the task's next
  one to write (a newer report replaces one not yet written) and returns what the last
  report written said;
- ``report_progress`` from a thread of the task (``asyncio.to_thread``, or a sync task run
  in an async child) waits for its report in that thread.

The task's outcome is written only after its reports (``TaskProgress.flushed``): a report
written after the outcome would find the row no longer RUNNING.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tether.broker.claims import TaskPayload
from tether.broker.types import DatabaseError
from tether.log_fields import about_task
from tether.worker.recorder import Recorder

log = logging.getLogger("tether.worker.progress_reports")


class WaitingReporter:
    """A sync child's task: each report waits for its write."""

    def __init__(self, recorder: Recorder, task: TaskPayload) -> None:
        self.recorder = recorder
        self.task = task

    def report(self, progress: dict[str, Any]) -> bool:
        return self.recorder.report_progress(self.task, progress)

    async def report_async(self, progress: dict[str, Any]) -> bool:
        return await asyncio.to_thread(self.recorder.report_progress, self.task, progress)


class ProgressWriter:
    """An async child's progress reports: one connection and one thread, reports in order."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder  # its own connection, opened at the first report
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tether-progress-writer")

    def for_task(self, task: TaskPayload) -> TaskProgress:
        """The reporter of one task, made on the child's event loop as the task starts."""
        return TaskProgress(self, task, asyncio.get_running_loop())

    async def write(self, task: TaskPayload, progress: dict[str, Any]) -> bool:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self.recorder.report_progress, task, progress)

    def write_waiting(self, task: TaskPayload, progress: dict[str, Any]) -> bool:
        """From a thread other than the loop's: write and wait, behind the reports queued before."""
        return self._thread.submit(self.recorder.report_progress, task, progress).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)  # the reports under way are written first
        self.recorder.close()


class TaskProgress:
    """The reports of one task of an async child (a tether.progress.Reporter)."""

    def __init__(self, writer: ProgressWriter, task: TaskPayload, loop: asyncio.AbstractEventLoop) -> None:
        self.writer = writer
        self.task = task
        self.loop = loop
        self.still_ours = True  # what the last report written said
        self._next: dict[str, Any] | None = None  # made on the loop, not yet written
        self._writing: asyncio.Task[None] | None = None

    def report(self, progress: dict[str, Any]) -> bool:
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:  # no loop in this thread
            on_loop = False
        if not on_loop:
            self.still_ours = self.writer.write_waiting(self.task, progress)
            return self.still_ours
        self._next = progress  # replaces a report not yet written: only the latest matters
        if self._writing is None:
            self._writing = self.loop.create_task(self._write_next())
        return self.still_ours

    async def report_async(self, progress: dict[str, Any]) -> bool:
        self._next = None  # a report made without waiting and not yet written: this one is newer
        self.still_ours = await self.writer.write(self.task, progress)
        return self.still_ours

    async def _write_next(self) -> None:
        try:
            while self._next is not None:
                progress, self._next = self._next, None
                try:
                    self.still_ours = await self.writer.write(self.task, progress)
                except DatabaseError as exc:
                    # Nobody waits for this report to raise in: say it here. A later report
                    # (or the task's heartbeats) keeps the task from looking silent.
                    log.warning(
                        "task %s: could not store its progress: %s",
                        self.task.id,
                        exc,
                        extra=about_task(self.task),
                    )
        finally:
            self._writing = None

    async def flushed(self) -> None:
        """Until every report made without waiting is written (before the task's outcome)."""
        if self._writing is not None:
            await asyncio.shield(self._writing)
