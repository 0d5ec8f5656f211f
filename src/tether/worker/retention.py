"""Retention in the worker: after a reaper pass that acted, at most once per ``every_s``
(and at once while behind), delete what is past its retention, in small batches, until
caught up or for at most ``budget_s``.

Each batch is one statement and one commit of at most ``batch`` rows (broker/retention.py),
so no lock is held for long and a batch never waits for another pruner. A pass that used
its whole budget with rows left asks the reaper to come back soon (``behind``): pruning
keeps pace with a steady stream of finishing tasks, however long the check interval.

Each category is read from where its last batch stopped (its cursor), not from its oldest
row: rows deleted while a transaction holds back the vacuum keep their index entries, and a
batch that read from the oldest again would read all of them. Only a row written with a time
older than the cursor (by hand, or by a tool) is missed that way, so once an hour, and in a
worker's first pass, each category is read from its start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from tether.broker import retention
from tether.broker.types import Conn
from tether.config import RecoveryConfig

log = logging.getLogger("tether.recovery")

BATCH = 1_000  # rows per batch: tens of milliseconds of locks
BUDGET_S = 1.0  # per pass
# A pass that finds nothing costs one statement per category: not on every reaper tick.
EVERY_S = 60.0
FROM_THE_START_EVERY_S = 3600.0
LOG_EVERY_S = 60.0  # what was pruned is logged at most this often (the first pass at once)


class Retention:
    def __init__(
        self,
        config: RecoveryConfig,
        *,
        batch: int = BATCH,
        budget_s: float = BUDGET_S,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.batch = batch
        self.budget_s = budget_s
        self.every_s = every_s
        self.clock = clock
        self.behind = False  # the last pass ran out of budget with rows left
        self._next_at = clock()  # the first pass that acts prunes
        self._after: dict[str, datetime] = {}
        self._from_start_at = clock()  # the first pass reads from the start
        self._pruned: dict[str, int] = {}
        self._batches = 0
        self._longest_s = 0.0
        self._logged_at: float | None = None

    @property
    def due(self) -> bool:
        return self.behind or self.clock() >= self._next_at

    def run(self, conn: Conn) -> dict[str, int]:
        """One pass over every category (``conn`` in autocommit: one commit per batch); the
        rows deleted per category."""
        started = self.clock()
        self._next_at = started + self.every_s
        if started >= self._from_start_at:
            self._after.clear()
            self._from_start_at = started + FROM_THE_START_EVERY_S
        deleted: dict[str, int] = {}
        self.behind = False
        for category in retention.CATEGORIES:
            hours = category.hours(self.config)
            if hours is None:
                continue
            age = timedelta(hours=hours)
            while True:
                after = self._after.get(category.name, retention.FROM_THE_START)
                t0 = self.clock()
                batch = category.delete(conn, age, self.batch, after)
                self._note_batch(self.clock() - t0)
                if batch.reached is not None:
                    self._after[category.name] = batch.reached
                if batch.deleted:
                    deleted[category.name] = deleted.get(category.name, 0) + batch.deleted
                if batch.read < self.batch:
                    break  # caught up
                if self.clock() - started >= self.budget_s:
                    self.behind = True
                    break
        self._log(deleted)
        return deleted

    def _note_batch(self, seconds: float) -> None:
        self._batches += 1
        self._longest_s = max(self._longest_s, seconds)

    def _log(self, deleted: dict[str, int]) -> None:
        for name, n in deleted.items():
            self._pruned[name] = self._pruned.get(name, 0) + n
        now = self.clock()
        if not self._pruned or (self._logged_at is not None and now - self._logged_at < LOG_EVERY_S):
            return
        log.info(
            "retention: pruned %s in %d batch(es), the longest %.0f ms%s",
            ", ".join(f"{n} {name}" for name, n in self._pruned.items()),
            self._batches,
            1000 * self._longest_s,
            " (behind: pruning again soon)" if self.behind else "",
        )
        self._pruned, self._batches, self._longest_s, self._logged_at = {}, 0, 0.0, now
