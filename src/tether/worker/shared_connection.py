"""One connection that several jobs of the worker's main process take turns on.

The reaper, the scheduler and startup reconciliation each run a short round in a thread
now and then: a reaper tick is one read on most workers (the fleet's pass is one worker's
job, reaper.py), a scheduler tick a few statements per slot or check interval. Each having
a connection of its own kept two server processes per worker waiting almost all the time.
They share one here (``tether-maintenance`` in pg_stat_activity), one round at a time.

What stays apart, and why (docs/workers.md#connections): the work listener's connection
sits in LISTEN; the heartbeat must write within its interval whatever else is running (a
reaper pass that waits on a lock, an hourly prune of many rows), and its timeout closes
its connection under whatever was using it; the claim loop's pool is async and on the
path of every task; a recorder's write (a dead child's task) retries for minutes through
an outage, holding its connection.

A round that fails lets the connection go (the next round opens another), as a service's
``close()`` does for a connection of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from tether.broker.types import Conn
from tether.config import AppConfig
from tether.db.connection import DedicatedConnection


class SharedConnection:
    """A DedicatedConnection used by one round at a time, from any thread."""

    def __init__(self, url: str, config: AppConfig, role: str) -> None:
        self.connection = DedicatedConnection(url, config, role)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def turn(self) -> Iterator[Conn]:
        """The connection, for one round; waits for the round of another job to end."""
        with self._lock:
            try:
                yield self.connection.get()
            except BaseException:
                self.connection.close()  # it may be broken: the next round opens a new one
                raise

    def close(self) -> None:
        """Let the connection go once no round uses it (blocks: call it from a thread)."""
        with self._lock:
            self.connection.close()
