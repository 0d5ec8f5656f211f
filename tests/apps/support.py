"""Helpers shared by the integration tests: loading the test apps, reading rows and the ledger."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg.rows import dict_row


def machinery_url(url: str | None = None) -> str:
    """Where the tests' machinery (ledgers, gates) connects: ``url`` (default the test database's
    TETHER_DATABASE_URL), or the same database directly (TETHER_TEST_DIRECT_URL) when that is
    the URL tether uses through PgBouncer: the machinery holds session locks and repeats
    statements, which a transaction pooler would break, and it observes tether, not tested."""
    tether = os.environ.get("TETHER_DATABASE_URL")
    direct = os.environ.get("TETHER_TEST_DIRECT_URL")
    # Only for the same database: a test that runs its own server (a restart, a private
    # database) gives its workers another TETHER_DATABASE_URL, and they inherit this variable.
    same = tether is not None and direct is not None and _database(tether) == _database(direct)
    if direct and same and (url is None or url == tether):
        return direct
    found = url or tether
    assert found, "no test database: the database_url fixture sets TETHER_DATABASE_URL"
    return found


def _database(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def load_app_module(name: str, database_url: str) -> ModuleType:
    """Import a test app module; it must be bound to the test database.

    The apps build their AppConfig at import time, reading TETHER_DATABASE_URL, which the
    `database_url` fixture sets: importing one at collection time would bind it to the
    embedded server instead. Test modules therefore import apps only through this function.
    """
    module = importlib.import_module(f"tests.apps.{name}")
    bound = module.app.config.broker.database_url
    assert bound == database_url, (
        f"tests.apps.{name} was imported before the test database existed (bound to {bound!r})"
    )
    return module


def ensure_ledger(conn: psycopg.Connection[Any]) -> None:
    """Create the ledger up front: concurrent CREATE TABLE IF NOT EXISTS in tasks can race."""
    conn.execute(
        "CREATE TABLE IF NOT EXISTS tether_test_ledger (token text, pid int, at timestamptz DEFAULT now())"
    )


def connect(database_url: str) -> psycopg.Connection[dict[str, Any]]:
    """A connection for the test's own looks: directly, also when tether goes through PgBouncer."""
    return psycopg.connect(machinery_url(database_url), autocommit=True, row_factory=dict_row)


@contextmanager
def clean_connection(database_url: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """A connection to a database emptied of tether rows, with the ledger in place (module fixtures)."""
    from tests.conftest import clean_tables

    with connect(database_url) as conn:
        clean_tables(conn)
        ensure_ledger(conn)
        yield conn


def task_row(conn: psycopg.Connection[Any], task_id: Any) -> dict[str, Any]:
    row = conn.execute("SELECT * FROM tether_tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None, f"no row for task {task_id}"
    return dict(row)


def attempt_rows(conn: psycopg.Connection[Any], task_id: Any) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT * FROM tether_task_attempts WHERE task_id = %s ORDER BY attempt", (task_id,)
    ).fetchall()
    return [dict(r) for r in rows]


def runs(conn: psycopg.Connection[Any], token: str) -> int:
    """How many times a task carrying ``token`` ran (rows in the ledger)."""
    row = conn.execute("SELECT count(*) AS n FROM tether_test_ledger WHERE token = %s", (token,)).fetchone()
    assert row is not None
    return int(row["n"] if isinstance(row, dict) else row[0])


def count_tasks(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) AS n FROM tether_tasks").fetchone()
    assert row is not None
    return int(row["n"] if isinstance(row, dict) else row[0])


def db_now(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT now() AS now").fetchone()
    assert row is not None
    return row["now"] if isinstance(row, dict) else row[0]


def workflow_steps(conn: psycopg.Connection[Any], workflow_id: Any) -> dict[str, dict[str, Any]]:
    """A workflow's steps by name, each with its task's state beside it (None before it exists)."""
    rows = conn.execute(
        "SELECT s.*, t.status AS task_status, t.attempt, t.started_at, t.completed_at,"
        " t.kwargs AS task_kwargs, t.queue AS task_queue, t.claimed_by_worker_id,"
        " (SELECT count(*) FROM tether_task_attempts a WHERE a.task_id = s.task_id) AS attempts"
        " FROM tether_workflow_tasks s LEFT JOIN tether_tasks t ON t.id = s.task_id"
        " WHERE s.workflow_id = %s ORDER BY s.node",
        (workflow_id,),
    ).fetchall()
    return {r["node_name"]: dict(r) for r in rows}


def find_workflow(conn: psycopg.Connection[Any], workflow_id: Any) -> dict[str, Any] | None:
    row = conn.execute("SELECT * FROM tether_workflows WHERE id = %s", (workflow_id,)).fetchone()
    return None if row is None else dict(row)


def workflow_row(conn: psycopg.Connection[Any], workflow_id: Any) -> dict[str, Any]:
    row = find_workflow(conn, workflow_id)
    assert row is not None, f"no workflow {workflow_id}"
    return row


def prepared_insert(bound: Any, args: tuple[Any, ...] = ()) -> tuple[Any, Any]:
    """A plain send of ``bound`` (a task's with_options view), checked and encoded but not run:
    its task id, and its insert to run on a connection the test holds (in a transaction it
    controls). Exactly what send() runs on the app's pool."""
    from tether.sending.one import OneSend

    plan = OneSend.prepare(bound._basis, timedelta(0), args, {})
    return plan.task_id, plan.write
