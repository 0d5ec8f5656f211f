"""current_task(): what the code of a running task can know about its own run.

A sync child sets a module global around each task it runs (it runs one task at a time,
so threads the task starts see it too). An async child runs many tasks at once in one
event loop: each sets a context variable in its own asyncio task, which asyncio.to_thread
carries over to the threads it runs. Integrations that wrap task
functions need it: the Django backend builds Django's TaskContext from it.
"""

from __future__ import annotations

import uuid
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunningTask:
    """The task this process is running, as its worker claimed it."""

    id: uuid.UUID
    name: str
    queue: str
    attempt: int  # the claim's fencing token: every claim increments it, so it can have gaps
    retry_count: int  # retries so far: 0 on the first run
    worker_id: str  # the worker holding the claim (tether_workers.id)


_current: RunningTask | None = None
_current_in_context: ContextVar[RunningTask | None] = ContextVar("tether_current_task", default=None)


def current_task() -> RunningTask | None:
    """The task running here (this asyncio task, or this process), or None outside a task
    run by a tether worker."""
    return _current_in_context.get() or _current


def set_current_task(task: RunningTask | None) -> None:
    """For the one task a sync child runs (process-wide)."""
    global _current
    _current = task


def set_current_task_in_context(task: RunningTask) -> None:
    """For one task of an async child: set inside that task's own asyncio task."""
    _current_in_context.set(task)
