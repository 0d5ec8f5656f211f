"""Schedule statements (schedules.sql): declarations, the scheduler's tick, pause, listing.

Which slots are due, and what to do about missed ones, is decided in tether.periodic;
these functions only read and write rows. JSON columns travel as text both ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from tether.broker.queries import q
from tether.broker.tasks import database_now
from tether.broker.types import Conn


@dataclass(frozen=True, slots=True)
class ScheduleDefinition:
    """A schedule as declared in code, ready to store (args, kwargs, retry_policy as JSON text)."""

    name: str
    task_name: str
    cron: str
    timezone: str
    args: str
    kwargs: str
    queue: str
    priority: int
    max_retries: int
    retry_policy: str | None
    catch_up: str
    overlap: str
    concurrency_key: str | None = None  # its tasks' (docs/limits.md)


@dataclass(frozen=True, slots=True)
class StoredSchedule:
    """A schedule's stored definition, as a starting worker compares it with its code."""

    definition: ScheduleDefinition
    removed: bool


@dataclass(frozen=True, slots=True)
class DueSchedule:
    """A schedule whose next slot has come, locked by this tick."""

    definition: ScheduleDefinition
    slots_after: datetime
    last_slot: datetime | None
    last_status: str | None  # of the task sent for the last slot (None: none, or pruned)
    now: datetime  # the database's time of this tick


@dataclass(frozen=True, slots=True)
class ScheduleTiming:
    cron: str
    timezone: str
    paused: bool
    now: datetime


@dataclass(frozen=True, slots=True)
class ScheduleInfo:
    """One schedule as `tether schedules` lists it."""

    name: str
    task_name: str
    cron: str
    timezone: str
    queue: str
    catch_up: str
    overlap: str
    paused: bool
    removed_at: datetime | None  # set when its workers started without it in their code
    created_at: datetime
    changed_at: datetime
    next_slot: datetime | None
    last_slot: datetime | None
    last_task_id: UUID | None
    last_task_status: str | None
    slots_sent: int
    slots_skipped: int


def _definition(row: dict[str, Any]) -> ScheduleDefinition:
    return ScheduleDefinition(
        row["name"],
        row["task_name"],
        row["cron"],
        row["timezone"],
        row["args"],
        row["kwargs"],
        row["queue"],
        row["priority"],
        row["max_retries"],
        row["retry_policy"],
        row["catch_up"],
        row["overlap"],
        row["concurrency_key"],
    )


# -- declarations (worker start) ---------------------------------------------------


def lock_declared_schedules(conn: Conn, queues: Sequence[str]) -> tuple[list[StoredSchedule], datetime]:
    """In the caller's transaction: the schedules of ``queues``, locked, and the database time."""
    rows = conn.execute(q("lock_declared_schedules"), {"queues": list(queues)}).fetchall()
    now = rows[0]["now"] if rows else database_now(conn)
    return [StoredSchedule(_definition(r), r["removed"]) for r in rows], now


def upsert_schedule(conn: Conn, schedule: ScheduleDefinition, next_slot: datetime | None) -> None:
    params = {
        "name": schedule.name,
        "task_name": schedule.task_name,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "args": schedule.args,
        "kwargs": schedule.kwargs,
        "queue": schedule.queue,
        "priority": schedule.priority,
        "max_retries": schedule.max_retries,
        "retry_policy": schedule.retry_policy,
        "catch_up": schedule.catch_up,
        "overlap": schedule.overlap,
        "concurrency_key": schedule.concurrency_key,
        "next_slot": next_slot,
    }
    conn.execute(q("upsert_schedule"), params)


def remove_schedule(conn: Conn, name: str) -> None:
    conn.execute(q("remove_schedule"), {"name": name})


def notify_schedules_changed(conn: Conn, queues: Sequence[str]) -> None:
    """Wake the schedulers of these queues (at the caller's commit)."""
    conn.execute(q("schedules_changed"), {"queues": sorted(set(queues))}).fetchall()


# -- the scheduler's tick -------------------------------------------------------------


def lock_due_schedules(conn: Conn, queues: Sequence[str]) -> list[DueSchedule]:
    """In the caller's transaction: the live schedules of ``queues`` whose next slot has come."""
    rows = conn.execute(q("lock_due_schedules"), {"queues": list(queues)}).fetchall()
    return [
        DueSchedule(_definition(r), r["slots_after"], r["last_slot"], r["last_status"], r["now"])
        for r in rows
    ]


def insert_slot_tasks(
    conn: Conn, schedule: ScheduleDefinition, ids: Sequence[UUID], slots: Sequence[datetime]
) -> list[tuple[UUID, datetime]]:
    """One task per slot (``ids[i]`` for ``slots[i]``); returns (id, slot) of those inserted.

    A slot that already has its task is left out: sent before, by this worker or another.
    """
    params = {
        "task_name": schedule.task_name,
        "queue": schedule.queue,
        "priority": schedule.priority,
        "args": schedule.args,
        "kwargs": schedule.kwargs,
        "max_retries": schedule.max_retries,
        "retry_policy": schedule.retry_policy,
        "concurrency_key": schedule.concurrency_key,
        "schedule": schedule.name,
        "ids": list(ids),
        "slots": list(slots),
    }
    return [(r["id"], r["slot"]) for r in conn.execute(q("insert_slot_tasks"), params).fetchall()]


def advance_schedule(
    conn: Conn,
    name: str,
    *,
    last_slot: datetime | None,
    next_slot: datetime | None,
    last_task_id: UUID | None,
    sent: int,
    skipped: int,
) -> None:
    params = {
        "name": name,
        "last_slot": last_slot,
        "next_slot": next_slot,
        "last_task_id": last_task_id,
        "sent": sent,
        "skipped": skipped,
    }
    conn.execute(q("advance_schedule"), params)


def next_slot_in(conn: Conn, queues: Sequence[str]) -> float | None:
    """Seconds until the next slot of the live schedules of ``queues`` (None: none at all)."""
    row = conn.execute(q("next_slot_in"), {"queues": list(queues)}).fetchone()
    return None if row is None or row["seconds"] is None else float(row["seconds"])


# -- pause and resume -----------------------------------------------------------------


def lock_schedule_timing(conn: Conn, name: str) -> ScheduleTiming | None:
    """In the caller's transaction: what resuming needs to place the next slot (None: unknown name)."""
    row = conn.execute(q("get_schedule_timing"), {"name": name}).fetchone()
    return None if row is None else ScheduleTiming(row["cron"], row["timezone"], row["paused"], row["now"])


def set_schedule_paused(conn: Conn, name: str, *, paused: bool, next_slot: datetime | None) -> str | None:
    """Pause or resume; the schedule's queue if that changed anything, None if it already was so."""
    row = conn.execute(
        q("set_schedule_paused"), {"name": name, "paused": paused, "next_slot": next_slot}
    ).fetchone()
    return None if row is None else str(row["queue"])


def list_schedules(conn: Conn) -> list[ScheduleInfo]:
    return [ScheduleInfo(**row) for row in conn.execute(q("list_schedules")).fetchall()]
