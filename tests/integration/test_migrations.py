"""Schema migrations on databases of their own: concurrent starters, missing and newer schemas."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql

from tether import AppConfig, PostgresConfig, Tether
from tether.db.migrate import MIGRATION_LOCK_KEY, available, ensure_schema, latest_version, migrate
from tether.errors import SchemaError

pytestmark = pytest.mark.direct_only(
    "migrates databases of its own, made and reached directly on the server (test_pgbouncer.py "
    "migrates one through PgBouncer)"
)


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
    # Each migration was applied once, by one of the starters, in order (the lock is taken per
    # migration's transaction, so starters may take turns: see migrate()).
    assert len(applied) == 4 and sorted(v for mine in applied for v in mine) == every
    assert all(mine == sorted(mine) for mine in applied)
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


# -- migration 10: the indexes of the dashboard's unsuccessful-task lists ----------------------

# 60,000 tasks, made in id (time) order: every 50th FAILED (2%), every 5,000th of those with
# a rare code, every 200th CANCELLED, every 6,000th EXPIRED (0.02%), the rest COMPLETED.
HISTORY = """
INSERT INTO tether_tasks (id, name, queue, status, error_code, run_at, sent_at, enqueued_at, updated_at)
SELECT (lpad(to_hex((extract(epoch FROM ts) * 1000)::bigint), 12, '0') || '7'
        || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
       'task_' || (i % 34), 'default', st,
       CASE st WHEN 'FAILED' THEN CASE WHEN i % 5000 = 0 THEN 'RARE_CODE' ELSE 'TIMEOUT' END
               WHEN 'CANCELLED' THEN 'TASK_CANCELLED' WHEN 'EXPIRED' THEN 'TASK_EXPIRED' END,
       ts, ts, ts, ts
FROM (SELECT i, md5(i::text) AS h, timestamptz '2026-10-01' + i * interval '1 second' AS ts,
             CASE WHEN i % 6000 = 3 THEN 'EXPIRED' WHEN i % 50 = 0 THEN 'FAILED'
                  WHEN i % 200 = 7 THEN 'CANCELLED' ELSE 'COMPLETED' END AS st
      FROM generate_series(1, 60000) AS i) AS made
"""


def index_names(plan: Any) -> set[str]:
    """Every index an EXPLAIN (FORMAT JSON) plan reads."""
    found = set()
    if isinstance(plan, dict):
        if "Index Name" in plan:
            found.add(plan["Index Name"])
        for value in plan.values():
            found |= index_names(value)
    elif isinstance(plan, list):
        for value in plan:
            found |= index_names(value)
    return found


def test_migration_10_indexes_the_unsuccessful_tasks_already_there_and_the_lists_use_it(
    fresh_database: Callable[[], str],
) -> None:
    """Applied to a database with a history (as an upgrade meets it), the indexes take the rows
    already there, and the dashboard's statement (browse_tasks, planned with its values as it
    runs: unprepared) reads them for the filters that few rows match, with the same answer."""
    from psycopg.rows import dict_row

    from tether.broker.browse import TaskFilter, browse_tasks, page_params
    from tether.broker.queries import q
    from tether.result import TaskStatus

    url = fresh_database()
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        conn.execute(
            "CREATE TABLE tether_schema_version (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for mig in available()[:9]:  # the schema as version 9 left it
            with conn.transaction():
                conn.execute(mig.sql)
                conn.execute(
                    "INSERT INTO tether_schema_version (version, name) VALUES (%s, %s)",
                    (mig.version, mig.name),
                )
        conn.execute(HISTORY)
        assert migrate(conn) == list(range(10, latest_version() + 1))
        conn.execute("ANALYZE tether_tasks")
        for statuses, code, index in [
            (["FAILED"], "RARE_CODE", "tether_tasks_failed_code_idx"),
            (["FAILED"], "TIMEOUT", "tether_tasks_failed_code_idx"),
            (["EXPIRED"], None, "tether_tasks_unsuccessful_idx"),
            (["CANCELLED"], None, "tether_tasks_unsuccessful_idx"),
            (["FAILED", "CANCELLED", "EXPIRED"], None, "tether_tasks_unsuccessful_idx"),
            (["FAILED", "CANCELLED", "EXPIRED"], "RARE_CODE", "tether_tasks_unsuccessful_idx"),
        ]:
            where = TaskFilter(statuses=tuple(TaskStatus(s) for s in statuses), error_code=code)
            params = page_params(where, before=None, limit=51, scan=20_000)
            [row] = conn.execute(
                "EXPLAIN (FORMAT JSON) " + q("browse_tasks_indexed"), params, prepare=False
            ).fetchall()
            # The partial index for the scan (and maybe the primary key for the page's rows).
            used = index_names(row["QUERY PLAN"])
            assert used - {"tether_tasks_pkey"} == {index}, (statuses, code, used)
            shown = [r.id for r in browse_tasks(conn, where, before=None, limit=51).tasks]
            with conn.transaction():  # the same rows, read without any index
                conn.execute("SET LOCAL enable_indexscan = off")
                conn.execute("SET LOCAL enable_bitmapscan = off")
                conn.execute("SET LOCAL enable_indexonlyscan = off")
                expected = [
                    r["id"]
                    for r in conn.execute(
                        "SELECT id FROM tether_tasks WHERE status = ANY(%s)"
                        " AND (%s::text IS NULL OR error_code = %s) ORDER BY id DESC LIMIT 51",
                        (statuses, code, code),
                    ).fetchall()
                ]
            assert shown == expected and shown, (statuses, code)


# -- migration 12: autovacuum settings of the tables every task writes -------------------------


@pytest.mark.server_agnostic
def test_migration_12_gives_the_queue_tables_their_autovacuum_settings(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname, reloptions FROM pg_class WHERE relname = ANY(%s) AND relkind = 'r'",
            (["tether_tasks", "tether_task_attempts", "tether_heartbeats", "tether_workers"],),
        ).fetchall()
    options = {name: dict(o.split("=", 1) for o in opts or []) for name, opts in rows}
    assert options["tether_tasks"] == {
        "autovacuum_vacuum_threshold": "10000",
        "autovacuum_vacuum_scale_factor": "0.01",
        "autovacuum_analyze_threshold": "10000",
        "autovacuum_analyze_scale_factor": "0.02",
    }
    assert options["tether_task_attempts"]["autovacuum_vacuum_scale_factor"] == "0.02"
    assert options["tether_heartbeats"]["autovacuum_vacuum_scale_factor"] == "0.02"
    assert options["tether_workers"] == {
        "autovacuum_vacuum_threshold": "1000",
        "autovacuum_vacuum_scale_factor": "0",
    }
