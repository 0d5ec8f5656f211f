"""Short asyncio tasks the main process starts and does not await on the spot.

A pause's give-back, a dead child's crash records: each is started from a callback that
cannot wait, and must still be finished before the worker closes its connections. A
``TaskSet`` holds each such task from its start until it is done, and no longer: a
worker that runs for months and is paused ten thousand times holds only what is in
flight. ``wait()`` at close waits for those. A failure is logged when the task ends,
not left for the garbage collector to report.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("tether.worker.task_set")


class TaskSet:
    def __init__(self, what: str) -> None:
        self.what = what  # for the log: what these tasks do
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("%s failed: %s: %s", self.what, type(exc).__name__, exc, exc_info=exc)

    def __len__(self) -> int:
        """How many are still running."""
        return len(self._tasks)

    async def wait(self) -> None:
        """Until every task started here has ended, those started meanwhile included."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
            # A task's done callback (``_done``, which lets it go) is scheduled, not run, when
            # it ends; gather over tasks already done may return without yielding (Python
            # 3.13), so yield once here, or this loop would spin and never see them let go.
            await asyncio.sleep(0)
