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

from tether.broker.queries import q
from tether.broker.types import Conn

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


@dataclass(frozen=True, slots=True)
class SuspensionState:
    """A PENDING task after a sleep or a wait: what it waits for (tether task ID, tether tasks)."""

    task_id: str
    run_at: datetime  # when it is due
    event_key: str | None  # None: a sleep
    waiting: bool  # a wait still open (False: its event came, it is due)
    until: datetime | None  # the wait's timeout (None: none, or a sleep: see run_at)
    after_step: str | None  # the last step of its own it completed (None: none yet)

    def describe(self) -> str:
        after = f"after step {self.after_step!r}" if self.after_step else "before any step"
        if self.event_key is None:
            return f"sleeping until {_when(self.run_at)} ({after})"
        if not self.waiting:
            return f"event {self.event_key!r} delivered: resuming ({after})"
        timeout = "no timeout" if self.until is None else f"timeout at {_when(self.until)}"
        return f"waiting for event {self.event_key!r} ({timeout}; {after})"


    def as_json(self) -> dict[str, object]:
        """For tether task ID --json: the fields and the line describe() gives."""
        return {
            "run_at": self.run_at,
            "event_key": self.event_key,
            "waiting": self.waiting,
            "until": self.until,
            "after_step": self.after_step,
            "state": self.describe(),
        }

    def short(self) -> str:
        """For a list's status column (tether tasks)."""
        if self.event_key is None:
            return f"sleeping until {self.run_at:%H:%M:%S}"
        return f"waiting for {self.event_key!r}" if self.waiting else "event delivered"


def _when(at: datetime) -> str:
    return at.isoformat(sep=" ", timespec="seconds")


def suspension_states(conn: Conn, task_ids: list[str]) -> dict[str, SuspensionState]:
    """The state of each of ``task_ids`` that is PENDING after a sleep or a wait (others absent)."""
    rows = conn.execute(q("suspension_states"), {"ids": task_ids}).fetchall()
    return {
        row["id"]: SuspensionState(
            row["id"],
            row["run_at"],
            row["event_key"],
            row["waiting_for"] is not None,
            row["until"],
            row["after_step"],
        )
        for row in rows
    }
