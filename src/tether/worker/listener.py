"""LISTEN for new work and wake the claim loop; reconnect with backoff when the connection drops."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import psycopg

from tether.config import PostgresConfig
from tether.db.connection import connect_async

log = logging.getLogger("tether.worker.listener")

CHANNEL = "tether_work"


async def listen_for_work(
    url: str,
    config: PostgresConfig,
    queues: set[str],
    on_work: Callable[[float | None], None],
    on_connected: Callable[[], None],
) -> None:
    """Call ``on_work(seconds_until_due)`` for every notification about one of ``queues``.

    Runs until cancelled. After every (re)connection ``on_connected`` is called,
    since notifications sent while disconnected are lost.
    """
    backoff = 0.1
    while True:
        try:
            conn = await connect_async(url, config)
            async with conn:
                await conn.execute(f"LISTEN {CHANNEL}")
                backoff = 0.1
                on_connected()
                async for note in conn.notifies():
                    queue, _, run_at = note.payload.partition(" ")
                    if queue in queues:
                        on_work(_seconds_until(run_at))
        except asyncio.CancelledError:
            raise
        except (psycopg.Error, OSError, ConnectionError) as exc:
            log.warning("work listener disconnected (%s); reconnecting in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


def _seconds_until(epoch: str) -> float | None:
    try:
        return float(epoch) - time.time()
    except ValueError:
        return None
