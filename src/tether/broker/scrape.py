"""What a Prometheus scrape reads from the database (metrics.sql, with counts.py and health.py).

One read-only transaction per scrape, whatever the number of queues: the counts of
counts.py (exact for what waits and runs, estimated for history), the oldest due PENDING
task of each queue (health.py's skip scan of the claim index), the workers by status, and
health.py's statistics-view reads (the MVCC horizon's holders, each table's dead rows).
None of it grows with the history.
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.broker import counts, health
from tether.broker.queries import q
from tether.broker.types import Conn

#: Pages of tether_tasks a scrape's estimate of the finished statuses reads: 100 pages (about
#: 1,500 tasks) cost 7 ms at a million rows where counts.py's 1,000 for the dashboard cost 45 ms,
#: for figures within about 10 % (history on a board, not arithmetic).
SAMPLE_PAGES = 100
#: What waits is counted exactly up to this per queue (through the claim index), estimated beyond.
PENDING_EXACT_UP_TO = 10_000


@dataclass(frozen=True, slots=True)
class QueueState:
    """The database's side of a scrape."""

    counts: list[counts.QueueCount]
    lag: list[health.QueueLag]
    workers: dict[str, int]  # status -> how many
    # `tether health`'s facts that turn a queue's dead rows into a collapse (docs/health.md):
    horizon: list[health.HorizonHolder]  # what holds the MVCC horizon back, oldest first
    tables: list[health.TableStats]  # each tether table's dead rows and size (statistics)


def queue_state(conn: Conn) -> QueueState:
    with conn.transaction():
        found = counts.queue_counts(conn, sample_pages=SAMPLE_PAGES, pending_exact_up_to=PENDING_EXACT_UP_TO)
        lag = health.queue_lag(conn)
        rows = conn.execute(q("workers_by_status")).fetchall()
        horizon = health.horizon_holders(conn)
        tables = health.tether_tables(conn)
    return QueueState(found, lag, {row["status"]: int(row["n"]) for row in rows}, horizon, tables)
