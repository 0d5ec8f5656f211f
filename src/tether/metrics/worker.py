"""A worker's metrics: one registry in its main process, counting for all its children.

The children say what they did in the messages they already send (an outcome's error code
and run time ride on DONE and BATCH); the main process counts claims, heartbeats and
recoveries itself. So the counts of a worker are those of all its processes, with no
file per process to clean up and nothing lost when a child is killed: what a killed child
never said, its crash recording counts (docs/monitoring.md#children).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from tether.broker.claims import TaskPayload
from tether.broker.recovery import Recovered
from tether.metrics import rules
from tether.metrics.labels import Labels

# Seconds. Queue wait and run time span milliseconds (no-op tasks, an idle queue) to an hour.
TASK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
# Round trips of one statement: claim, heartbeat.
DB_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# How a DONE/BATCH status becomes the outcome label.
OUTCOMES = {
    "COMPLETED": "completed",
    "FAILED": "failed",
    "CANCELLED": "cancelled",
    "PENDING": "retried",
    "LOST": "lost",  # its fence matched nothing: the task was recovered or cancelled elsewhere
}


class WorkerMetrics:
    """The metrics a worker's main process keeps, and the hooks (tether.metrics.hooks.Sink)."""

    def __init__(self, labels: Labels, in_flight: Callable[[], float], children: Callable[[], float]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = labels
        reg = self.registry
        self.tasks_finished = Counter(
            "tether_tasks_finished",
            "Task executions whose outcome this worker recorded, by outcome (completed, failed, "
            "cancelled, retried, lost) and error code ('' for none).",
            ["queue", "task", "outcome", "code"],
            registry=reg,
        )
        self.queue_wait = Histogram(
            "tether_task_queue_wait_seconds",
            "From the moment a task became due (its run_at) to its claim, by the database's clock.",
            ["queue"],
            buckets=TASK_BUCKETS,
            registry=reg,
        )
        self.run_time = Histogram(
            "tether_task_run_seconds",
            "How long a task's code ran in its child (until its outcome was ready to record).",
            ["queue", "task"],
            buckets=TASK_BUCKETS,
            registry=reg,
        )
        self.claim_time = Histogram(
            "tether_claim_seconds", "Round trip of one claim statement.", buckets=DB_BUCKETS, registry=reg
        )
        self.claims_empty = Counter(
            "tether_claims_empty", "Claim statements that returned no task.", registry=reg
        )
        self.claims_failed = Counter(
            "tether_claims_failed", "Claim statements that failed (database unreachable).", registry=reg
        )
        self.tasks_claimed = Counter(
            "tether_tasks_claimed", "Tasks this worker claimed.", ["queue"], registry=reg
        )
        self.heartbeat_time = Histogram(
            "tether_heartbeat_write_seconds",
            "Round trip of the worker's heartbeat statement.",
            buckets=DB_BUCKETS,
            registry=reg,
        )
        self.heartbeat_failures = Counter(
            "tether_heartbeat_failures", "Heartbeat writes that failed or timed out.", registry=reg
        )
        self.recoveries = Counter(
            "tether_recoveries",
            "Tasks recovered by each rule (docs/monitoring.md#recoveries), as the rows say.",
            ["rule"],
            registry=reg,
        )
        self.workers_deactivated = Counter(
            "tether_workers_deactivated",
            "Workers this worker's reaper marked inactive (heartbeat stale).",
            registry=reg,
        )
        Gauge(
            "tether_worker_tasks_in_flight",
            "Tasks this worker holds now, claimed or running.",
            registry=reg,
        ).set_function(in_flight)
        Gauge("tether_worker_children", "Child processes alive now.", registry=reg).set_function(children)
        for rule in rules.RULES:  # every series from the start: increase() sees the first one
            self.recoveries.labels(rule)
        for metric in (
            self.claims_empty,
            self.claims_failed,
            self.heartbeat_failures,
            self.workers_deactivated,
        ):
            metric.inc(0)
        # The labelled children of the hot path, looked up once per label set.
        self._finished: dict[tuple[str, str, str, str], Counter] = {}
        self._runs: dict[tuple[str, str], Histogram] = {}
        self._waits: dict[str, tuple[Histogram, Counter]] = {}

    # -- tether.metrics.hooks.Sink ------------------------------------------------------

    def finished(self, task: TaskPayload, status: str, code: str | None, run_s: float | None) -> None:
        outcome = OUTCOMES.get(status, "lost")
        key = (task.queue, task.name, outcome, code or "")
        counter = self._finished.get(key)
        if counter is None:
            labels = self.labels
            counter = self._finished[key] = _child(
                self.tasks_finished, task.queue, labels.task(task.name), outcome, labels.code(code)
            )
        counter.inc()
        if run_s is not None:
            run = self._runs.get((task.queue, task.name))
            if run is None:
                run = self._runs[(task.queue, task.name)] = _child(
                    self.run_time, task.queue, self.labels.task(task.name)
                )
            run.observe(run_s)

    def claimed(self, tasks: list[TaskPayload], seconds: float) -> None:
        self.claim_time.observe(seconds)
        if not tasks:
            self.claims_empty.inc()
        for task in tasks:
            found = self._waits.get(task.queue)
            if found is None:
                found = self._waits[task.queue] = (
                    _child(self.queue_wait, task.queue),
                    _child(self.tasks_claimed, task.queue),
                )
            found[1].inc()
            if task.waited_s is not None:
                found[0].observe(max(0.0, task.waited_s))

    def claim_failed(self) -> None:
        self.claims_failed.inc()

    def heartbeat(self, seconds: float | None) -> None:
        if seconds is None:
            self.heartbeat_failures.inc()
        else:
            self.heartbeat_time.observe(seconds)

    def recovered(self, rule: str, n: int) -> None:
        self.recoveries.labels(rule).inc(n)

    def reaper_pass(self, done: Recovered) -> None:
        self.recovered(rules.EXPIRED, done.expired)
        self.recovered(rules.STALE_CLAIMED_REQUEUED, len(done.requeued))
        self.recovered(rules.STALE_RUNNING_RETRIED, len(done.retried))
        self.recovered(rules.STALE_RUNNING_FAILED, len(done.failed))
        self.recovered(rules.WORKFLOW_STEP_RECONCILED, done.workflow_steps)
        if done.deactivated:
            self.workers_deactivated.inc(len(done.deactivated))


M = TypeVar("M", bound=MetricWrapperBase)


def _child(metric: M, *values: str) -> M:
    return metric.labels(*values)
