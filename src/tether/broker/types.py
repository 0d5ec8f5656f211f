"""The database types every broker function speaks: rows, connections, pools and errors.

Code outside broker/ names these instead of psycopg's, so only the broker (and the few
places that open connections or LISTEN) depends on the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any, TypeVar

import psycopg
import psycopg.errors
from psycopg_pool import AsyncConnectionPool

Row = dict[str, Any]
R = TypeVar("R")
Conn = psycopg.Connection[Row]
AsyncConn = psycopg.AsyncConnection[Row]
AsyncPool = AsyncConnectionPool[AsyncConn]
#: A connection the caller owns and lends for one send (any row factory): docs/transactions.md.
CallerConn = psycopg.Connection[Any]
AsyncCallerConn = psycopg.AsyncConnection[Any]

#: Any error from the database or the driver.
DatabaseError = psycopg.Error
#: The connection is gone or unusable (server restart, network, pg_terminate_backend), or
#: the server refused to go on (e.g. a session timeout): the statement may be retried.
OperationalError = psycopg.OperationalError
#: The transaction was rolled back by the server (a deadlock, a serialization failure):
#: nothing was written, and the same statement may simply run again.
RolledBackError = psycopg.errors.TransactionRollback


def with_status(cls: Callable[..., R], row: Row, status: type[StrEnum], key: str = "status") -> R:
    """``cls(**row)`` with the row's ``key`` column (a status's text) as its ``status`` enum.

    Here, not in rows.py: the workflow engine's writes use it, and rows.py's public row types
    are imported only by the reads that return them."""
    row[key] = status(row[key])
    return cls(**row)
