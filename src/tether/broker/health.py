"""What the database says about tether's health (health.sql): what holds the MVCC horizon
back, each tether table's dead rows, last vacuum and size, each active worker's heartbeat and
work listener, and each queue's oldest due task. Facts only: tether.health judges them.

Every read is of the statistics views, of small tables, or of the claim index by its keys,
so none grows with the history (docs/health.md#cost).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from tether.broker.queries import q
from tether.broker.types import Conn


@dataclass(frozen=True, slots=True)
class HorizonHolder:
    """A session, prepared transaction or replication slot that holds the MVCC horizon back.

    kind: ``session``, ``prepared transaction`` or ``replication slot``. ``xmin_age``: how many
    transactions have started since the horizon it holds (the dead rows they leave cannot be
    removed while it holds it); ``transaction_age_s``: how long its transaction has been open
    (None for a slot, or when this role may not read another role's session: grant it
    pg_read_all_stats).
    """

    kind: str
    pid: int | None  # a session's backend pid; a slot's active walsender
    username: str | None
    application_name: str | None
    state: str | None  # a session's: 'idle in transaction', 'active', ...; a slot's: active or inactive
    backend_type: str | None  # a session's ('client backend', 'walsender', ...); a slot's type
    name: str | None  # a prepared transaction's gid, a slot's name
    transaction_age_s: float | None
    xmin_age: int | None

    def describe(self) -> str:
        """Who it is, in a few words an operator can act on."""
        if self.kind == "session":
            who = f"pid {self.pid}"
            details = [
                f"application {self.application_name!r}" if self.application_name else None,
                f"user {self.username}" if self.username else None,
                self.state,
                self.backend_type if self.backend_type != "client backend" else None,
            ]
            return f"session {who} ({', '.join(d for d in details if d)})"
        if self.kind == "prepared transaction":
            return f"prepared transaction {self.name!r} (owner {self.username})"
        return f"replication slot {self.name!r} ({self.backend_type}, {self.state})"


@dataclass(frozen=True, slots=True)
class TableStats:
    """One tether table as the statistics estimate it (no count), and its size on disk."""

    table_name: str
    live_rows: int
    dead_rows: int
    last_vacuum_at: datetime | None  # by hand or by autovacuum, whichever was last
    last_analyze_at: datetime | None
    vacuums: int
    table_bytes: int  # the heap with its TOAST
    index_bytes: int  # all its indexes

    @property
    def dead_fraction(self) -> float:
        """Dead rows as a share of all the rows the table holds (0 for an empty table)."""
        total = self.live_rows + self.dead_rows
        return self.dead_rows / total if total else 0.0


@dataclass(frozen=True, slots=True)
class WorkerLiveness:
    """An active worker: how old its heartbeat is, and whether its work listener is connected."""

    id: str
    hostname: str
    pid: int
    queues: list[str]
    last_heartbeat_at: datetime
    heartbeat_age_s: float
    listening: bool


@dataclass(frozen=True, slots=True)
class QueueLag:
    """A queue with PENDING tasks: how long its oldest due one has been due (None: none is due)."""

    queue: str
    oldest_due_age_s: float | None
    oldest_due_task_id: uuid.UUID | None
    paused: bool
    served: bool  # an active worker serves it
    # Flow-controlled (docs/limits.md): its tasks in flight now; None: not flow-controlled.
    limited_in_flight: int | None = None


def horizon_holders(conn: Conn) -> list[HorizonHolder]:
    """Everything holding this database's MVCC horizon back, the oldest horizon first."""
    return [HorizonHolder(**row) for row in conn.execute(q("horizon_holders"))]


def tether_tables(conn: Conn) -> list[TableStats]:
    """Each tether table of the current schema, by name."""
    return [TableStats(**row) for row in conn.execute(q("tether_tables"))]


def worker_liveness(conn: Conn) -> list[WorkerLiveness]:
    """Each active worker, the earliest started first."""
    return [WorkerLiveness(**row) for row in conn.execute(q("worker_liveness"))]


def queue_lag(conn: Conn) -> list[QueueLag]:
    """Each queue with PENDING tasks, by name."""
    return [QueueLag(**row) for row in conn.execute(q("queue_lag"))]
