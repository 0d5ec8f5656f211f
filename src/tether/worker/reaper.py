"""The reaper: runs in every worker every check_interval_ms; one worker acts per tick.

A transaction-scoped advisory lock elects the acting worker for a tick; the
others see the lock taken and skip. Each step is bounded, so a tick's cost does
not depend on how much history the tables hold.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from tether.broker.queries import q
from tether.config import RecoveryConfig

log = logging.getLogger("tether.reaper")

BATCH = 1000


@dataclass
class TickReport:
    acted: bool = False
    expired: int = 0


async def reap_once(pool: AsyncConnectionPool[psycopg.AsyncConnection[dict[str, Any]]]) -> TickReport:
    report = TickReport()
    async with pool.connection() as conn, conn.transaction():
        row = await (await conn.execute(q("reaper_lock"))).fetchone()
        if not row or not row["acquired"]:
            return report
        report.acted = True
        row = await (await conn.execute(q("expire_pending"), {"limit": BATCH})).fetchone()
        report.expired = int(row["expired"]) if row else 0
    if report.expired:
        log.info("reaper: expired %d task(s) past good_until (TASK_EXPIRED)", report.expired)
    return report


async def reaper_loop(
    pool: AsyncConnectionPool[psycopg.AsyncConnection[dict[str, Any]]], config: RecoveryConfig
) -> None:
    interval = config.check_interval_ms / 1000
    while True:
        try:
            report = await reap_once(pool)
            # A full batch means more is waiting: go again at once rather than a tick later.
            if report.expired >= BATCH:
                continue
        except psycopg.Error as exc:
            log.error("reaper tick failed: %s; next try in %.1fs", exc, interval)
        await asyncio.sleep(interval)
