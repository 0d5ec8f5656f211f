"""The overview of ``tether status`` and the dashboard: counts per queue and status, the active
workers, the RUNNING tasks gone silent, and (for the dashboard) the latest failures and the
periodic schedules."""

from __future__ import annotations

from dataclasses import dataclass

from tether.broker import counts, manual_recovery, schedules, tasks, workers
from tether.broker.broker import PostgresBroker
from tether.broker.counts import QueueCount
from tether.broker.recovery import StaleTask
from tether.broker.schedules import ScheduleInfo
from tether.broker.tasks import Failure
from tether.broker.workers import WorkerSummary


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    """What `tether status` and the dashboard show; ``dataclasses.asdict`` gives their JSON."""

    counts: list[QueueCount]  # finished ones (and long backlogs) estimated on a large table
    workers: list[WorkerSummary]
    stale_tasks: list[StaleTask]  # RUNNING, no runner heartbeat past the threshold
    running_stale_threshold_s: float
    recent_failures: list[Failure] | None  # None unless asked for
    schedules: list[ScheduleInfo] | None = None  # None unless asked for


def status_snapshot(
    broker: PostgresBroker,
    running_stale_threshold_ms: int,
    *,
    failures: int = 0,
    with_schedules: bool = False,
    exact: bool = False,
) -> StatusSnapshot:
    """What `tether status` shows (and the dashboard, with the latest ``failures`` failures
    and the schedules of periodic tasks). ``exact``: count every task (counts.py)."""
    return StatusSnapshot(
        counts=broker.run(lambda c: counts.queue_counts(c, exact=exact)),
        workers=broker.run(lambda c: workers.list_workers(c, include_inactive=False, limit=100)),
        stale_tasks=broker.run(lambda c: manual_recovery.stale_tasks(c, running_stale_threshold_ms)),
        running_stale_threshold_s=running_stale_threshold_ms / 1000,
        recent_failures=broker.run(lambda c: tasks.recent_failures(c, failures)) if failures else None,
        schedules=broker.run(schedules.list_schedules) if with_schedules else None,
    )
