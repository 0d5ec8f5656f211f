"""Tasks per queue and status (counts.sql): exact for what waits and runs, estimated for history.

A count(*) over every task reads the whole table: seconds at ten million rows, on every
refresh of a dashboard. So on a large table only the live rows are counted exactly (in
flight always; PENDING up to ``pending_exact_up_to`` per queue), through the partial
indexes that hold only them, and the rest is counted in a sample of ``sample_pages`` pages
of the table and scaled up. Each count says whether it is an estimate. A table of fewer
pages than that is read whole: every count exact, as before. ``exact=True`` reads it whole
whatever its size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tether.broker.queries import q
from tether.broker.types import Conn
from tether.result import TaskStatus

#: Pages of tether_tasks the estimates read (8 MB with 8 kB pages; about 15,000 tasks).
SAMPLE_PAGES = 1_000
#: PENDING is counted exactly up to this per queue, estimated beyond.
PENDING_EXACT_UP_TO = 1_000


@dataclass(frozen=True, slots=True)
class QueueCount:
    """How many tasks ``queue`` has in ``status``; ``estimated``: counted in a sample of the
    table and scaled up (rounded to two significant digits), not one by one."""

    queue: str
    status: TaskStatus
    n: int
    estimated: bool = False


def queue_counts(
    conn: Conn,
    *,
    exact: bool = False,
    sample_pages: int | None = None,
    pending_exact_up_to: int | None = None,
) -> list[QueueCount]:
    """Tasks per queue and status (statuses with none left out), by queue then status.
    ``sample_pages`` and ``pending_exact_up_to``: None for SAMPLE_PAGES and PENDING_EXACT_UP_TO."""
    cap = PENDING_EXACT_UP_TO if pending_exact_up_to is None else pending_exact_up_to
    pages = SAMPLE_PAGES if sample_pages is None else sample_pages
    with conn.transaction():  # the first statement's settings hold for the second
        row = conn.execute(q("count_sample_percent"), {"pages": pages}).fetchone()
        assert row is not None  # one row always
        percent = 100.0 if exact else float(row["percent"])
        rows = conn.execute(
            q("queue_counts"),
            {"percent": percent, "pending_cap": None if exact else cap},
            # Planned with its values: the sample's share and the bound change how it is read.
            prepare=False,
        ).fetchall()
    return [
        QueueCount(
            row["queue"],
            TaskStatus(row["status"]),
            rounded(int(row["n"])) if row["estimated"] else int(row["n"]),
            bool(row["estimated"]),
        )
        for row in rows
    ]


def rounded(n: int) -> int:
    """``n`` to two significant digits: what a sample of a few thousand pages can tell."""
    if n < 100:
        return n
    step = 10 ** (int(math.log10(n)) - 1)
    return int(round(n / step) * step)
