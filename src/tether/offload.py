"""How the async API calls the broker: its sync call, run in a thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")


async def in_thread(fn: Callable[..., R], *args: Any) -> R:
    """Run a sync broker call off the event loop.

    The async API deliberately uses the broker's sync pool through a thread, not a
    psycopg AsyncConnectionPool: such a pool belongs to one event loop, and a loop that
    ends (every asyncio.run() does) while the pool is still growing never finishes
    closing, because the pool retries the connect it was cancelled in (a hang of up to
    its 5-minute reconnect timeout), and each new loop would leak one more open pool.
    """
    return await asyncio.to_thread(fn, *args)
