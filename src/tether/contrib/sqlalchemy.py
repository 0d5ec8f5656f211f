"""The psycopg 3 connection under a SQLAlchemy 2 Session or Connection, for a send inside its
transaction (docs/transactions.md)::

    with Session(engine) as session, session.begin():
        session.add(order)
        receipt.with_options(connection=psycopg_connection(session)).send(order.id)

The engine must use psycopg 3 (``postgresql+psycopg://`` or ``postgresql+psycopg_async://``).
Asking a Session for its connection begins its transaction if none had begun, as any
statement would; tether then writes in it, and the Session commits or rolls back as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tether.broker.borrowed import is_async_connection, is_sync_connection
from tether.broker.types import AsyncCallerConn, CallerConn
from tether.caller_transaction import check_connection
from tether.errors import InvalidOptionError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

try:
    from sqlalchemy import Connection
    from sqlalchemy.orm import Session
except ImportError as exc:  # an optional extra: say which one
    raise ImportError(
        "tether.contrib.sqlalchemy needs SQLAlchemy 2: pip install 'tether[sqlalchemy]'"
    ) from exc


def psycopg_connection(source: Session | Connection) -> CallerConn:
    """The psycopg ``Connection`` under a sync Session or Connection, in its current transaction."""
    if isinstance(source, Session):
        source = source.connection()
    if not isinstance(source, Connection):
        raise InvalidOptionError(
            f"psycopg_connection takes a SQLAlchemy Session or Connection, got {type(source).__name__}"
            " (for AsyncSession/AsyncConnection use psycopg_connection_async)"
        )
    _check_driver(source.dialect.driver)
    raw = check_connection(source.connection.driver_connection)
    assert is_sync_connection(raw)  # a sync engine's psycopg driver gives a sync connection
    return raw


async def psycopg_connection_async(source: AsyncSession | AsyncConnection) -> AsyncCallerConn:
    """The psycopg ``AsyncConnection`` under an AsyncSession or AsyncConnection, in its transaction."""
    # Imported here: SQLAlchemy's asyncio part needs greenlet, which sync users need not install.
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(source, AsyncSession):
        source = await source.connection()
    if not isinstance(source, AsyncConnection):
        raise InvalidOptionError(
            f"psycopg_connection_async takes a SQLAlchemy AsyncSession or AsyncConnection, got "
            f"{type(source).__name__} (for Session/Connection use psycopg_connection)"
        )
    _check_driver(source.dialect.driver)
    fairy = await source.get_raw_connection()
    raw = check_connection(fairy.driver_connection)
    assert is_async_connection(raw)  # an async engine's psycopg driver gives an async connection
    return raw


def _check_driver(driver: str) -> None:
    if driver not in ("psycopg", "psycopg_async"):
        raise InvalidOptionError(
            f"the SQLAlchemy engine uses the {driver!r} driver; tether sends inside a transaction on "
            "psycopg 3 only: create the engine with postgresql+psycopg:// (or +psycopg_async)"
        )
