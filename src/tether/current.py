"""current_task(): what the code of a running task can know about its own run.

The worker child sets it around each task it runs (a child runs one task at a time, so
a module global serves threads the task starts too). Integrations that wrap task
functions need it: the Django backend builds Django's TaskContext from it.
"""

from __future__ import annotations

import uuid
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


def current_task() -> RunningTask | None:
    """The task running in this process, or None outside a task run by a tether worker."""
    return _current


def set_current_task(task: RunningTask | None) -> None:
    global _current
    _current = task
