"""Which kind of child runs which task, and how many of each a worker starts.

A worker has two kinds of child process (docs/workers.md#the-executor-model):

- sync children run one task at a time each, in the process's main thread, as every
  task ran before the async executor: CPU-bound and blocking code belongs there;
- async children run up to ``async_concurrency`` ``async def`` tasks at once each, in one
  event loop, with their starts and outcomes written in batches.

An ``async def`` task runs in an async child and any other task in a sync child. A worker
started without children of one kind runs that kind in the other: an async task alone in
a sync child (its own event loop, one at a time), a sync task in a thread of an async
child (``asyncio.to_thread``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from tether.app import Tether
from tether.config import PREFETCH_PER_PROCESS, WorkerConfig
from tether.errors import InvalidOptionError

Kind = Literal["sync", "async"]


@dataclass(frozen=True, slots=True)
class Lanes:
    sync_processes: int
    async_processes: int
    async_concurrency: int
    sync_prefetch: int  # claimed sync tasks held beyond the running ones, for the whole worker
    async_prefetch: int  # the same for async tasks

    @property
    def processes(self) -> int:
        return self.sync_processes + self.async_processes

    @property
    def capacity(self) -> int:
        """How many tasks the worker holds at most, claimed or running, of both kinds."""
        return self.sync_capacity + self.async_capacity

    @property
    def sync_capacity(self) -> int:
        return self.sync_processes + self.sync_prefetch if self.sync_processes else 0

    @property
    def async_capacity(self) -> int:
        return self.async_per_child * self.async_processes

    @property
    def both(self) -> bool:
        """The worker has children of both kinds (its claims then keep to each kind's room)."""
        return bool(self.sync_processes and self.async_processes)

    @property
    def async_per_child(self) -> int:
        """Tasks one async child is handed at most: its concurrency and its share of prefetch."""
        if not self.async_processes:
            return 0
        share = -(-self.async_prefetch // self.async_processes)  # rounded up
        return self.async_concurrency + share

    def kind_of(self, is_async: bool) -> Kind:
        """The kind of child a task runs in: its own kind, or the other when the worker has none."""
        if is_async:
            return "async" if self.async_processes else "sync"
        return "sync" if self.sync_processes else "async"


def plan_lanes(config: WorkerConfig, app: Tether) -> Lanes:
    """The children a worker starts for ``app``: what ``config`` says, else what the app's tasks need."""
    kinds = {task.is_async for task in app.tasks.values()}
    sync = config.processes
    if sync is None:
        sync = min(os.cpu_count() or 1, 256) if (False in kinds or not kinds) else 0
    asynchronous = config.async_processes
    if asynchronous is None:
        asynchronous = 1 if True in kinds else 0
    if sync == 0 and asynchronous == 0:
        # Only possible with processes=0 and an app without async tasks.
        raise InvalidOptionError(
            "processes is 0 and the app has no async task, so no async child either: "
            "give processes >= 1 or async_processes >= 1"
        )
    if config.prefetch is None:
        sync_prefetch = PREFETCH_PER_PROCESS * sync
        async_prefetch = config.async_concurrency * asynchronous
    else:
        sync_prefetch = async_prefetch = config.prefetch
    return Lanes(sync, asynchronous, config.async_concurrency, sync_prefetch, async_prefetch)
