"""An async send's own connection: one per event loop, for the sends it makes one at a time.

``send_async()`` on the app's pool runs the sync send in a thread (offload.py says why the
async API has no async pool). The hand-off to the thread and back costs about 85 us, and
more on a busy machine: with one send in flight at a time, a third of what a durable commit
takes. So a loop that sends a second time opens one ``AsyncConnection`` for itself (the
pool's settings: autocommit, dict rows, the session limits), and a send that finds it free
writes on it directly. A loop's first send takes the pool path: ``asyncio.run(send_async())``
called again and again makes a new loop each time, and must not pay a connect per send.
A send that finds it in use (sends in flight together) goes to the pool in a thread as
before, so concurrency is what it was.

What an AsyncConnectionPool could not promise is kept: the connection is one object with no
task of its own, and closing it needs no loop (``close_all``, and a finalizer when its loop
is collected). A connection that fails under a statement is dropped; the send is then run
by the pool path, which treats a repeat that meets its own row as done. A connection that
cannot be opened makes sends take the pool path for a second before it is tried again.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import psycopg

from tether.db.connection import connect_async

W = TypeVar("W")

# After a failed connect, sends take the pool path for this long before the next try.
RETRY_CONNECT_AFTER_S = 1.0


class Tried(Enum):
    WRITTEN = "written"
    NOT_RUN = "not run"  # the connection was in use or could not be opened: nothing was sent
    LOST = "lost"  # the connection broke under the statement: it may have committed


@dataclass
class _Slot:
    conn: psycopg.AsyncConnection[Any] | None = None
    busy: bool = False
    down_until: float = 0.0
    sends: int = 0  # asked for so far (the first goes to the pool: see the module's doc)


def _finish(slot: _Slot) -> None:
    """Close a slot's connection without a loop (libpq's close is synchronous)."""
    conn, slot.conn = slot.conn, None
    if conn is not None and not conn.closed:
        conn.pgconn.finish()


class LoopConnections:
    """One connection per event loop, for one statement at a time."""

    def __init__(self, url: Callable[[], str], config: Any) -> None:
        self._url = url  # the broker's (resolved on first use: it may start the embedded server)
        self._config = config
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Slot] = weakref.WeakKeyDictionary()

    def _slot(self) -> _Slot:
        loop = asyncio.get_running_loop()
        with self._lock:
            if os.getpid() != self._pid:
                # A forked child: the parent's sockets are the parent's, never closed here.
                self._pid, self._slots = os.getpid(), weakref.WeakKeyDictionary()
            slot = self._slots.get(loop)
            if slot is None:
                slot = self._slots[loop] = _Slot()
                weakref.finalize(loop, _finish, slot)
            return slot

    async def run(
        self, write: Callable[[psycopg.AsyncConnection[Any]], Awaitable[W]]
    ) -> tuple[Tried, W | None]:
        """``write`` on this loop's connection if it is free; what became of it."""
        slot = self._slot()
        slot.sends += 1
        if slot.busy or slot.sends == 1 or time.monotonic() < slot.down_until:
            return Tried.NOT_RUN, None
        slot.busy = True
        try:
            if slot.conn is None or slot.conn.closed:
                try:
                    slot.conn = await connect_async(self._url(), self._config)
                except Exception:
                    slot.down_until = time.monotonic() + RETRY_CONNECT_AFTER_S
                    return Tried.NOT_RUN, None
            conn = slot.conn
            try:
                return Tried.WRITTEN, await write(conn)
            except psycopg.OperationalError:
                if not (conn.broken or conn.closed):
                    raise  # the statement's own error, on a live connection
                _finish(slot)
                return Tried.LOST, None
            except BaseException:
                if (
                    conn.broken
                    or conn.closed
                    or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
                ):
                    _finish(slot)  # cancelled mid-statement, or left in a transaction: not reusable
                raise
        finally:
            slot.busy = False

    def close_all(self) -> None:
        """Close every loop's connection (the app closes)."""
        with self._lock:
            slots = list(self._slots.values()) if os.getpid() == self._pid else []
            self._slots = weakref.WeakKeyDictionary()
        for slot in slots:
            _finish(slot)
