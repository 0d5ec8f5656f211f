"""What the dashboard's charts read (charts.sql): tasks ended and recoveries per time bucket,
the queues' depth and lag now, and the worker's write of the recoveries it tallied.

Nothing here is on the path that ends a task: the finished counts are read back from the
terminal rows through their index (a range of the minutes asked for, never the history),
and the recoveries come from tether_recovery_minutes (migration 15), which workers add to
with their heartbeat (tether/metrics/recovery_tally.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tether.broker import counts, health
from tether.broker.queries import q
from tether.broker.types import AsyncConn, Conn


@dataclass(frozen=True, slots=True)
class Finished:
    """``n`` tasks of ``queue`` ended in ``status`` in the bucket starting ``at``."""

    at: datetime
    queue: str
    status: str
    n: int


@dataclass(frozen=True, slots=True)
class Recoveries:
    """``n`` tasks were recovered by ``rule`` in the bucket starting ``at``."""

    at: datetime
    rule: str
    n: int


@dataclass(frozen=True, slots=True)
class QueueSample:
    """One queue now: tasks waiting (PENDING, due or not), in flight, and its lag (the age of
    its oldest due PENDING task, None when none is due)."""

    queue: str
    pending: int
    in_flight: int
    lag_s: float | None


def database_now(conn: Conn) -> datetime:
    """The database's clock (the one that stamps tasks' ends)."""
    row = conn.execute(q("charts_now")).fetchone()
    assert row is not None  # one row always
    at: datetime = row["now"]
    return at


def finished_per_bucket(conn: Conn, since: datetime, until: datetime, bucket_s: int) -> list[Finished]:
    """Tasks that ended in [``since``, ``until``), per ``bucket_s`` bucket (aligned on the
    epoch), queue and status."""
    params = {"since": since, "until": until, "bucket_s": bucket_s}
    rows = conn.execute(q("finished_per_bucket"), params).fetchall()
    return [Finished(r["at"], r["queue"], r["status"], int(r["n"])) for r in rows]


def recoveries_per_bucket(conn: Conn, since: datetime, bucket_s: int) -> list[Recoveries]:
    """Recoveries from ``since`` on, per ``bucket_s`` bucket (aligned on the epoch) and rule."""
    rows = conn.execute(q("recoveries_per_bucket"), {"since": since, "bucket_s": bucket_s}).fetchall()
    return [Recoveries(r["at"], r["rule"], int(r["n"])) for r in rows]


#: The depth is exact up to this many PENDING tasks per queue, estimated beyond (counts.py).
PENDING_EXACT_UP_TO = 10_000
#: Pages the estimate of the finished statuses reads: unused by the chart, so the fewest.
SAMPLE_PAGES = 10


def queue_samples(conn: Conn) -> list[QueueSample]:
    """Every queue with tasks waiting or in flight, by name: what a Prometheus scrape reads
    (broker/scrape.py), without the history's counts."""
    with conn.transaction():
        found = counts.queue_counts(conn, sample_pages=SAMPLE_PAGES, pending_exact_up_to=PENDING_EXACT_UP_TO)
        lags = {lag.queue: lag.oldest_due_age_s for lag in health.queue_lag(conn)}
    pending: dict[str, int] = {}
    in_flight: dict[str, int] = {}
    for c in found:
        if c.status == "PENDING":
            pending[c.queue] = pending.get(c.queue, 0) + c.n
        elif c.status in ("CLAIMED", "RUNNING"):
            in_flight[c.queue] = in_flight.get(c.queue, 0) + c.n
    names = sorted(set(pending) | set(in_flight) | set(lags))
    return [QueueSample(n, pending.get(n, 0), in_flight.get(n, 0), lags.get(n)) for n in names]


async def record_recoveries(conn: AsyncConn, tally: dict[tuple[datetime, str], int]) -> None:
    """Add a worker's tally, {(minute, rule): tasks}, to tether_recovery_minutes."""
    keys = list(tally)
    await conn.execute(
        q("record_recoveries"),
        {"minutes": [k[0] for k in keys], "rules": [k[1] for k in keys], "ns": [tally[k] for k in keys]},
    )
