"""The limited claim and the limits themselves (limited_claims.sql; docs/limits.md).

A flow-controlled queue (a row in tether_queue_limits) is claimed only here: one statement
that takes the locks, counts the slots in use (and the rates' tokens) with snapshots newer
than the locks (VOLATILE functions, migration 0016) and claims into the room left. Everything after the claim
(start, outcome, give-back, recovery) is the plain path's: a slot is the task's in-flight row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tether.broker.claims import TaskPayload
from tether.broker.queries import q
from tether.broker.types import AsyncConn, Conn, Row
from tether.limits import QueueLimits


@dataclass(slots=True)
class KeyCursor:
    """Where a worker's round-robin over one queue's keys stands, and what it last saw."""

    after: str = ""  # the next claim reads keys after this one ("": from the start)
    unkeyed: bool = True  # look for tasks without a key (the last look found some, or is old)
    # Weights across claims: the key served last, how many claims in a row served it, and
    # the cursor to use to serve it again (just before it) while that is under its weight.
    streak_key: str | None = None
    streak: int = 0


@dataclass(frozen=True, slots=True)
class LimitedClaim:
    """What one limited claim took, and whether it may have left work it could take now: a key
    another claimer held (skipped), or a key window that was full (more keys beyond it)."""

    tasks: list[TaskPayload]
    contended: bool
    more_keys: bool = False
    keys_locked: list[str] = field(default_factory=list)
    # A slot limit binds: the queue is at max_in_flight, or a key with due work is at per_key
    # (migration 22). Only then can a freed slot let this worker take more.
    held_back: bool = False


async def claim_limited(
    conn: AsyncConn,
    *,
    queue: str,
    worker_id: str,
    cursor: KeyCursor,
    limit: int,
    async_limit: int,
    async_names: list[str],
    skip_names: list[str],
    idle: int | None = None,
) -> LimitedClaim:
    """Claim from flow-controlled ``queue``: up to ``limit`` tasks not in ``async_names`` and up to
    ``async_limit`` in it, within every limit. ``idle``: how many of them children would start
    at once (None: all); the rest wait for a child, which the claim allows only while the
    queue and the key stay within half their limits. Moves ``cursor`` on. One statement: its
    own transaction on an autocommit connection."""
    wanted = limit + async_limit
    # The key window: 4 keys per task wanted, at least 8. Each key in it costs a probe for the
    # key, one for its head and one for its busy count, whether the claim takes from it or
    # not, so a small claim (the sync executor's, 1-3 tasks) reads a small window: measured,
    # a claim of 2 over 100 keys took 1.9 ms of server CPU with 8 keys against 3.5 ms with
    # 32 (docs/limits.md, "What it costs"). Tasks without a key are still looked for among
    # the first 32 due rows at least: they may sit behind keyed tasks at their limit.
    window = max(8, 4 * wanted)
    unkeyed_window = max(32, 4 * wanted)
    after = cursor.after
    # One statement, its own transaction (the caller's, if it opened one: the bench rolls
    # back): the locks, the counts after them, and the claim (limited_claims.sql).
    cur = await conn.execute(
        q("limited_claim"),
        {
            "queue": queue,
            "cursor": after,
            "window": window,
            "wanted": wanted,
            "skip_names": skip_names,
            "unkeyed": cursor.unkeyed,
            "unkeyed_window": unkeyed_window,
            "other_limit": limit,
            "async_limit": async_limit,
            "async_names": async_names,
            "worker_id": worker_id,
            "idle": wanted if idle is None else max(0, idle),
        },
    )
    claimed = await cur.fetchall()
    summary = claimed[0]
    keys: list[str] = list(summary["keys_locked"])
    weights = dict(zip(keys, summary["weights"], strict=True))
    contended = bool(summary["contended"])
    more_keys = bool(summary["window_full"])
    window_end = (summary["window_end"] or "") if more_keys else cursor.after
    tasks = [TaskPayload.from_row(row) for row in claimed if row["id"] is not None]
    # The next claim starts after the last key (in turn) this one took a task of: round-robin.
    # With none taken, after this window when more keys lie beyond it, else where it was (a
    # claim with no room for the keys' kind of task must not lose the turn).
    served = {row["concurrency_key"] for row in claimed if row["id"] is not None}
    last = next((k for k in reversed(keys) if k in served), None)
    _move_cursor(cursor, after, keys, last, weights.get(last or "", 1.0), window_end)
    if cursor.unkeyed:
        cursor.unkeyed = bool(claimed and claimed[0]["unkeyed_seen"])
    return LimitedClaim(tasks, contended, more_keys, keys, bool(summary["held_back"]))


def _move_cursor(
    cursor: KeyCursor, after: str, keys: list[str], last: str | None, weight: float, window_end: str
) -> None:
    """Where the next claim starts: after ``last`` (the last key, in turn, this claim served),
    or just before it again while claims in a row that served it are fewer than its weight
    (a key of weight 3 is served by 3 claims of one task for every 1 of a key of weight 1).
    With none served, after this window when more keys lie beyond it, else where it was."""
    if last is None:
        cursor.after = window_end
        return
    cursor.streak = cursor.streak + 1 if last == cursor.streak_key else 1
    cursor.streak_key = last
    if cursor.streak < weight:
        place = keys.index(last)
        cursor.after = keys[place - 1] if place > 0 else after
    else:
        cursor.after, cursor.streak = last, 0
        cursor.streak_key = None


async def limited_queues(conn: AsyncConn, queues: list[str]) -> dict[str, float | None]:
    """Which of ``queues`` are flow-controlled now, each with the seconds one token of its rate
    takes to come back, the queue's or a key's, whichever is sooner (None: no rate limit)."""
    cur = await conn.execute(q("queue_limits_of"), {"queues": queues})
    found: dict[str, float | None] = {}
    for row in await cur.fetchall():
        token_s = [
            row[period] / 1000 / row[rate]
            for rate, period in (("rate_limit", "rate_period_ms"), ("key_rate_limit", "key_rate_period_ms"))
            if row[rate]
        ]
        found[row["queue"]] = min(token_s) if token_s else None
    return found


async def declare_limits(conn: AsyncConn, limits: dict[str, QueueLimits], set_by: str) -> list[str]:
    """Write an app's declared limits (a worker at start); the queues whose row changed."""
    changed: list[str] = []
    for queue, lim in sorted(limits.items()):
        cur = await conn.execute(q("set_queue_limits"), _limit_params(queue, lim, set_by))
        changed += [row["queue"] for row in await cur.fetchall()]
    return changed


def set_limits(conn: Conn, queue: str, limits: QueueLimits, set_by: str) -> bool:
    """Declare or replace ``queue``'s limits; False if they were already exactly these."""
    return bool(conn.execute(q("set_queue_limits"), _limit_params(queue, limits, set_by)).fetchall())


def drop_limits(conn: Conn, queue: str) -> bool:
    """Make ``queue`` plain again (the plain claim takes it); False if it had no limits."""
    return bool(conn.execute(q("drop_queue_limits"), {"queue": queue}).fetchall())


def _limit_params(queue: str, lim: QueueLimits, set_by: str) -> dict[str, Any]:
    return {
        "queue": queue,
        "max_in_flight": lim.max_in_flight,
        "per_key": lim.per_key,
        "rate_limit": lim.rate_limit,
        "rate_period_ms": lim.rate_period_ms,
        "burst": lim.burst,
        "key_weights": json.dumps(lim.key_weights, sort_keys=True),
        "key_rate_limit": lim.key_rate_limit,
        "key_rate_period_ms": lim.key_rate_period_ms,
        "key_burst": lim.key_burst,
        "set_by": set_by,
    }


def prune_key_tokens(conn: Conn) -> int:
    """Drop per-key rate buckets that are full again, or whose queue has no per-key rate now
    (the reaper's pass); how many."""
    return conn.execute(q("prune_key_tokens")).rowcount


@dataclass(frozen=True, slots=True)
class LimitUse:
    """A queue's limits and their use now (``tether queues``, the dashboard)."""

    queue: str
    limits: QueueLimits
    set_by: str | None
    updated_at: datetime
    in_flight: int  # tasks of the queue CLAIMED or RUNNING
    keys_in_flight: int  # distinct keys among them
    busiest_key_in_flight: int
    keys_at_limit: int  # keys with per_key tasks in flight
    tokens: float | None  # the rate's tokens now (None: no rate limit)
    keys_out_of_tokens: int | None = None  # keys with less than one token of the per-key rate

    @classmethod
    def from_row(cls, row: Row) -> LimitUse:
        period = row["rate_period_ms"]
        key_period = row["key_rate_period_ms"]
        limits = QueueLimits(
            max_in_flight=row["max_in_flight"],
            per_key=row["per_key"],
            rate_limit=row["rate_limit"],
            rate_period_s=period / 1000 if period else 1.0,
            burst=row["burst"],
            key_weights=json.loads(row["key_weights"]),
            key_rate_limit=row["key_rate_limit"],
            key_rate_period_s=key_period / 1000 if key_period else 1.0,
            key_burst=row["key_burst"],
        )
        return cls(
            row["queue"],
            limits,
            row["set_by"],
            row["updated_at"],
            row["in_flight"],
            row["keys_in_flight"],
            row["busiest_key_in_flight"],
            row["keys_at_limit"],
            row["tokens"],
            row["keys_out_of_tokens"],
        )


def limit_uses(conn: Conn) -> list[LimitUse]:
    """Every flow-controlled queue with its limits and their use now."""
    return [LimitUse.from_row(row) for row in conn.execute(q("all_queue_limits")).fetchall()]
