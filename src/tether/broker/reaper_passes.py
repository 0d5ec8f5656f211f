"""The fleet's reaper passes: one pass per due moment across all workers (migration 11).

One row, ``tether_reaper``, says when the next pass is due, by the database's clock. A
reaper tick reads it (``due_in``, one statement outside any transaction); when the moment
has come, it claims the pass in the transaction that then does it (``claim``): a
conditional UPDATE of the row that also takes the reaper's advisory lock, both held to
COMMIT. The pass ends with ``schedule_next`` in the same transaction. So a pass whose
worker dies or hangs rolls back, the row stays due, and the next worker to look takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from tether.broker.queries import q
from tether.broker.types import Conn


@dataclass(frozen=True, slots=True)
class ReaperTurn:
    """What a claim found: ``pass_number`` when this transaction holds the pass, else None;
    ``due_in_s``: seconds until the pass is due (<= 0: due, but another worker holds it)."""

    pass_number: int | None
    due_in_s: float


def _ms(value: float) -> timedelta:
    return timedelta(milliseconds=value)


@dataclass(frozen=True, slots=True)
class PassDue:
    """Seconds until the fleet's next pass is due (<= 0: now); ``running``: due, and another
    worker is doing it right now (it holds the reaper's advisory lock)."""

    due_in_s: float
    running: bool


def due_in(conn: Conn, check_interval_ms: float) -> PassDue:
    """When the fleet's next pass is due; one statement, no transaction.

    A missing row (the tables were emptied by hand) is made again, due at once.
    """
    row = conn.execute(q("reaper_pass_due_in"), {"check_interval": _ms(check_interval_ms)}).fetchone()
    if row is None:
        conn.execute(q("ensure_reaper_row"))
        return PassDue(0.0, False)
    return PassDue(float(row["due_in_s"]), bool(row["running"]))


def claim(conn: Conn, worker_id: str | None, check_interval_ms: float, early_s: float = 0.0) -> ReaperTurn:
    """In the caller's transaction: claim the fleet's pass if it is due (or due within
    ``early_s``) and nobody holds it."""
    params = {
        "worker_id": worker_id,
        "check_interval": _ms(check_interval_ms),
        "early": timedelta(seconds=early_s),
    }
    row = conn.execute(q("claim_reaper_pass"), params).fetchone()
    if row is None:  # emptied by hand since due_in() looked: the next tick makes it again
        return ReaperTurn(None, 0.0)
    return ReaperTurn(None if row["pass"] is None else int(row["pass"]), float(row["due_in_s"]))


def schedule_next(conn: Conn, after_s: float) -> None:
    """In the claiming pass's transaction: the fleet's next pass is due ``after_s`` from now."""
    conn.execute(q("schedule_next_reaper_pass"), {"after": timedelta(seconds=after_s)})


def schedule_next_from_now(conn: Conn, after_s: float) -> None:
    """As ``schedule_next``, counted from this statement's moment (``clock_timestamp()``),
    not from the transaction's start: for a pass planned on a heartbeat (worker/beat_rides.py)."""
    conn.execute(q("schedule_reaper_pass_at"), {"after": timedelta(seconds=after_s)})
