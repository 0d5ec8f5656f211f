"""A server that refuses writes is a lost connection, on every connection tether opens.

In a failover the old primary often keeps its client sockets open while it turns
read-only (cloud services demote it in place; an operator sets
``default_transaction_read_only``), or a reconnect lands on a standby. Its answer to a
write is SQLSTATE 25006 (``read_only_sql_transaction``), an error about the statement,
not about the connection: left as it is, a recorder would take it for a failed write and
its task for a crash, and a pool would hand the same connection out again.

Here every cursor of tether's own connections (``cursor_factory``: the worker's dedicated
connections and pools, the producers' pool, the dashboard's) turns that error into
:class:`ServerReadOnlyError`, a ``psycopg.OperationalError``, after closing the connection.
Everything that already survives a lost connection then survives this too, unchanged: the
recorder reconnects and writes again (fenced), the pools discard the connection and run the
statement on another, the services back off and reconnect, and a reconnect through a
multi-host URL with ``target_session_attrs=read-write`` finds the new primary
(docs/high-availability.md). A connection the caller lends (docs/transactions.md) is the
caller's: its errors stay as they are.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from typing import Any, Self

import psycopg
import psycopg.errors
from psycopg.rows import Row

log = logging.getLogger("tether.db")

#: A refusal is logged at WARNING at most once per this many seconds per process (every
#: connection of a worker meets it at once in a failover); the others at DEBUG.
SAY_EVERY_S = 30.0


class ServerReadOnlyError(psycopg.OperationalError):
    """The server refused a write because it is read-only: a primary demoted or turned
    read-only in a failover, or a standby. The connection was closed; the next one is
    opened against the URL again."""


class _Said:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at: float | None = None
        self.quiet = 0  # refusals since, logged at DEBUG
        self.count = 0  # refusals met by this process, ever


_said = _Said()
# Connections closed here: psycopg_pool warns "discarding closed connection" when one comes
# back, which says nothing more than the line above already did.
_closed_here: weakref.WeakSet[Any] = weakref.WeakSet()


class _QuietDiscards(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            str(record.msg).startswith("discarding closed connection") and args and args[0] in _closed_here
        )


logging.getLogger("psycopg.pool").addFilter(_QuietDiscards())


def _where(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    with contextlib.suppress(Exception):
        return f"{conn.info.host}:{conn.info.port}"
    return "the server"


def refusals() -> int:
    """How many refusals this process has met: a long-lived connection that only reads (the
    work listener) looks, and reconnects when another connection met one since its own began."""
    return _said.count


def refused(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any], reason: str) -> ServerReadOnlyError:
    """Say (at most every SAY_EVERY_S) and count a read-only server met on ``conn``, which the
    caller closes; the error to raise."""
    where = _where(conn)
    _closed_here.add(conn)
    now = time.monotonic()
    with _said.lock:
        _said.count += 1
        loud = _said.at is None or now - _said.at >= SAY_EVERY_S
        if loud:
            quiet, _said.at, _said.quiet = _said.quiet, now, 0
        else:
            _said.quiet += 1
    if loud:
        log.warning(
            "PostgreSQL at %s refused a write: it is read-only (%s). A failover in progress, or the "
            "URL reaches a standby: this connection is dropped and the next one opened against the "
            "URL again (use a multi-host URL with target_session_attrs=read-write, "
            "docs/high-availability.md)%s",
            where,
            reason,
            f"; {quiet} more refusal(s) since the last line" if quiet else "",
        )
    else:
        log.debug("PostgreSQL at %s refused a write: it is read-only (%s)", where, reason)
    return ServerReadOnlyError(
        f"PostgreSQL at {where} is read-only ({reason}): a failover in progress, or a standby"
    )


def _reason(exc: psycopg.Error) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else "read-only"


class PrimaryCursor(psycopg.Cursor[Row]):
    """A cursor whose statements need the primary: a read-only refusal closes the connection
    and raises ServerReadOnlyError (a lost connection)."""

    def execute(self, *args: Any, **kwargs: Any) -> Self:
        try:
            return super().execute(*args, **kwargs)
        except psycopg.errors.ReadOnlySqlTransaction as exc:
            error = refused(self.connection, _reason(exc))
            with contextlib.suppress(psycopg.Error, OSError):
                self.connection.close()
            raise error from exc


class AsyncPrimaryCursor(psycopg.AsyncCursor[Row]):
    """PrimaryCursor for async connections."""

    async def execute(self, *args: Any, **kwargs: Any) -> Self:
        try:
            return await super().execute(*args, **kwargs)
        except psycopg.errors.ReadOnlySqlTransaction as exc:
            error = refused(self.connection, _reason(exc))
            with contextlib.suppress(psycopg.Error, OSError):
                await self.connection.close()
            raise error from exc
