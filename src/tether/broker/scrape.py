"""What a Prometheus scrape reads from the database (metrics.sql, with counts.py and health.py).

One read-only transaction per scrape, whatever the number of queues: the counts of
counts.py (exact for what waits and runs, estimated for history), the oldest due PENDING
task of each queue (health.py's skip scan of the claim index) and the workers by status.
None of it grows with the history.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.broker import counts, health
from tether.broker.queries import q
from tether.broker.types import Conn


@dataclass(frozen=True, slots=True)
class QueueState:
    """The database's side of a scrape."""

    counts: list[counts.QueueCount]
    lag: list[health.QueueLag]
    workers: dict[str, int]  # status -> how many


def queue_state(conn: Conn) -> QueueState:
    with conn.transaction():
        found = counts.queue_counts(conn)
        lag = health.queue_lag(conn)
        rows = conn.execute(q("workers_by_status")).fetchall()
    return QueueState(found, lag, {row["status"]: int(row["n"]) for row in rows})
