"""Queue statements (queues.sql): pause, resume, whether a name is known, the overview.

The public door is tether.queue_control (names checked, changes logged); these
functions only read and write rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from tether.broker.answers import Answer
from tether.broker.queries import q
from tether.broker.types import Conn


@dataclass(frozen=True, slots=True)
class Pause:
    """A queue's pause: since when, and who asked (None: not said)."""

    queue: str
    paused_at: datetime
    paused_by: str | None


#: The answer of pause_queue and resume_queue, as PostgresBroker.run_request records it.
PAUSE_ANSWER: Answer[Pause | None] = Answer(Pause | None)


@dataclass(frozen=True, slots=True)
class QueueOverview:
    """One queue as the overview reads it; counts leaves out the statuses with no task."""

    queue: str
    counts: dict[str, int]
    oldest_pending_age_s: float | None
    paused: bool
    paused_at: datetime | None
    paused_by: str | None


def pause_queue(conn: Conn, queue: str, by: str | None) -> Pause | None:
    """Pause ``queue`` and tell the workers; its new pause, or None if it was paused already."""
    row = conn.execute(q("pause_queue"), {"queue": queue, "by": by}).fetchone()
    return None if row is None else Pause(row["queue"], row["paused_at"], row["paused_by"])


def resume_queue(conn: Conn, queue: str) -> Pause | None:
    """Resume ``queue`` and tell the workers; the pause this ended, or None if it was not paused."""
    row = conn.execute(q("resume_queue"), {"queue": queue}).fetchone()
    return None if row is None else Pause(row["queue"], row["paused_at"], row["paused_by"])


def get_pause(conn: Conn, queue: str) -> Pause | None:
    """The queue's pause, or None if it is not paused."""
    row = conn.execute(q("get_pause"), {"queue": queue}).fetchone()
    return None if row is None else Pause(row["queue"], row["paused_at"], row["paused_by"])


def queue_known(conn: Conn, queue: str) -> bool:
    """Whether a task (waiting, in flight or in the history), a worker's registration or a
    schedule names ``queue`` (a pause alone does not)."""
    row = conn.execute(q("queue_known"), {"queue": queue}).fetchone()
    return bool(row is not None and row["known"])


def queue_overview(conn: Conn, also: Sequence[str] = ()) -> list[QueueOverview]:
    """Every queue with tasks, every paused queue and every name in ``also``, by name."""
    rows = conn.execute(q("queue_overview"), {"also": list(also)}).fetchall()
    return [
        QueueOverview(
            queue=row["queue"],
            counts={status: int(n) for status, n in row["counts"].items()},
            oldest_pending_age_s=row["oldest_pending_age_s"],
            paused=row["paused"],
            paused_at=row["paused_at"],
            paused_by=row["paused_by"],
        )
        for row in rows
    ]
