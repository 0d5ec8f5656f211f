"""The reaper's pass riding on the worker's heartbeat: one commit per interval for an idle worker.

An idle worker writes two things an interval: its heartbeat, and (alone, or as the worker
that did the fleet's last pass) the reaper's pass, whose claim of ``tether_reaper`` is a
write. Each was its own transaction: two commits per interval with nothing to do. So when
a pass finds nothing due before its check interval, the worker that did it plans the next
one for a moment it beats anyway: the last beat of its heartbeat before that pass is due
(``plan``). At that beat, the heartbeat hands its beat to the reaper (``PassRider.ride``),
whose pass writes it in the pass's own transaction: one commit for both.

What it does not change: the fleet's one pass per due moment (the pass is still claimed
through the row and the advisory lock; only the worker that planned the ride may claim it
up to ``slack`` early, since the beat is timed by its clock, not the database's). Recovery
is never later: the pass moves to a beat at or before the moment it was due, and only
when nothing turns stale or expires before the check interval (a pass due sooner keeps
its own moment and transaction). And the heartbeat never waits on the reaper for long: if
the pass has not written the beat within ``slack`` (a pass that recovers much, the
connection busy with the scheduler), the beat is written alone on the heartbeat's own
connection, and the pass leaves it out (``Ride.abandoned``). If the beat does not come
(the heartbeat failed, or beats at another moment), the reaper does the pass itself
``slack`` after the planned moment.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tether.broker.heartbeats import BeatAnswer
from tether.broker.types import Conn

#: Writes the beat on the pass's connection, in its transaction.
BeatWriter = Callable[[Conn], BeatAnswer]


class BeatClock(Protocol):
    """When the worker beats (the heartbeat, heartbeat.py)."""

    @property
    def every(self) -> float:
        """Seconds between beats."""
        ...

    @property
    def next_at(self) -> float | None:
        """time.monotonic() of the next beat (None: no beat has got through yet)."""
        ...


class PassRider(Protocol):
    """What the heartbeat asks of the reaper (reaper.py)."""

    def wants_ride(self, now: float) -> bool:
        """The next pass is planned to ride on a beat sent at ``now`` (time.monotonic())."""
        ...

    async def ride(self, write: BeatWriter, next_beat_at: float) -> BeatAnswer:
        """Do the pass with the beat in its transaction; the beat's answer. Raises (TimeoutError
        after ``slack``, or the pass's error) when the beat was not written: write it alone."""
        ...


def slack(every: float) -> float:
    """How far a beat may be from the moment its ride was planned for, and how long the
    heartbeat waits for the pass: a quarter of the interval, at most a second."""
    return min(every / 4, 1.0)


def plan(began: float, wait: float, next_beat_at: float | None, every: float, now: float) -> float | None:
    """The beat the next pass rides on: the last one at or before the moment it is due
    (``began + wait``, began: when the pass's transaction began), counted from the next
    beat; None when no beat comes before that moment (or none is known)."""
    if next_beat_at is None or next_beat_at < now:
        return None  # no beat has got through lately: the heartbeat's schedule is unknown
    due = began + wait
    if next_beat_at > due:
        return None
    return next_beat_at + every * int((due - next_beat_at) // every)


@dataclass
class Ride:
    """A beat handed to the next pass."""

    write: BeatWriter
    next_beat_at: float  # time.monotonic() of the beat after this one (the next plan counts from it)
    answer: asyncio.Future[BeatAnswer]
    # The heartbeat stopped waiting and writes the beat alone: the pass must leave it out.
    abandoned: threading.Event = field(default_factory=threading.Event)

    @property
    def wanted(self) -> bool:
        return not self.abandoned.is_set() and not self.answer.done()

    def deliver(self, answer: BeatAnswer) -> None:
        """From the pass's thread, once its transaction committed: the heartbeat need not wait
        for what the pass does after it (workflow steps, retention)."""
        self.answer.get_loop().call_soon_threadsafe(self._set, answer)

    def _set(self, answer: BeatAnswer) -> None:
        if not self.answer.done():
            self.answer.set_result(answer)
