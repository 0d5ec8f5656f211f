"""Versioned schema migrations, applied once each, under an advisory lock.

Files ``migrations/NNNN_name.sql`` are applied in order, each in its own
transaction together with its row in ``tether_schema_version``, under a
transaction-level advisory lock. Concurrent starters (several workers booting
at once) serialise on the lock and the later ones find nothing left to do;
nothing is re-created on every boot.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import psycopg

from tether.errors import SchemaError

log = logging.getLogger("tether.migrate")

# An arbitrary, fixed key: "tether" migrations. Other advisory locks use other keys.
MIGRATION_LOCK_KEY = 0x7E7E_0001
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


@cache
def available() -> tuple[Migration, ...]:
    found = []
    for entry in resources.files("tether.db").joinpath("migrations").iterdir():
        m = _FILE.match(entry.name)
        if m:
            found.append(Migration(int(m[1]), m[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    if versions != list(range(1, len(found) + 1)):
        raise SchemaError(f"migration files are not numbered 1..n without gaps: {versions}")
    return tuple(found)


def latest_version() -> int:
    return available()[-1].version


def current_version(conn: psycopg.Connection[Any]) -> int:
    """The schema version of the database, 0 when tether was never installed there."""
    row = conn.execute("SELECT to_regclass('tether_schema_version') IS NOT NULL AS present").fetchone()
    if not row or not _first(row):
        return 0
    row = conn.execute("SELECT coalesce(max(version), 0) FROM tether_schema_version").fetchone()
    return int(_first(row)) if row else 0


def migrate(conn: psycopg.Connection[Any]) -> list[int]:
    """Apply every pending migration; returns the versions applied (empty if up to date).

    ``conn`` must be in autocommit mode: each migration runs in its own transaction.
    """
    if not conn.autocommit:
        raise ValueError("migrate() needs an autocommit connection")
    latest = latest_version()
    applied: list[int] = []
    while True:
        # The lock is taken anew in each migration's transaction, and ends with it: a session
        # lock held across transactions would, through a transaction pooler (PgBouncer), be
        # taken on one server session and "released" on another, staying held for good.
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
            conn.execute(
                "CREATE TABLE IF NOT EXISTS tether_schema_version ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            current = current_version(conn)
            if current > latest:
                raise SchemaError(
                    f"the database schema is at version {current}, newer than this tether "
                    f"knows ({latest}); upgrade tether on this machine"
                )
            mig = next((m for m in available() if m.version > current), None)
            if mig is None:
                return applied
            log.info("applying migration %04d_%s", mig.version, mig.name)
            try:
                conn.execute(mig.sql)
                conn.execute(
                    "INSERT INTO tether_schema_version (version, name) VALUES (%s, %s)",
                    (mig.version, mig.name),
                )
            except psycopg.Error as exc:
                raise SchemaError(f"migration {mig.version:04d}_{mig.name} failed: {exc}") from exc
        applied.append(mig.version)


def ensure_schema(conn: psycopg.Connection[Any], *, auto_migrate: bool) -> None:
    """Make sure the schema is current: migrate if allowed, else say what to run."""
    current = current_version(conn)
    latest = latest_version()
    if current == latest:
        return
    if current > latest:
        raise SchemaError(
            f"the database schema is at version {current}, newer than this tether "
            f"knows ({latest}); upgrade tether on this machine"
        )
    if not auto_migrate:
        raise SchemaError(
            f"the database schema is at version {current}, tether needs {latest}: "
            "run `tether migrate` (or set AppConfig(auto_migrate=True))"
        )
    migrate(conn)


def _first(row: Any) -> Any:
    # Rows may be tuples or dicts depending on the connection's row factory.
    if isinstance(row, dict):
        return next(iter(row.values()))
    return row[0]
