"""The worker main process's async connection pool, and the one way to run statements on it.

No liveness check before use: an idle worker polls once per poll interval, and a check
of a connection that sat idle since the last poll was one more round trip per poll.
Instead, a statement whose connection turns out dead (the server restarted, a failover,
pg_terminate_backend) runs again on another one, as PostgresBroker.run does for
producers. That is safe for every statement the main process runs here: registering,
stopping, the wait registration and the name lookup are idempotent; a claim either
never reached the server, or committed just before the connection broke, and then its
tasks sit CLAIMED with no claimer heartbeat until the reaper gives them back after
claimed_stale_threshold_ms (their code never ran): the same as when a connection dies
in the middle of a claim.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from psycopg_pool import AsyncConnectionPool

from tether.broker.types import AsyncConn, OperationalError
from tether.config import AppConfig
from tether.db.connection import worker_connection_options
from tether.db.read_only import AsyncPrimaryCursor

log = logging.getLogger("tether.worker.pool")

T = TypeVar("T")

MIN_SIZE, MAX_SIZE = 1, 3


class WorkerPool:
    def __init__(self, url: str, config: AppConfig) -> None:
        self.timeout = config.broker.connect_timeout_s
        self._pool: AsyncConnectionPool[AsyncConn] = AsyncConnectionPool(
            url,
            min_size=MIN_SIZE,
            max_size=MAX_SIZE,
            kwargs={**worker_connection_options(config, "worker"), "cursor_factory": AsyncPrimaryCursor},
            timeout=self.timeout,
            name="tether-worker",
            open=False,
        )

    async def open(self) -> None:
        await self._pool.open(wait=True, timeout=self.timeout)

    async def close(self) -> None:
        await self._pool.close()

    async def run(self, what: str, work: Callable[[AsyncConn], Awaitable[T]]) -> T:
        """``work`` on a pooled connection; again on another if that one turns out dead.

        Every connection of the pool may have died together (a restart): each dead one is
        discarded on its way back, so at most MAX_SIZE of them can fail in a row.
        """
        for tries_left in range(MAX_SIZE, -1, -1):
            async with self._pool.connection() as conn:
                try:
                    return await work(conn)
                except OperationalError as exc:
                    if not (conn.broken or conn.closed) or not tries_left:
                        raise
                    log.warning(
                        "%s: a pooled connection was dead (%s); running it again on another", what, exc
                    )
        raise AssertionError("unreachable: the last try raises")
