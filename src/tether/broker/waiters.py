"""Who waits for new work (waiters.sql, migration 0005): sends NOTIFY only queues someone waits for."""

from __future__ import annotations

from collections.abc import Collection

from tether.broker.queries import q
from tether.broker.types import AsyncConn


async def register_waiting(
    conn: AsyncConn, worker_id: str, queues: list[str], slot_queues: Collection[str] = ()
) -> None:
    """Register ``worker_id`` as waiting for ``queues``, closing the lost-wakeup race; for a
    freed slot too on ``slot_queues`` (limited queues whose claim a slot limit held back).

    One transaction: the queues' advisory locks are taken exclusively first, which waits
    for sends in flight (they hold them shared until they commit; so do limited tasks' ends
    that check for slot waiters) and holds new ones back until the registration is visible
    to them.
    """
    params = {"worker_id": worker_id, "queues": queues, "slot_queues": sorted(slot_queues)}
    async with conn.transaction():
        await conn.execute(q("lock_queues_for_waiting"), params)
        await conn.execute(q("register_waiting"), params)


async def unregister_waiting(conn: AsyncConn, worker_id: str) -> None:
    await conn.execute(q("unregister_waiting"), {"worker_id": worker_id})


async def stop_waiting_for_slots(conn: AsyncConn, worker_id: str) -> None:
    """Still waiting for new work, no longer for a freed slot (no slot limit holds it back)."""
    await conn.execute(q("stop_waiting_for_slots"), {"worker_id": worker_id})
