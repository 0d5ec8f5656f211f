"""Which database a connection is on (identity.sql): for sends inside the caller's transaction."""

from __future__ import annotations

from dataclasses import dataclass

from tether.broker.queries import q
from tether.broker.types import AsyncConn, Conn, Row


@dataclass(frozen=True, slots=True)
class DatabaseIdentity:
    system_identifier: int  # the server (cluster), whatever address it is reached by
    database_oid: int
    tasks_table: int | None  # tether_tasks as the connection's search_path finds it; None: not found
    database: str  # the rest describes it in errors
    address: str
    search_path: str

    def same_tables(self, other: DatabaseIdentity) -> bool:
        """True when both connections reach the same tether_tasks table."""
        return (
            self.system_identifier == other.system_identifier
            and self.database_oid == other.database_oid
            and self.tasks_table == other.tasks_table
        )

    def describe(self) -> str:
        return f"database {self.database!r} at {self.address} (server {self.system_identifier})"


def database_identity(conn: Conn) -> DatabaseIdentity:
    return _identity(conn.execute(q("database_identity")).fetchone())


async def database_identity_async(conn: AsyncConn) -> DatabaseIdentity:
    cursor = await conn.execute(q("database_identity"))
    return _identity(await cursor.fetchone())


def _identity(row: Row | None) -> DatabaseIdentity:
    assert row is not None  # a SELECT without FROM returns one row
    return DatabaseIdentity(
        system_identifier=int(row["system_identifier"]),
        database_oid=int(row["database_oid"]),
        tasks_table=None if row["tasks_table"] is None else int(row["tasks_table"]),
        database=row["database"],
        address=row["address"],
        search_path=row["search_path"],
    )
