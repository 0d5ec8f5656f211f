"""A libpq multi-host URL (docs/high-availability.md): the first host is down, the second is
the primary. Producers, a worker (main process and children) and the CLI connect through it
and write to the server that answers, with ``target_session_attrs=read-write`` as a failover
setup would have it."""

from __future__ import annotations

import socket
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.cli_support import run_json
from tests.conftest import WorkerFactory
from tether import AppConfig, PostgresConfig, TaskError, TaskResult, Tether

pytestmark = pytest.mark.direct_only("builds its URL from the server's own address, not PgBouncer's")


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def multi_host(url: str) -> str:
    """``url``'s database behind a dead first host: what a client sees while db1 is down."""
    info = conninfo_to_dict(url)
    host, port = info.get("host") or "127.0.0.1", info.get("port") or "5432"
    return (
        f"postgresql://{info.get('user', 'postgres')}@/{info['dbname']}"
        f"?host=127.0.0.1,{host}&port={closed_port()},{port}"
        "&target_session_attrs=read-write&connect_timeout=5"
    )


def test_a_multi_host_url_reaches_the_primary_for_sends_workers_and_commands(
    direct_url: str, db: psycopg.Connection[Any], workers: WorkerFactory, basic: ModuleType
) -> None:
    url = multi_host(direct_url)
    producer = Tether(AppConfig(queues=["default"], broker=PostgresConfig(database_url=url)))

    @producer.task("add")  # the worker runs tests.apps.basic's, bound to the same URL
    def add(a: int, b: int) -> TaskResult[int, TaskError]:
        raise AssertionError("runs in the worker only")

    handle = add.send(2, 3)
    workers.start("tests.apps.basic:app", "--processes", "1", env={"TETHER_DATABASE_URL": url})
    assert handle.get(timeout=30).unwrap() == 5
    row = db.execute("SELECT status, attempt FROM tether_tasks WHERE id = %s", (handle.id,)).fetchone()
    assert row is not None and (row["status"], row["attempt"]) == ("COMPLETED", 1)
    try:
        status = run_json(url, "status")
        assert {(c["queue"], c["status"]): c["n"] for c in status["counts"]} == {("default", "COMPLETED"): 1}
    finally:
        producer.close()
