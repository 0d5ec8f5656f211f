"""Sends inside the caller's own transaction (docs/transactions.md): checking the connection
lent with ``with_options(connection=...)``, then running tether's statements on it.

Everything that can be refused is refused before tether's first statement on the
connection, so a refusal leaves the caller's transaction as it was. What is checked:
the kind of connection (psycopg 3, sync for send() and async for send_async()), its
state (a transaction tether's insert joins, not autocommit with none open, not
aborted, not busy, not closed), and, once per connection, that it reaches the very
tether_tasks table the app uses.
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tether.broker.borrowed import (
    LentState,
    borrowed,
    borrowed_async,
    is_async_connection,
    is_sync_connection,
    lent_state,
)
from tether.broker.broker import PostgresBroker
from tether.broker.identity import DatabaseIdentity, database_identity, database_identity_async
from tether.broker.types import AsyncCallerConn, AsyncConn, CallerConn, Conn
from tether.errors import InvalidOptionError, WrongDatabaseError
from tether.offload import in_thread

T = TypeVar("T")

# What each lent connection reached when first asked. A psycopg connection object is one
# server session for its whole life, so the answer holds until it is closed and collected.
_identities: weakref.WeakKeyDictionary[CallerConn | AsyncCallerConn, DatabaseIdentity] = (
    weakref.WeakKeyDictionary()
)

_HINTS = {
    "sqlalchemy": " (for SQLAlchemy, pass tether.contrib.sqlalchemy.psycopg_connection(session))",
    "django": " (for Django, pass django.db.connection.connection after connection.ensure_connection(),"
    " or use the Django tasks backend: docs/django.md)",
    "psycopg2": " (tether speaks psycopg 3 only: connect with psycopg, or SQLAlchemy's postgresql+psycopg)",
    "asyncpg": " (tether speaks psycopg 3 only: SQLAlchemy's postgresql+psycopg_async gives one)",
}


def check_connection(value: Any) -> CallerConn | AsyncCallerConn:
    """The ``connection=`` option: a psycopg 3 Connection or AsyncConnection, else a clear error."""
    if is_async_connection(value) or is_sync_connection(value):
        return value
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    hint = next((h for key, h in _HINTS.items() if key in kind.lower()), "")
    raise InvalidOptionError(
        f"connection must be a psycopg 3 Connection (or AsyncConnection, for send_async) with a "
        f"transaction open, got {kind}{hint}"
    )


def run_in(
    broker: PostgresBroker, conn: CallerConn | AsyncCallerConn, call: str, work: Callable[[Conn], T]
) -> T:
    """``work`` on the caller's sync connection, inside its transaction; ``call`` names the API."""
    if not is_sync_connection(conn):
        raise InvalidOptionError(
            f"{call} got an async connection (psycopg AsyncConnection); use the async form "
            f"({call.replace('()', '_async()')}), or lend a sync psycopg Connection"
        )
    _refuse_state(conn, call)
    with borrowed(conn, prepare=broker.config.prepares_statements) as lent:
        theirs = _identities.get(conn)
        if theirs is None:
            theirs = _identities[conn] = database_identity(lent)
        _check_same_database(broker.identity(), theirs, call)
        return work(lent)


async def run_in_async(
    broker: PostgresBroker,
    conn: CallerConn | AsyncCallerConn,
    call: str,
    work: Callable[[AsyncConn], Awaitable[T]],
) -> T:
    """``work`` on the caller's async connection, inside its transaction."""
    if not is_async_connection(conn):
        raise InvalidOptionError(
            f"{call} got a sync psycopg Connection; lend a psycopg AsyncConnection to the async form, "
            f"or call {call.replace('_async()', '()')} with the sync one"
        )
    _refuse_state(conn, call)
    # Asked in a thread only the first time: later sends must not pay a thread hop each.
    ours = broker.remembered_identity
    if ours is None:
        ours = await in_thread(broker.identity)
    with borrowed_async(conn, prepare=broker.config.prepares_statements) as lent:
        theirs = _identities.get(conn)
        if theirs is None:
            theirs = _identities[conn] = await database_identity_async(lent)
        _check_same_database(ours, theirs, call)
        return await work(lent)


def _refuse_state(conn: CallerConn | AsyncCallerConn, call: str) -> None:
    state = lent_state(conn)
    if state is LentState.READY:
        return
    why = {
        LentState.AUTOCOMMIT: "is in autocommit mode with no transaction open, so tether's insert would "
        "commit on its own at once; open one first (with conn.transaction(): ...) or send without "
        "connection=",
        LentState.ABORTED: "is in a failed transaction (an earlier statement raised): it accepts only "
        "ROLLBACK now",
        LentState.BUSY: "is running another statement",
        LentState.CLOSED: "is closed or broken",
    }[state]
    raise InvalidOptionError(f"{call}: the connection given with connection= {why}. Nothing was sent.")


def _check_same_database(ours: DatabaseIdentity, theirs: DatabaseIdentity, call: str) -> None:
    if theirs.same_tables(ours):
        return
    if theirs.system_identifier == ours.system_identifier and theirs.database_oid == ours.database_oid:
        found = (
            "cannot see tether's tables" if theirs.tasks_table is None else "finds another tether_tasks table"
        )
        raise WrongDatabaseError(
            f"{call}: the connection given with connection= is on tether's {ours.describe()}, but "
            f"{found} through its search_path ({theirs.search_path!r}; tether's is "
            f"{ours.search_path!r}). Set the same search_path on it. Nothing was sent."
        )
    missing = " (which has no tether tables)" if theirs.tasks_table is None else ""
    raise WrongDatabaseError(
        f"{call}: the connection given with connection= is on {theirs.describe()}{missing}, but this "
        f"app's tether uses {ours.describe()}. A send inside your transaction must go to tether's own "
        "database: lend a connection to it, or point tether at yours (PostgresConfig.database_url or "
        "TETHER_DATABASE_URL). Nothing was sent."
    )
