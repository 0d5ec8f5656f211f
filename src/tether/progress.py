"""report_progress() and report_progress_async(): a running task tells the world how far it got.

The progress is stored on the task row (``progress``, ``progress_at``) and
counts as a runner heartbeat, so a long task that reports progress is never
mistaken for a silent one.

Where a report goes is the business of the child process that runs the task: it sets a
``Reporter`` for the task's run (worker/progress_reports.py). This module checks the
arguments and finds that reporter.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Protocol


class Reporter(Protocol):
    """Where a running task's progress reports go (set by the child process running it)."""

    def report(self, progress: dict[str, Any]) -> bool:
        """Write a report from the task's code; see report_progress for what it returns."""
        ...

    async def report_async(self, progress: dict[str, Any]) -> bool:
        """Write a report and wait for it without blocking the event loop."""
        ...


# Set by a sync child while a task runs (it runs one task at a time, so a plain module
# global also works from threads the task starts); an async child sets the context
# variable inside each task's own asyncio task (see tether.current).
_reporter: Reporter | None = None
_reporter_in_context: ContextVar[Reporter | None] = ContextVar("tether_progress_reporter", default=None)


def report_progress(stage: str, progress: float | None = None, message: str | None = None) -> bool:
    """Record how far the current task got. ``progress`` is a fraction from 0.0 to 1.0.

    Returns False when the task is no longer this worker's (it was recovered
    elsewhere): the task may then stop early, its outcome will not be recorded.

    From an ``async def`` task in an async child (many tasks share its event loop), it
    does not wait for the database: the report is written in the background, in order,
    before the task's outcome, and the call returns at once what the last report written
    for this task said (True until one finds the task gone). Reports made faster than they
    are written are merged: the latest is written. ``await report_progress_async(...)``
    waits for its own report instead, without blocking the loop.
    """
    return _reporter_here().report(_checked(stage, progress, message))


async def report_progress_async(
    stage: str, progress: float | None = None, message: str | None = None
) -> bool:
    """``report_progress`` for ``async def`` tasks: the same arguments, checks and answer, and it
    waits for the report to be stored, while the event loop (and the other tasks of the
    process) goes on."""
    return await _reporter_here().report_async(_checked(stage, progress, message))


def _reporter_here() -> Reporter:
    reporter = _reporter_in_context.get() or _reporter
    if reporter is None:
        raise RuntimeError(
            "report_progress() can only be called from inside a task running in a tether worker"
        )
    return reporter


def _checked(stage: str, progress: float | None, message: str | None) -> dict[str, Any]:
    if not isinstance(stage, str) or not stage:
        raise ValueError(f"report_progress: stage must be a non-empty string, got {stage!r}")
    if progress is not None and (
        isinstance(progress, bool) or not isinstance(progress, int | float) or not 0.0 <= progress <= 1.0
    ):
        raise ValueError(f"report_progress: progress must be a number from 0.0 to 1.0, got {progress!r}")
    if message is not None and not isinstance(message, str):
        raise ValueError(f"report_progress: message must be a string, got {type(message).__name__}")
    return {"stage": stage, "progress": progress, "message": message}


def set_reporter(reporter: Reporter | None) -> None:
    global _reporter
    _reporter = reporter


def set_reporter_in_context(reporter: Reporter) -> None:
    _reporter_in_context.set(reporter)
