"""report_progress(): a running task tells the world how far it got.

The progress is stored on the task row (``progress``, ``progress_at``) and
counts as a runner heartbeat, so a long task that reports progress is never
mistaken for a silent one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

Reporter = Callable[[dict[str, Any]], bool]

# Set by a sync child while a task runs (it runs one task at a time, so a plain module
# global also works from threads the task starts); an async child sets the context
# variable inside each task's own asyncio task (see tether.current).
_reporter: Reporter | None = None
_reporter_in_context: ContextVar[Reporter | None] = ContextVar("tether_progress_reporter", default=None)


def report_progress(stage: str, progress: float | None = None, message: str | None = None) -> bool:
    """Record how far the current task got. ``progress`` is a fraction from 0.0 to 1.0.

    Returns False when the task is no longer this worker's (it was recovered
    elsewhere): the task may then stop early, its outcome will not be recorded.
    """
    reporter = _reporter_in_context.get() or _reporter
    if reporter is None:
        raise RuntimeError(
            "report_progress() can only be called from inside a task running in a tether worker"
        )
    if not isinstance(stage, str) or not stage:
        raise ValueError(f"report_progress: stage must be a non-empty string, got {stage!r}")
    if progress is not None and (
        isinstance(progress, bool) or not isinstance(progress, int | float) or not 0.0 <= progress <= 1.0
    ):
        raise ValueError(f"report_progress: progress must be a number from 0.0 to 1.0, got {progress!r}")
    if message is not None and not isinstance(message, str):
        raise ValueError(f"report_progress: message must be a string, got {type(message).__name__}")
    return reporter({"stage": stage, "progress": progress, "message": message})


def set_reporter(reporter: Reporter | None) -> None:
    global _reporter
    _reporter = reporter


def set_reporter_in_context(reporter: Reporter) -> None:
    _reporter_in_context.set(reporter)
