"""The scheduler, a background service (services.py): sends each periodic task's slots, in
every worker, exactly once per slot.

At start it stores the schedules the worker's code declares for its queues (periodic.
sync_declared). Then each tick reads when the next slot of its queues comes (one
statement); once one has come, in one transaction: lock the live schedules of its queues
whose next slot has come, send their due slots by the catch-up and overlap rules, move
their cursors on, and read when the next slot comes; it sleeps until then. Every worker
runs one: no leader. Workers reaching a slot together take turns on the schedule's row
lock, and the second finds it no longer due; the unique index on (schedule, slot) is
the last word if anything else slips through.

It wakes early when a schedule of its queues is declared, paused or resumed (NOTIFY
'tether_schedules', through the work listener), and looks at least every check interval
whatever it was told: nothing depends on a notification arriving. That look is no
transaction of its own while the heartbeat tells it: each beat reads when the next slot
comes (heartbeats.sql) and hands it over (``heard``), and a tick that no notification woke
takes the beat's answer while it is younger than 1.5 check intervals. On a database error
it tries again after 0.5 s, backing off up to the check interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from datetime import datetime
from uuid import UUID

from tether.broker import schedules
from tether.broker.schedules import DueSchedule
from tether.broker.types import Conn
from tether.config import AppConfig
from tether.cron import Cron
from tether.ids import new_task_ids
from tether.periodic import Schedule, plan_slots, sync_declared
from tether.result import TaskStatus
from tether.worker.backoff import Backoff
from tether.worker.services import Service
from tether.worker.shared_connection import SharedConnection

log = logging.getLogger("tether.scheduler")

# Slots are due from their instant on: wake a little after it, never before.
AFTER_DUE_S = 0.002
# A heartbeat's read of the next slot stands for the scheduler's own look while younger than
# this many check intervals. Beats come a heartbeat interval apart (by default the check
# interval too), and one a little late must not cost a read: the slack is for that.
HEARD_FRESH_FOR = 1.5


class Scheduler(Service):
    name = "scheduler tick"
    log = log

    def __init__(
        self,
        url: str,
        config: AppConfig,
        queues: Sequence[str],
        declared: Sequence[Schedule],
        connection: SharedConnection | None = None,
    ) -> None:
        """``connection``: the main process's shared one (closed by its owner); else its own."""
        self.max_sleep_s = config.recovery.check_interval_ms / 1000
        super().__init__(Backoff(0.5, max(0.5, self.max_sleep_s)))
        self._owns_connection = connection is None
        self.connection = connection or SharedConnection(url, config, "scheduler")
        self.queues = list(queues)
        self.declared = list(declared)
        self._synced = False
        self._crons: dict[tuple[str, str], Cron] = {}
        # The heartbeat's last answer: (time.monotonic() when read, seconds to the next slot).
        self._heard: tuple[float, float | None] | None = None
        self._told = True  # woken by a notification (or never looked): read, do not trust _heard

    def wake(self) -> None:
        """A schedule of these queues changed (the work listener calls it): read afresh."""
        self._told = True
        super().wake()

    def heard(self, next_slot_in: float | None, read_at: float) -> None:
        """What a heartbeat read of the next slot (None: no live schedule for these queues),
        in a statement sent at ``read_at`` (time.monotonic()); called from the event loop.
        An answer older than the last one kept is dropped; a slot sooner than the one
        this tick sleeps for wakes it."""
        before = self._heard
        if before is not None and before[0] > read_at:
            return
        self._heard = (read_at, next_slot_in)
        if next_slot_in is not None and (before is None or _due_at(before) > _due_at(self._heard)):
            self.woken.set()  # no fresh read needed: what the beat read is enough

    async def tick(self) -> float:
        """Send what is due (in a thread); the seconds until the next slot, at most the check interval."""
        return await self.in_thread(self.run_once)

    async def close(self) -> None:
        await self.round_over()
        if self._owns_connection:
            await asyncio.to_thread(self.connection.close)

    def run_once(self) -> float:
        """Send what is due; the seconds until the next slot (at most the check interval)."""
        with self.connection.turn() as conn:
            return self._tick(conn)

    def _tick(self, conn: Conn) -> float:
        if not self._synced:
            sync_declared(conn, self.declared, self.queues)
            self._synced = True
        # Most ticks find nothing due (a fleet ticks every check interval per worker): the
        # heartbeat's last read says so, or one read outside any transaction, and when the
        # next slot comes.
        ahead = self._ahead_heard()
        if ahead is False:
            ahead = self._read_next_slot(conn)
        if ahead is None or ahead > 0:
            return self._until(ahead)
        with conn.transaction():
            for due in schedules.lock_due_schedules(conn, self.queues):
                self._send_due(conn, due)
            return self._until(self._read_next_slot(conn))

    def _read_next_slot(self, conn: Conn) -> float | None:
        """Read when the next slot comes; kept as the latest answer (newer than any beat's so far)."""
        read_at = time.monotonic()
        ahead = schedules.next_slot_in(conn, self.queues)
        self._heard = (read_at, ahead)
        return ahead

    def _ahead_heard(self) -> float | bool | None:
        """Seconds to the next slot as the heartbeat last read them (None: no schedule), or
        False when that is no answer: woken by a notification, or too old (HEARD_FRESH_FOR)."""
        told, self._told = self._told, False
        heard = self._heard
        if told or heard is None:
            return False
        age = time.monotonic() - heard[0]
        if age >= HEARD_FRESH_FOR * self.max_sleep_s:
            return False
        return None if heard[1] is None else heard[1] - age

    def _until(self, wait: float | None) -> float:
        """Until the next slot (None: there is none), at most the check interval."""
        if wait is None:
            return self.max_sleep_s
        return min(self.max_sleep_s, max(0.0, wait) + AFTER_DUE_S)

    def _cron(self, expression: str, timezone: str) -> Cron:
        key = (expression, timezone)
        if key not in self._crons:
            self._crons[key] = Cron(expression, timezone)
        return self._crons[key]

    def _send_due(self, conn: Conn, due: DueSchedule) -> None:
        d = due.definition
        cron = self._cron(d.cron, d.timezone)
        after = max(due.slots_after, due.last_slot) if due.last_slot is not None else due.slots_after
        plan = plan_slots(cron, after, due.now, d.catch_up)
        send, skipped_by_overlap = plan.send, 0
        unfinished = due.last_status is not None and not TaskStatus(due.last_status).is_terminal
        if send and d.overlap == "skip" and unfinished:
            log.warning(
                "schedule %s: slot %s skipped: the task of its previous slot is still %s (overlap='skip')",
                d.name,
                _local(cron, send[-1]),
                due.last_status,
            )
            send, skipped_by_overlap = [], len(send)
        sent: list[tuple[UUID, datetime]] = []
        if send:
            sent = schedules.insert_slot_tasks(conn, d, new_task_ids(len(send)), send)
        if plan.skipped:
            log.warning(
                "schedule %s: %s%d missed slot(s) up to %s not sent (catch_up=%r)%s",
                d.name,
                "at least " if plan.more_skipped else "",
                plan.skipped,
                _local(cron, plan.last_slot) if plan.last_slot else "-",
                d.catch_up,
                f"; sent the {len(send)} most recent" if d.catch_up == "all" else "",
            )
        for task_id, slot in sent:
            log.debug(
                "schedule %s: slot %s sent as task %s (%s)",
                d.name,
                _local(cron, slot),
                task_id,
                d.task_name,
                extra={"task_id": str(task_id), "task_name": d.task_name, "queue": d.queue},
            )
        schedules.advance_schedule(
            conn,
            d.name,
            last_slot=plan.last_slot,
            next_slot=plan.next_slot,
            last_task_id=sent[-1][0] if sent else None,
            sent=len(sent),
            skipped=plan.skipped + skipped_by_overlap,
        )


def _due_at(heard: tuple[float, float | None]) -> float:
    """The monotonic time of the next slot a heartbeat read (inf: none)."""
    return float("inf") if heard[1] is None else heard[0] + heard[1]


def _local(cron: Cron, slot: datetime) -> str:
    return slot.astimezone(cron.tz).isoformat()
