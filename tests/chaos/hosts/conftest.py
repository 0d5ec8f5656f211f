"""The many-host tests' fixtures: one lab and its PostgreSQL per test process, a database and
hosts per test (tests/hosts.py says how the lab works).

These tests never use the session's server: their workers must reach PostgreSQL over links
the test controls, so the lab runs its own (the embedded wheel's PostgreSQL 18). Hence they
are ``server_agnostic``: the external-server run (--subset server) would run them the same.
A machine that cannot make a lab fails them with what it lacks: they are never skipped.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from tests.hosts import Host, HostWorker, Lab, LabServer, problems
from tether import AppConfig, PostgresConfig, Tether
from tether.db.migrate import migrate

APP = "tests.apps.hosts:app"


@pytest.fixture(scope="session")
def lab() -> Iterator[Lab]:
    missing = problems()
    if missing:
        pytest.fail(
            "the many-host tests need what this machine lacks: " + "; ".join(missing)
            + ". As root, scripts/_hosts.sh installs it.",
            pytrace=False,
        )  # fmt: skip
    # Under /tmp, short: the server's Unix socket path must stay under 108 bytes.
    base = Path(tempfile.mkdtemp(prefix="tether-lab-", dir="/tmp"))
    try:
        with Lab(base) as started:
            yield started
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def lab_server(lab: Lab) -> Iterator[LabServer]:
    server = LabServer(lab).start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class LabDatabase:
    """A fresh database on the lab's server, for one test."""

    server: LabServer
    name: str
    conn: psycopg.Connection[dict[str, Any]]  # the test's own (Unix socket), autocommit
    app: Tether  # tests/apps/hosts.py's tasks, sending from the test process

    @property
    def url(self) -> str:
        return self.server.url(self.name)

    @property
    def host_url(self) -> str:
        return self.server.host_url(self.name)


@pytest.fixture
def lab_db(lab_server: LabServer) -> Iterator[LabDatabase]:
    from tests.apps.chaos import LEDGER_DDL
    from tests.apps.hosts import QUEUES, build

    name = f"hosts_{secrets.token_hex(4)}"
    with psycopg.connect(lab_server.url(), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    conn = psycopg.connect(lab_server.url(name), autocommit=True, row_factory=dict_row)
    migrate(conn)
    conn.execute(LEDGER_DDL)
    app = build(AppConfig(queues=QUEUES, broker=PostgresConfig(database_url=lab_server.url(name))))
    try:
        yield LabDatabase(lab_server, name, conn, app)
    finally:
        app.close()
        conn.close()
        with psycopg.connect(lab_server.url(), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class HostFactory:
    """Hosts of one test, and workers on them; all gone at the end of the test."""

    def __init__(self, lab: Lab, db: LabDatabase, logs: Path) -> None:
        self.lab = lab
        self.db = db
        self.logs = logs
        self.hosts: list[Host] = []

    def add(self, name: str, clock: str | None = None) -> Host:
        """A host serving queues ``default`` and ``name``; ``clock``: its FAKETIME ("+2h")."""
        host = Host.add(self.lab, name, clock)
        self.hosts.append(host)
        return host

    def worker(
        self,
        host: Host,
        *args: str,
        env: dict[str, str] | None = None,
        wait: bool = True,
        log_level: str = "INFO",
    ) -> HostWorker:
        """A started `tether worker` of tests/apps/hosts.py on ``host``; waits for its startup."""
        log = self.logs / f"worker-{host.name}-{len(host.workers)}.log"
        urls = (self.db.host_url, self.db.url)
        worker = host.worker(APP, urls, log, ("--queues", f"default,{host.name}", *args), env, log_level)
        worker.start()
        if wait:
            worker.wait_registered()
        return worker

    def close(self) -> None:
        for host in reversed(self.hosts):
            host.close()


@pytest.fixture
def hosts(lab: Lab, lab_db: LabDatabase, tmp_path: Path) -> Iterator[HostFactory]:
    factory = HostFactory(lab, lab_db, tmp_path)
    try:
        yield factory
    finally:
        factory.close()
