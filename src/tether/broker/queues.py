"""Queue statements (queues.sql): pause, resume, whether a name is known, the overview.

The public door is tether.queue_control (names checked, changes logged); these
functions only read and write rows. The overview's rows are tether.QueueInfo (broker/rows.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from tether.broker.answers import Answer
from tether.broker.counts import queue_counts
from tether.broker.queries import q
from tether.broker.types import Conn

if TYPE_CHECKING:
    # The public row types (rows.py), imported by the reads that return them on first use:
    # a worker and a send never build them.
    from tether.broker.rows import QueueInfo


@dataclass(frozen=True, slots=True)
class Pause:
    """A queue's pause: since when, and who asked (None: not said)."""

    queue: str
    paused_at: datetime
    paused_by: str | None


#: The answer of pause_queue and resume_queue, as PostgresBroker.run_request records it.
PAUSE_ANSWER: Answer[Pause | None] = Answer(Pause | None)


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


def queue_overview(conn: Conn, also: Sequence[str] = (), *, exact: bool = False) -> list[QueueInfo]:
    """Every queue with tasks, every paused queue and every name in ``also``, by name.

    The counts are counts.queue_counts's: on a large table the finished ones (and a long
    backlog) are estimates, named in each QueueInfo's ``estimated``; ``exact`` counts every row.
    """
    counted: dict[str, dict[str, int]] = {}
    estimated: dict[str, list[str]] = {}
    for c in queue_counts(conn, exact=exact):
        counted.setdefault(c.queue, {})[c.status.value] = c.n
        if c.estimated:
            estimated.setdefault(c.queue, []).append(c.status.value)
    names = sorted({*counted, *also})
    from tether.broker.rows import QueueInfo

    rows = conn.execute(q("queue_states"), {"names": names}).fetchall()
    infos = []
    for row in rows:
        row["counts"] = counted.get(row["queue"], {})
        row["estimated"] = tuple(estimated.get(row["queue"], ()))
        infos.append(QueueInfo.from_row(row))
    return infos
