"""Schema migrations on databases of their own: concurrent starters, missing and newer schemas."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from tether import AppConfig, PostgresConfig, Tether
from tether.db.migrate import MIGRATION_LOCK_KEY, available, ensure_schema, latest_version, migrate
from tether.errors import SchemaError


@pytest.fixture
def fresh_database(server_url: str) -> Iterator[Callable[[], str]]:
    """make() creates an empty database and returns its URL; all are dropped afterwards."""
    made: list[str] = []

    def make() -> str:
        name = f"tether_mig_{secrets.token_hex(4)}"
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        made.append(name)
        parts = urlsplit(server_url)
        assert parts.scheme.startswith("postgres"), "these tests need a URL-style server URL"
        return urlunsplit(parts._replace(path="/" + name))

    yield make
    with psycopg.connect(server_url, autocommit=True) as conn:
        for name in made:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def versions(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return [
            (r[0], r[1])
            for r in conn.execute(
                "SELECT version, name FROM tether_schema_version ORDER BY version"
            ).fetchall()
        ]


def has_table(url: str, table: str) -> bool:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
        return bool(row and row[0])


def test_four_concurrent_migrations(fresh_database: Callable[[], str]) -> None:
    url = fresh_database()
    barrier = threading.Barrier(4)
    applied: list[list[int]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                barrier.wait(timeout=10)
                applied.append(migrate(conn))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    every = [m.version for m in available()]
    # One starter applied everything; the others found nothing left to do.
    assert sorted(applied, key=len) == [[], [], [], every]
    assert versions(url) == [(m.version, m.name) for m in available()]
    assert has_table(url, "tether_tasks") and has_table(url, "tether_task_attempts")
    with psycopg.connect(url, autocommit=True) as conn:
        assert migrate(conn) == []  # and again later: nothing
        held = conn.execute(
            # pg_locks spans the server: other databases' migrations take the same key
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (MIGRATION_LOCK_KEY & 0xFFFFFFFF,),
        ).fetchone()
        assert held == (0,)  # the lock was released
    assert len(versions(url)) == len(every)


def test_missing_schema_without_auto_migrate(fresh_database: Callable[[], str]) -> None:
    url = fresh_database()
    with psycopg.connect(url, autocommit=True) as conn, pytest.raises(SchemaError) as info:
        ensure_schema(conn, auto_migrate=False)
    message = str(info.value)
    assert "tether migrate" in message and f"tether needs {latest_version()}" in message
    assert "version 0" in message
    assert not has_table(url, "tether_schema_version") and not has_table(url, "tether_tasks")

    # The same through an app that does not migrate by itself: refused before any write.
    app = Tether(AppConfig(broker=PostgresConfig(database_url=url), auto_migrate=False))
    app.task("ping")(lambda: None)
    try:
        with pytest.raises(SchemaError, match="tether migrate"):
            app.tasks["ping"].send()
    finally:
        app.close()
    assert not has_table(url, "tether_tasks")

    # With auto_migrate (the default), the first use installs the schema.
    with psycopg.connect(url, autocommit=True) as conn:
        ensure_schema(conn, auto_migrate=True)
    assert [v for v, _ in versions(url)] == [m.version for m in available()]


def test_newer_schema_is_refused(fresh_database: Callable[[], str]) -> None:
    url = fresh_database()
    newer = latest_version() + 1
    with psycopg.connect(url, autocommit=True) as conn:
        migrate(conn)
        conn.execute(
            "INSERT INTO tether_schema_version (version, name) VALUES (%s, 'from_the_future')", (newer,)
        )
        for auto in (True, False):
            with pytest.raises(SchemaError) as info:
                ensure_schema(conn, auto_migrate=auto)
            message = str(info.value)
            assert f"version {newer}" in message and "newer" in message and "upgrade tether" in message
        with pytest.raises(SchemaError, match="newer"):
            migrate(conn)
        # The failed migrate released its lock: another session can take it at once.
        with psycopg.connect(url, autocommit=True) as other:
            got = other.execute("SELECT pg_try_advisory_lock(%s)", (MIGRATION_LOCK_KEY,)).fetchone()
            assert got == (True,)
    assert versions(url)[-1] == (newer, "from_the_future")

    app = Tether(AppConfig(broker=PostgresConfig(database_url=url)))
    app.task("ping")(lambda: None)
    try:
        with pytest.raises(SchemaError, match="newer"):
            app.tasks["ping"].send()
    finally:
        app.close()
