"""Where the next claim starts reading: this worker's marks in the claim order.

A task that leaves PENDING keeps its entry in the claim index (``tether_tasks_claim_idx``)
until a vacuum removes it. Normally the first scan that meets such an entry marks it dead
and later scans skip it for free; but while any transaction holds back the vacuum (a
long ``REPEATABLE READ`` transaction, ``pg_dump``, a replication slot), none can be marked,
and a claim that reads its queue from the start reads every task claimed since, with its
row. That is what made a held-back vacuum cut the claim rate to a seventh.

So the worker remembers, per queue and priority, the place of the last row its claims took
(a mark), and the next claim reads that band from just after it (claims.sql). A row can
only come to sit behind a mark when the transaction that made it PENDING started before a
claim passed its place and committed after (a send, a retry, a give-back, a requeue), or
when a claim read past it while it was locked. Such a row is delayed, never lost:

- tether_work notifications carry the earliest ``run_at`` of what they announce; one at or
  before a mark drops that queue's marks at or after it (give-backs, requeues, retries and
  every send while a worker waits always notify);
- the listener reconnecting drops every mark (notifications may have been missed);
- at least once per ``rescan_s`` (the poll interval) a claim reads everything, without
  marks. Under a held-back vacuum that full read costs one row visit per task claimed
  since the hold began, so it comes at most once per ``duration / RESCAN_SHARE``: full
  reads never take more than that share of the time.

A band with no mark is read from its start, so a new task of a higher priority than
everything marked is found by the next claim, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta

from tether.broker.claims import Claimed, Place

# Full reads (without marks) take at most this share of the time.
RESCAN_SHARE = 0.05
# Marks kept per queue; more bands than that are read from their start.
MAX_MARKS_PER_QUEUE = 16
# A notification's run_at is text with microseconds, read as a float: compare with a margin.
EPOCH_SLACK = timedelta(milliseconds=1)
# Rewinds remembered while no claim runs (a busy worker); past that, all marks go at once.
MAX_TOLD_MEANWHILE = 100


class ClaimMarks:
    def __init__(self, rescan_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rescan_s = rescan_s
        self.clock = clock
        self._marks: dict[tuple[str, int], Place] = {}
        self._next_full = 0.0  # clock() from which the next claim reads everything
        # Rewinds told while a claim runs, applied again after it: its statement may not
        # have seen the row announced, and must not move a mark past it.
        self._told_meanwhile: list[tuple[str | None, datetime | None]] = []

    def for_claim(self) -> list[Place] | None:
        """The marks for the next claim, or None: this claim reads everything (a full read)."""
        self._told_meanwhile = []
        if self.clock() >= self._next_full:
            return None
        return list(self._marks.values())

    def after_claim(
        self, claimed: Claimed, *, full_read: bool, filled: bool, spent_s: float, exact: bool
    ) -> None:
        """Move the marks after a claim.

        ``filled``: the claim took all it had room for, so it read no further than its last
        row. ``exact``: every row it read and left was of its own band and after what it took
        (not so when a worker with both kinds of child read rows of a kind it had no room for).
        ``spent_s``: how long it took.
        """
        if full_read:
            self._next_full = self.clock() + max(self.rescan_s, spent_s / RESCAN_SHARE)
            self._marks = self._kept_after_full_read(claimed, filled=filled, exact=exact)
        furthest: dict[tuple[str, int], Place] = {}
        for place in claimed.advances:  # in any order (an UPDATE returns its rows so)
            key = (place.queue, place.priority)
            if key not in furthest or (place.run_at, place.id) > (furthest[key].run_at, furthest[key].id):
                furthest[key] = place
        self._marks.update(furthest)
        for queue, run_at in self._told_meanwhile:
            self._drop(queue, run_at)
        self._told_meanwhile = []
        self._trim()

    def _kept_after_full_read(
        self, claimed: Claimed, *, filled: bool, exact: bool
    ) -> dict[tuple[str, int], Place]:
        """The marks a full read confirmed: none could hide a row the read would have taken.

        A read that came back short read every band: no band had a claimable row, behind its
        mark or not. A read that filled up read every band above the last row it took.
        """
        if not exact:
            return {}
        if not filled:
            return self._marks
        if not claimed.places:
            return {}
        lowest = min(place.priority for place in claimed.places)
        return {key: mark for key, mark in self._marks.items() if key[1] > lowest}

    def _trim(self) -> None:
        by_queue: dict[str, list[tuple[str, int]]] = {}
        for key in self._marks:
            by_queue.setdefault(key[0], []).append(key)
        for keys in by_queue.values():
            # A dropped mark's band is read from its start: slower, never wrong.
            for key in sorted(keys, key=lambda k: k[1])[: max(0, len(keys) - MAX_MARKS_PER_QUEUE)]:
                del self._marks[key]

    def rewind(self, queue: str, run_at: datetime | None) -> None:
        """Work at ``run_at`` was announced on ``queue``: drop the marks it may sit behind
        (None: the time is unknown, drop them all)."""
        self._drop(queue, run_at)
        self._tell((queue, run_at))

    def forget(self) -> None:
        """Drop every mark (notifications may have been missed)."""
        self._drop(None, None)
        self._tell((None, None))

    def _tell(self, rewind: tuple[str | None, datetime | None]) -> None:
        if len(self._told_meanwhile) >= MAX_TOLD_MEANWHILE:
            self._told_meanwhile = [(None, None)]  # drops everything: never wrong
        else:
            self._told_meanwhile.append(rewind)

    def _drop(self, queue: str | None, run_at: datetime | None) -> None:
        for key, mark in list(self._marks.items()):
            if (queue is None or key[0] == queue) and (run_at is None or mark.run_at >= run_at - EPOCH_SLACK):
                del self._marks[key]

    @property
    def marks(self) -> dict[tuple[str, int], Place]:
        return dict(self._marks)
