"""LISTEN for new work, schedule changes and operators' requests, and wake the claim loop,
the scheduler or the worker; reconnect with backoff when the connection drops."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tether.broker import notifications
from tether.broker.types import DatabaseError
from tether.config import AppConfig
from tether.db.connection import connect_worker_async

log = logging.getLogger("tether.worker.work_listener")


async def listen_for_work(
    url: str,
    config: AppConfig,
    queues: set[str],
    on_work: Callable[[float | None], None],
    on_connected: Callable[[], None],
    on_schedules: Callable[[], None],
    on_control: Callable[[str, list[str]], None],
) -> None:
    """Call ``on_work(seconds_until_due)`` for every notification of new work on one of
    ``queues``, ``on_schedules()`` for every change to a schedule of one of them, and
    ``on_control(verb, arguments)`` for every operator's request (notifications.py lists them).

    Runs until cancelled. After every (re)connection ``on_connected`` is called,
    since notifications sent while disconnected are lost.
    """
    backoff = 0.1
    while True:
        try:
            conn = await connect_worker_async(url, config, "listener")
            async with conn:
                await notifications.listen_worker_async(conn)
                backoff = 0.1
                on_connected()
                async for note in conn.notifies():
                    if note.channel == notifications.CONTROL_CHANNEL:
                        verb, *arguments = note.payload.split(" ")
                        on_control(verb, arguments)
                        continue
                    queue, _, run_at = note.payload.partition(" ")
                    if queue not in queues:
                        continue
                    if note.channel == notifications.SCHEDULES_CHANNEL:
                        on_schedules()
                    else:
                        on_work(_seconds_until(run_at))
        except asyncio.CancelledError:
            raise
        except (DatabaseError, OSError, ConnectionError) as exc:
            log.warning("work listener disconnected (%s); reconnecting in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


def _seconds_until(epoch: str) -> float | None:
    try:
        return float(epoch) - time.time()
    except ValueError:
        return None
