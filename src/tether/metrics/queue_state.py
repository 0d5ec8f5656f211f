"""The database's side of a scrape, as a prometheus_client collector: per queue, tasks by
status and the age of the oldest due PENDING task (the lag), and workers by status.

Read once per scrape in one transaction (broker/scrape.py), never per queue, and never
more often than MIN_INTERVAL_S however many scrapers ask. A scrape whose read fails
answers without these series and counts the failure (tether_scrape_errors_total): the
process's own counters are still worth having when the database is away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tether.broker.scrape import QueueState, queue_state
from tether.broker.types import Conn
from tether.result import TaskStatus

log = logging.getLogger("tether.metrics")

MIN_INTERVAL_S = 1.0

Connect = Callable[[], AbstractContextManager[Conn]]


class QueueStateCollector(Collector):
    def __init__(self, connect: Connect) -> None:
        self.connect = connect
        self._lock = threading.Lock()
        self._last: tuple[float, QueueState] | None = None
        self.errors = 0
        self.reads = 0

    def describe(self) -> list[GaugeMetricFamily]:
        """Nothing: a registry asks at registration, and the answer would cost a read of the database."""
        return []

    def read(self) -> QueueState | None:
        with self._lock:  # concurrent scrapes share one read
            if self._last is not None and time.monotonic() - self._last[0] < MIN_INTERVAL_S:
                return self._last[1]
            try:
                with self.connect() as conn:
                    state = queue_state(conn)
            except Exception as exc:  # the database is away: the rest of the scrape still answers
                self.errors += 1
                log.warning("metrics: could not read the queues' state: %s", exc)
                return None
            self.reads += 1
            self._last = (time.monotonic(), state)
            return state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = self.read()
        errors = CounterMetricFamily(
            "tether_scrape_errors", "Scrapes whose read of the queues' state from the database failed."
        )
        errors.add_metric([], self.errors)
        yield errors
        if state is None:
            return
        tasks = GaugeMetricFamily(
            "tether_tasks",
            "Tasks per queue and status: exact for PENDING (up to 1,000 a queue), CLAIMED and "
            "RUNNING; the finished statuses estimated from a sample on a large table.",
            labels=["queue", "status"],
        )
        seen: set[tuple[str, str]] = set()
        for count in state.counts:
            tasks.add_metric([count.queue, count.status.value], count.n)
            seen.add((count.queue, count.status.value))
        queues = sorted({c.queue for c in state.counts} | {lag.queue for lag in state.lag})
        for queue in queues:  # a live status with no task is 0, not absent: alerts compare it
            for status in (TaskStatus.PENDING, TaskStatus.CLAIMED, TaskStatus.RUNNING):
                if (queue, status.value) not in seen:
                    tasks.add_metric([queue, status.value], 0)
        yield tasks
        lag = GaugeMetricFamily(
            "tether_queue_lag_seconds",
            "Per queue: how long its oldest due PENDING task has been due (0: none due).",
            labels=["queue"],
        )
        lagged = {row.queue: row for row in state.lag}
        for queue in queues:
            row = lagged.get(queue)
            lag.add_metric([queue], row.oldest_due_age_s or 0.0 if row is not None else 0.0)
        yield lag
        paused = GaugeMetricFamily("tether_queue_paused", "1 if the queue is paused.", labels=["queue"])
        for row in state.lag:
            paused.add_metric([row.queue], 1.0 if row.paused else 0.0)
        yield paused
        yield from _health(state)
        workers = GaugeMetricFamily("tether_workers", "Workers in the registry by status.", labels=["status"])
        for worker_status in ("active", "stopped", "inactive"):
            workers.add_metric([worker_status], state.workers.get(worker_status, 0))
        yield workers


def _health(state: QueueState) -> Iterator[GaugeMetricFamily]:
    """`tether health`'s figures that page before a collapse (docs/health.md)."""
    ages = [h.transaction_age_s for h in state.horizon if h.transaction_age_s is not None]
    xmins = [h.xmin_age for h in state.horizon if h.xmin_age is not None]
    yield GaugeMetricFamily(
        "tether_db_oldest_transaction_seconds",
        "Age of the oldest open transaction in this database (0: none): it holds back vacuum.",
        value=max(ages, default=0.0),
    )
    yield GaugeMetricFamily(
        "tether_db_horizon_xmin_age",
        "Transactions started since the oldest MVCC horizon held (a session, prepared "
        "transaction or replication slot); dead rows younger than it cannot be removed.",
        value=float(max(xmins, default=0)),
    )
    dead = GaugeMetricFamily(
        "tether_table_dead_rows", "Dead rows of each tether table (statistics estimate).", labels=["table"]
    )
    size = GaugeMetricFamily(
        "tether_table_bytes", "Size of each tether table on disk, heap and indexes.", labels=["table"]
    )
    for table in state.tables:
        dead.add_metric([table.table_name], table.dead_rows)
        size.add_metric([table.table_name], table.table_bytes + table.index_bytes)
    yield dead
    yield size
