"""Durable sleep and events (suspensions.sql): suspend a running attempt, take an event, send one.

A suspension ends a RUNNING attempt and leaves its task PENDING, due at its sleep's end or
its wait's timeout, fenced like an outcome (claims.Fence's terms: RUNNING, the attempt,
the owner). A statement about an event key runs after the key's advisory lock, in the same
transaction, so that a wait and a send of the same key never pass each other
(suspensions.sql says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from tether.broker.queries import q
from tether.broker.types import Conn

if TYPE_CHECKING:
    # The public row types (rows.py), imported by the reads that return them on first use:
    # a worker and a send never build them.
    from tether.broker.rows import TaskSuspension

#: The step names a sleep and a wait are recorded under (tether_task_steps).
SLEEP_STEP = "tether.sleep"
EVENT_STEP = "tether.event"


@dataclass(frozen=True, slots=True)
class Suspended:
    """What suspend_task did: held (the attempt still held its task; False: a zombie, nothing
    changed), cancel_requested (held, but a cancel was requested: nothing suspended), the time
    it resumes at, and delivered (a wait that found its event at once: due now)."""

    held: bool
    cancel_requested: bool
    resume_at: datetime | None
    delivered: bool

    @property
    def suspended(self) -> bool:
        return self.held and not self.cancel_requested


@dataclass(frozen=True, slots=True)
class Taken:
    """What take_event found: held (False: a zombie), the stored step's JSON text (an event's
    payload, or its timeout; None: nothing yet, suspend), and the seconds left of an open wait
    not yet timed out (None: none, or no timeout)."""

    held: bool
    stored: str | None
    remaining_s: float | None


def suspend_task(
    conn: Conn,
    *,
    task_id: str,
    attempt: int,
    worker_id: str,
    hostname: str | None,
    pid: int | None,
    name: str,
    occurrence: int,
    delay_s: float | None,
    key: str | None,
) -> Suspended:
    """Suspend the RUNNING attempt: a sleep of ``delay_s`` (key None), or a wait for ``key`` with
    a timeout of ``delay_s`` (None: none). A sleep is one statement, to run in autocommit; a
    wait, one transaction that takes its key's lock first."""
    params = {
        "id": task_id,
        "attempt": attempt,
        "worker_id": worker_id,
        "hostname": hostname,
        "pid": pid,
        "name": name,
        "occurrence": occurrence,
        "delay_s": delay_s,
        "key": key,
    }
    if key is None:  # a sleep: one statement (the worker's connections are in autocommit)
        row = conn.execute(q("suspend_task"), params).fetchone()
    else:
        with conn.transaction():
            conn.execute(q("lock_event_key"), {"key": key})
            row = conn.execute(q("suspend_task"), params).fetchone()
    assert row is not None  # one row always
    return Suspended(
        bool(row["held"]), bool(row["cancel_requested"]), row["resume_at"], bool(row["delivered"])
    )


def take_event(conn: Conn, *, task_id: str, attempt: int, worker_id: str, occurrence: int, key: str) -> Taken:
    """For a wait_for_event call with no stored step: take the key's oldest undelivered event,
    or store the timeout of this occurrence's wait if it has passed; fenced like a step write."""
    params = {
        "id": task_id,
        "attempt": attempt,
        "worker_id": worker_id,
        "name": EVENT_STEP,
        "occurrence": occurrence,
        "key": key,
    }
    with conn.transaction():
        conn.execute(q("lock_event_key"), {"key": key})
        row = conn.execute(q("take_event"), params).fetchone()
    assert row is not None
    return Taken(bool(row["held"]), row["stored"], row["remaining_s"])


@dataclass(frozen=True, slots=True)
class EventSent:
    """What send_event did: the event's id, and the task it was delivered to (None: kept for
    the next waiter)."""

    event_id: int
    delivered_to: str | None


def send_event(conn: Conn, *, key: str, payload: str) -> EventSent:
    """Store one event (``payload``: JSON text) and deliver it to the task waiting longest for
    ``key``, if any. Runs in the connection's transaction when one is open (a caller's), else
    in one of its own."""
    with conn.transaction():
        conn.execute(q("lock_event_key"), {"key": key})
        row = conn.execute(q("send_event"), {"key": key, "payload": payload}).fetchone()
    assert row is not None
    return EventSent(int(row["event_id"]), row["delivered_to"])


if not TYPE_CHECKING:

    def __getattr__(name: str) -> object:
        """``SuspensionState``: the name this module always gave the type (public as
        ``tether.TaskSuspension``, rows.py), imported on first use like the reads' types."""
        if name == "SuspensionState":
            from tether.broker.rows import TaskSuspension

            return TaskSuspension
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def suspension_states(conn: Conn, task_ids: list[str]) -> dict[str, TaskSuspension]:
    """The state of each of ``task_ids`` that is PENDING after a sleep or a wait (others absent):
    tether task ID, tether tasks, ``TaskInfo.suspension`` and the dashboard's task page."""
    from tether.broker.rows import TaskSuspension

    rows = conn.execute(q("suspension_states"), {"ids": task_ids}).fetchall()
    return {
        row["id"]: TaskSuspension(
            row["id"],
            row["run_at"],
            row["event_key"],
            row["waiting_for"] is not None,
            row["until"],
            row["after_step"],
        )
        for row in rows
    }
