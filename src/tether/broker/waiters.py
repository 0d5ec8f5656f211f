"""Who waits for new work (waiters.sql, migration 0005): sends NOTIFY only queues someone waits for."""

from __future__ import annotations

from tether.broker.queries import q
from tether.broker.types import AsyncConn


async def register_waiting(conn: AsyncConn, worker_id: str, queues: list[str]) -> None:
    """Register ``worker_id`` as waiting for ``queues``, closing the lost-wakeup race.

    One transaction: the queues' advisory locks are taken exclusively first, which waits
    for sends in flight (they hold them shared until they commit) and holds new ones back
    until the registration is visible to them.
    """
    params = {"worker_id": worker_id, "queues": queues}
    async with conn.transaction():
        await conn.execute(q("lock_queues_for_waiting"), params)
        await conn.execute(q("register_waiting"), params)


async def unregister_waiting(conn: AsyncConn, worker_id: str) -> None:
    await conn.execute(q("unregister_waiting"), {"worker_id": worker_id})
