"""Retention: delete what is past its retention, in small batches (retention.sql).

One batch is one statement and one commit: up to ``limit`` rows of one category, oldest
first from a time (``after``), and how far it read. worker/retention.py paces batches in
the worker's reaper; ``prune`` here is one pass from the start, for tests and tools.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from tether.broker.queries import q
from tether.broker.types import Conn
from tether.broker.workflows import prune_workflows
from tether.config import RecoveryConfig

log = logging.getLogger("tether.recovery")

#: From the start: the ``after`` of a pass that reads a category from its oldest row.
FROM_THE_START = datetime(1, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Batch:
    """What one batch did: rows deleted, rows read (a batch that read ``limit`` rows may have
    left more), and the newest time it read (None: it read nothing, or the category keeps no
    time to read from)."""

    deleted: int
    read: int
    reached: datetime | None


#: One batch of one category: (connection, age, limit, after) -> Batch.
Pruner = Callable[[Conn, timedelta, int, datetime], Batch]


def _batch(statement: str) -> Pruner:
    def delete(conn: Conn, age: timedelta, limit: int, after: datetime) -> Batch:
        row = conn.execute(q(statement), {"age": age, "limit": limit, "after": after}).fetchone()
        if row is None:
            return Batch(0, 0, None)
        return Batch(int(row["deleted"]), int(row["read"]), row["reached"])

    return delete


def _workflows(conn: Conn, age: timedelta, limit: int, after: datetime) -> Batch:
    """Finished workflows with their steps and their steps' tasks; few rows, read from the start."""
    deleted = prune_workflows(conn, age, limit)
    return Batch(deleted, deleted, None)


@dataclass(frozen=True, slots=True)
class Category:
    name: str  # as logged and returned by prune()
    delete: Pruner
    hours: Callable[[RecoveryConfig], int | None]  # its retention; None: never pruned


CATEGORIES = (
    Category("heartbeats", _batch("prune_heartbeats"), lambda c: c.heartbeat_retention_hours),
    Category("worker_states", _batch("prune_worker_states"), lambda c: c.worker_state_retention_hours),
    Category("workers", _batch("prune_workers"), lambda c: c.worker_state_retention_hours),
    Category("tasks", _batch("prune_terminal_tasks"), lambda c: c.terminal_record_retention_hours),
    Category("workflows", _workflows, lambda c: c.terminal_record_retention_hours),
    # The dashboard's recoveries per minute (migration 15) are history of the same age.
    Category(
        "recovery_minutes", _batch("prune_recovery_minutes"), lambda c: c.terminal_record_retention_hours
    ),
    # Events no task waited for (migration 18): kept as long as a finished task's record.
    Category("events", _batch("prune_events"), lambda c: c.terminal_record_retention_hours),
)


def prune(conn: Conn, config: RecoveryConfig, limit: int = 5_000, batches: int = 20) -> dict[str, int]:
    """One pass from the start: up to ``batches`` batches of ``limit`` rows per category;
    the rows deleted per category (those that deleted any). None in the config disables one."""
    deleted: dict[str, int] = {}
    for category in CATEGORIES:
        hours = category.hours(config)
        if hours is None:
            continue
        after, total = FROM_THE_START, 0
        for _ in range(batches):
            batch = category.delete(conn, timedelta(hours=hours), limit, after)
            total += batch.deleted
            after = batch.reached or after
            if batch.read < limit:
                break
        if total:
            deleted[category.name] = total
    if deleted:
        log.info("retention: pruned %s", ", ".join(f"{n} {label}" for label, n in deleted.items()))
    return deleted
