"""A worker's metrics: one registry in its main process, counting for all its children.

The children say what they did in the messages they already send (an outcome's error code
and run time ride on DONE and BATCH); the main process counts claims, heartbeats and
recoveries itself. So the counts of a worker are those of all its processes, with no
file per process to clean up and nothing lost when a child is killed: what a killed child
never said, its crash recording counts (docs/monitoring.md#children).

The hot path counts in plain dicts and lists, on the event loop's thread, with no lock and
no prometheus_client object: a finished task costs a dict lookup, an increment and a
bisect. The collector turns them into metric families when a scrape asks, on the HTTP
server's thread, from copies (dict.copy and list copies are single operations under the
GIL). prometheus_client's own Counter and Histogram take a lock per call and were 7 % of
an async child's no-op throughput (bench/observability.py).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

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
    "SUSPENDED": "suspended",  # a durable sleep or a wait for an event (docs/durable-steps.md)
    "LOST": "lost",  # its fence matched nothing: the task was recovered or cancelled elsewhere
}


# The label values of tether_tasks_finished: queue, task, outcome, code.
Key = tuple[str, str, str, str]


class Hist:
    """One histogram's bucket counts (not cumulative; the last one is +Inf) and sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def exposed(self) -> tuple[list[tuple[str, float]], float]:
        """Cumulative buckets as prometheus_client wants them, and the sum."""
        counts, total = list(self.counts), self.total
        buckets, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(running)))
        return buckets, total


class WorkerMetrics(Collector):
    """The metrics a worker's main process keeps, and the hooks (tether.metrics.hooks.Sink)."""

    def __init__(self, labels: Labels, in_flight: Callable[[], float], children: Callable[[], float]) -> None:
        self.labels = labels
        self.in_flight = in_flight
        self.children = children
        # (queue, name, status, code) as reported -> its label values and its run-time
        # histogram, looked up once: a finished task then costs one lookup of each.
        self._finished_labels: dict[tuple[str, str, str, str | None], tuple[Key, Hist]] = {}
        self.finished_counts: dict[tuple[str, str, str, str], int] = {}
        self.run_times: dict[tuple[str, str], Hist] = {}
        self.waits: dict[str, Hist] = {}
        self.claimed_counts: dict[str, int] = {}
        self.claim_time = Hist(DB_BUCKETS)
        self.heartbeat_time = Hist(DB_BUCKETS)
        self.claims_empty = 0
        self.claims_failed = 0
        self.heartbeat_failures = 0
        self.workers_deactivated = 0
        # Every rule from the start: increase() needs the series before its first move.
        self.recoveries: dict[str, int] = dict.fromkeys(rules.RULES, 0)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- tether.metrics.hooks.Sink (the event loop's thread) -----------------------------

    def finished(self, task: TaskPayload, status: str, code: str | None, run_s: float | None) -> None:
        key, run = self._finished_labels.get((task.queue, task.name, status, code)) or self._label(
            task, status, code
        )
        counts = self.finished_counts
        counts[key] = counts.get(key, 0) + 1
        if run_s is not None:
            run.counts[bisect_left(run.bounds, run_s)] += 1
            run.total += run_s

    def finished_many(
        self,
        held: Callable[[str], TaskPayload | None],
        done: list[list[Any]],
        ran: list[list[Any]] | None,
    ) -> None:
        # finished() for each entry of an async child's BATCH, in one loop with everything
        # bound to locals: this is the main process's hot path, once per task (about half the
        # cost of a call per task, bench/README.md "Issue 24, item 7").
        labels, counts, label = self._finished_labels, self.finished_counts, self._label
        for (task_id, status), (code, run_s) in zip(done, ran or [[None, None]] * len(done), strict=True):
            task = held(task_id)
            if task is None:
                continue
            key, run = labels.get((task.queue, task.name, status, code)) or label(task, status, code)
            counts[key] = counts.get(key, 0) + 1
            if run_s is not None:
                run.counts[bisect_left(run.bounds, run_s)] += 1
                run.total += run_s

    def _label(self, task: TaskPayload, status: str, code: str | None) -> tuple[Key, Hist]:
        """The label values of a (queue, name, status, code) seen the first time, and its run
        histogram (one per queue and task label, shared by every outcome)."""
        key = (task.queue, self.labels.task(task.name), OUTCOMES.get(status, "lost"), self.labels.code(code))
        run = self.run_times.get(key[:2])
        if run is None:
            run = self.run_times[key[:2]] = Hist(TASK_BUCKETS)
        found = self._finished_labels[(task.queue, task.name, status, code)] = (key, run)
        return found

    def claimed(self, tasks: list[TaskPayload], seconds: float) -> None:
        self.claim_time.observe(seconds)
        if not tasks:
            self.claims_empty += 1
            return
        counts, waits = self.claimed_counts, self.waits
        for task in tasks:
            queue, waited = task.queue, task.waited_s
            counts[queue] = counts.get(queue, 0) + 1
            if waited is not None:
                wait = waits.get(queue)
                if wait is None:
                    wait = waits[queue] = Hist(TASK_BUCKETS)
                # Hist.observe, inlined: once per claimed task.
                if waited < 0:
                    waited = 0.0
                wait.counts[bisect_left(wait.bounds, waited)] += 1
                wait.total += waited

    def claim_failed(self) -> None:
        self.claims_failed += 1

    def heartbeat(self, seconds: float | None) -> None:
        if seconds is None:
            self.heartbeat_failures += 1
        else:
            self.heartbeat_time.observe(seconds)

    def recovered(self, rule: str, n: int) -> None:
        self.recoveries[rule] = self.recoveries.get(rule, 0) + n

    def reaper_pass(self, done: Recovered) -> None:
        for rule, n in rules.of_pass(done):
            self.recovered(rule, n)
        self.workers_deactivated += len(done.deactivated)

    # -- the scrape (the HTTP server's thread) ------------------------------------------------

    def describe(self) -> list[CounterMetricFamily]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        finished = CounterMetricFamily(
            "tether_tasks_finished",
            "Task executions whose outcome this worker recorded, by outcome (completed, failed, "
            "cancelled, retried, lost) and error code ('' for none).",
            labels=["queue", "task", "outcome", "code"],
        )
        for key, n in self.finished_counts.copy().items():
            finished.add_metric(list(key), n)
        yield finished
        yield _histograms(
            "tether_task_queue_wait_seconds",
            "From the moment a task became due (its run_at) to its claim, by the database's clock.",
            ["queue"],
            [((queue,), h) for queue, h in self.waits.copy().items()],
        )
        yield _histograms(
            "tether_task_run_seconds",
            "How long a task's code ran in its child (until its outcome was ready to record).",
            ["queue", "task"],
            self.run_times.copy().items(),
        )
        claimed = CounterMetricFamily("tether_tasks_claimed", "Tasks this worker claimed.", labels=["queue"])
        for queue, n in self.claimed_counts.copy().items():
            claimed.add_metric([queue], n)
        yield claimed
        yield _histograms(
            "tether_claim_seconds", "Round trip of one claim statement.", [], [((), self.claim_time)]
        )
        yield _counter("tether_claims_empty", "Claim statements that returned no task.", self.claims_empty)
        yield _counter(
            "tether_claims_failed", "Claim statements that failed (database unreachable).", self.claims_failed
        )
        yield _histograms(
            "tether_heartbeat_write_seconds",
            "Round trip of the worker's heartbeat statement.",
            [],
            [((), self.heartbeat_time)],
        )
        yield _counter(
            "tether_heartbeat_failures", "Heartbeat writes that failed or timed out.", self.heartbeat_failures
        )
        recoveries = CounterMetricFamily(
            "tether_recoveries",
            "Tasks recovered by each rule (docs/monitoring.md#recoveries), as the rows say.",
            labels=["rule"],
        )
        for rule, n in self.recoveries.copy().items():
            recoveries.add_metric([rule], n)
        yield recoveries
        yield _counter(
            "tether_workers_deactivated",
            "Workers this worker's reaper marked inactive (heartbeat stale).",
            self.workers_deactivated,
        )
        yield GaugeMetricFamily(
            "tether_worker_tasks_in_flight",
            "Tasks this worker holds now, claimed or running.",
            self.in_flight(),
        )
        yield GaugeMetricFamily("tether_worker_children", "Child processes alive now.", self.children())


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _histograms(
    name: str, documentation: str, labels: list[str], series: Iterable[tuple[tuple[str, ...], Hist]]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=labels)
    for values, hist in series:
        buckets, total = hist.exposed()
        family.add_metric(list(values), buckets, total)
    return family
