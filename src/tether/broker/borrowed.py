"""Running tether's statements on a connection the caller lends (docs/transactions.md).

The caller's connection stays the caller's: tether never commits, rolls back or closes
it. Its row and cursor factories may be anything (tuples, a framework's own cursor
class), so while tether's statements run on it they are set to what the broker's
functions read (dict rows, psycopg's plain server-side-binding cursor) and put back
afterwards, whatever happens; behind a transaction pooler, so is its prepare_threshold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any, TypeGuard, cast

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from tether.broker.types import AsyncCallerConn, AsyncConn, CallerConn, Conn


class LentState(Enum):
    """Whether a lent connection can take a send that commits with the caller's transaction."""

    READY = "ready"  # in a transaction, or not in autocommit (the next statement begins one)
    AUTOCOMMIT = "autocommit"  # autocommit and no transaction open: a statement would commit at once
    ABORTED = "aborted"  # a statement failed; the transaction only accepts ROLLBACK now
    BUSY = "busy"  # a statement of the caller's is still running on it
    CLOSED = "closed"


def lent_state(conn: CallerConn | AsyncCallerConn) -> LentState:
    if conn.closed or conn.broken:
        return LentState.CLOSED
    status = conn.info.transaction_status
    if status == TransactionStatus.INERROR:
        return LentState.ABORTED
    if status == TransactionStatus.ACTIVE:
        return LentState.BUSY
    if status == TransactionStatus.IDLE and conn.autocommit:
        return LentState.AUTOCOMMIT
    if status in (TransactionStatus.IDLE, TransactionStatus.INTRANS):
        return LentState.READY
    return LentState.CLOSED  # UNKNOWN: the connection is bad


@contextmanager
def borrowed(conn: CallerConn, *, prepare: bool = True) -> Iterator[Conn]:
    """The caller's connection, reading dict rows through psycopg's own cursor, for a moment.

    ``prepare`` False (tether behind a transaction pooler): tether's statements run unprepared
    on it, whatever its ``prepare_threshold``, which is put back afterwards.
    """
    with _factories(conn, psycopg.Cursor, prepare):
        yield cast(Conn, conn)


@contextmanager
def borrowed_async(conn: AsyncCallerConn, *, prepare: bool = True) -> Iterator[AsyncConn]:
    """As borrowed, for an async connection (setting the factories does no I/O)."""
    with _factories(conn, psycopg.AsyncCursor, prepare):
        yield cast(AsyncConn, conn)


@contextmanager
def _factories(conn: Any, cursor_factory: Any, prepare: bool) -> Iterator[None]:
    saved = (conn.row_factory, conn.cursor_factory, conn.prepare_threshold)
    conn.row_factory = dict_row
    conn.cursor_factory = cursor_factory
    if not prepare:
        conn.prepare_threshold = None
    try:
        yield
    finally:
        conn.row_factory, conn.cursor_factory, conn.prepare_threshold = saved


def is_sync_connection(value: object) -> TypeGuard[CallerConn]:
    return isinstance(value, psycopg.Connection)


def is_async_connection(value: object) -> TypeGuard[AsyncCallerConn]:
    return isinstance(value, psycopg.AsyncConnection)
