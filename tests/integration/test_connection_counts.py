"""How many server connections each kind of tether process holds, counted in pg_stat_activity
(the test's own database) by the name each connection gives (application_name): a worker's
main process and each of its children, a producer's pool and its result listener, the
dashboard. docs/workers.md#connections gives these numbers and the formula for a fleet.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import threading
import urllib.request
import uuid
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psutil
import psycopg
import pytest

from tests.apps.support import load_app_module
from tests.conftest import WorkerFactory, wait_until
from tests.harness import REPO
from tether import AppConfig, PostgresConfig, Tether

APP = "tests.apps.aio:app"
# Tests' own connections (the ledger's, the db fixture's, the apps' pools) are not counted.
# By the name's first word: a listener's name also carries its worker's id.
SESSIONS = """
SELECT split_part(application_name, ' ', 1) AS name, count(*) AS n FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND application_name LIKE %s
  AND pid <> ALL(%s::int[])
GROUP BY 1
"""
WORKER_IDLE = {"tether-worker": 1, "tether-heartbeat": 1, "tether-listener": 1, "tether-maintenance": 1}

# Server sessions per application_name are what is counted: behind PgBouncer they are
# PgBouncer's, shared by every client and named by whichever used them last.
pytestmark = pytest.mark.direct_only(
    "counts each kind of process's server sessions by application_name; behind PgBouncer the "
    "server sessions are PgBouncer's, shared by all clients"
)


# Backend pids of sessions an earlier test left behind (see quiet_database): not counted.
foreign: set[int] = set()


def sessions(db: Any, pattern: str = "tether-%") -> dict[str, int]:
    rows = db.execute(SESSIONS, (pattern, sorted(foreign))).fetchall()
    return {
        r["name"]: int(r["n"]) for r in rows if r["name"] not in ("tether-test-ledger", "tether-chaos-ledger")
    }


def waiting_for_work(db: Any, worker_id: str | None) -> bool:
    row = db.execute(
        "SELECT count(*) AS n FROM tether_queue_waiters WHERE worker_id = %s", (worker_id,)
    ).fetchone()
    return bool(row and row["n"])


@pytest.fixture(autouse=True)
def quiet_database(db: Any) -> None:
    """The counts below are of the processes this test starts.

    Left out of them: the server sessions of a PgBouncer that an earlier test of this
    process started (tests/pgbouncer.py): PgBouncer keeps its server connections after its
    clients leave, named by the last client (CI saw a 'tether-worker' and a 'tether-child'
    of test_pgbouncer's here). Earlier tests' workers are killed by pid at their end and
    their sessions end a moment later: waited for. A session still open after that belongs
    to a process an earlier test failed to stop: left out too, and named in a warning with
    the test that started it, rather than failing this test for another's leak."""
    foreign.clear()
    foreign.update(pid for pid, command, _ in holders(db) if "pgbouncer" in command)
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not sessions(db), timeout=10, message="earlier tests' sessions to end")
    left = [h for h in holders(db) if h[0] not in foreign]
    if left:
        warnings.warn(f"tether sessions left by an earlier test: {left}", stacklevel=1)
        foreign.update(pid for pid, _, _ in left)


def holders(db: Any) -> list[tuple[int, str, str]]:
    """The tether sessions open now: (backend pid, the command of the process holding its
    client end, the test that started that process: its PYTEST_CURRENT_TEST, inherited)."""
    rows = db.execute(
        "SELECT pid, client_port FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND application_name LIKE 'tether-%%'"
    ).fetchall()
    by_port = {r["client_port"]: r["pid"] for r in rows}
    found = {r["pid"]: ("?", "?") for r in rows}
    for connection in psutil.net_connections(kind="tcp"):
        if connection.laddr and connection.laddr.port in by_port and connection.pid:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(connection.pid)
                test = process.environ().get("PYTEST_CURRENT_TEST", "?")
                found[by_port[connection.laddr.port]] = (" ".join(process.cmdline()), test)
    return [(pid, command, test) for pid, (command, test) in sorted(found.items())]


@pytest.fixture
def aio(database_url: str, db: Any) -> ModuleType:
    from tests.apps.support import ensure_ledger

    ensure_ledger(db)
    return load_app_module("aio", database_url)


def test_a_worker_holds_four_connections_idle_and_one_per_child_that_ran_a_task(
    db: Any, aio: ModuleType, workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--processes", "2", "--async-processes", "1", "--prefetch", "0")
    wait_until(
        lambda: waiting_for_work(db, worker.worker_id), timeout=30, message="the worker to wait for work"
    )

    # Idle: its pool's connection, the heartbeat, the work listener, and the one the
    # reaper, the scheduler and startup reconciliation take turns on. No child has one yet.
    # The pool keeps 1, but a busy start (its claim and its waiting registration at once)
    # can open a second, kept until it has been idle 10 minutes: never more than its 3.
    def idle_as_documented() -> bool:
        now = sessions(db)
        return 1 <= now.get("tether-worker", 0) <= 3 and {**now, "tether-worker": 1} == WORKER_IDLE

    wait_until(idle_as_documented, timeout=10, message=f"{WORKER_IDLE}, not {sessions(db)}")

    # Work for every child: two sync tasks that each hold a child, an async one that reports
    # progress. The pool may grow while tasks flow, never past its 3.
    wait_until(lambda: len(worker.task_children()) == 3, timeout=30, message="its three children to run")
    peak: dict[str, int] = {}
    # Sent together (one claim takes both), each holding a child for a second.
    handles = [*aio.sync_nap.send_many([(1.0,), (1.0,)]), aio.whoami.send(0.2)]

    def all_done() -> bool:
        for name, n in sessions(db).items():
            peak[name] = max(peak.get(name, 0), n)
        return all(h.info().status == "COMPLETED" for h in handles)

    wait_until(all_done, timeout=60, interval=0.05, message="the three tasks to complete")
    pids = {h.get(timeout=1).unwrap() for h in handles[:2]}
    assert len(pids) == 2, pids  # (two sync children ran them, one each)
    assert peak.get("tether-worker", 0) <= 3, peak

    # After: each sync child keeps the connection it opened for its first task; the async
    # child one for starts and outcomes and one for progress reports.
    after = sessions(db)
    assert {k: v for k, v in after.items() if k != "tether-worker"} == {
        "tether-heartbeat": 1,
        "tether-listener": 1,
        "tether-maintenance": 1,
        "tether-child": 3,
        "tether-child-progress": 1,
    }, after
    assert 1 <= after["tether-worker"] <= 3, after
    print(f"\nidle {WORKER_IDLE}; after tasks {after}; peak {peak}")


def test_a_producer_holds_its_pool_between_min_and_max_and_one_listener_while_it_waits(
    db: Any, database_url: str, basic: ModuleType
) -> None:
    name = f"producer-{uuid.uuid4().hex[:8]}"
    config = PostgresConfig(
        database_url=database_url, pool_min_size=2, pool_max_size=4, application_name=name
    )
    app = Tether(AppConfig(queues=["default"], broker=config))
    add = app.task("add")(lambda a, b: a + b)
    try:
        add.send(1, 2)
        # The pool opens pool_min_size connections; a send that came while they were being
        # opened may have made it grow by one more (psycopg_pool), never past pool_max_size.
        wait_until(
            lambda: 2 <= sessions(db, name).get(name, 0) <= 4,
            timeout=10,
            message=f"pool_min_size connections: {sessions(db, name)}",
        )

        # Sends that wait (a lock held here) each hold a pooled connection: the pool grows to
        # pool_max_size and no further; the other sends wait for a free one.
        with psycopg.connect(database_url) as blocker:
            blocker.execute("LOCK TABLE tether_tasks IN SHARE MODE")
            with concurrent.futures.ThreadPoolExecutor(8) as threads:
                sends = [threads.submit(add.send, i, i) for i in range(8)]
                wait_until(
                    lambda: (
                        db.execute(
                            "SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = %s"
                            " AND wait_event_type = 'Lock'",
                            (name,),
                        ).fetchone()["n"]
                        == 4
                    ),
                    timeout=10,
                    message="four sends waiting on the lock",
                )
                assert sessions(db, name) == {name: 4}
                blocker.rollback()
                assert all(s.result(timeout=30) for s in sends)

        # A handle that waits for its result (no worker runs here) listens on one connection more.
        waiting = add.send(2, 3)

        def wait_in_vain() -> None:
            with contextlib.suppress(Exception):  # it times out: no worker runs here
                waiting.get(timeout=3)

        waiter = threading.Thread(target=wait_in_vain)
        waiter.start()
        wait_until(
            lambda: (
                db.execute(
                    "SELECT count(*) AS n FROM pg_stat_activity"
                    " WHERE application_name = %s AND query LIKE 'LISTEN%%'",
                    (name,),
                ).fetchone()["n"]
                == 1
            ),
            timeout=10,
            message="the result listener",
        )
        assert sessions(db, name) == {name: 5}  # pool_max_size (its idle connections stay) + 1
        waiter.join(30)
    finally:
        app.close()
    wait_until(lambda: not sessions(db, name), timeout=10, message="the producer's connections to close")


@pytest.fixture
def dashboard(database_url: str) -> Iterator[tuple[str, str]]:
    name = f"dashboard-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TETHER_DATABASE_URL": database_url,
        "TETHER_APPLICATION_NAME": name,
        "TETHER_POOL_MAX_SIZE": "3",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "tether", "dashboard", "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("tether dashboard on http://127.0.0.1:"), line
        yield line.split(" on ", 1)[1].split(" ", 1)[0], name
    finally:
        process.terminate()
        process.wait(30)


def test_the_dashboard_holds_its_pool_and_no_more_however_many_pages_are_read_at_once(
    db: Any, dashboard: tuple[str, str], basic: ModuleType
) -> None:
    url, name = dashboard
    basic.add.send_many([(i, i) for i in range(50)])

    def read(path: str) -> int:
        with urllib.request.urlopen(url + path, timeout=30) as answer:
            json.loads(answer.read())
            return int(answer.status)

    peak = 0
    with concurrent.futures.ThreadPoolExecutor(12) as threads:
        pages = ["api/status", "api/tasks", "api/workers", "api/queues"] * 6
        reads = [threads.submit(read, page) for page in pages]
        while not all(r.done() for r in reads):
            peak = max(peak, sessions(db, name).get(name, 0))
        assert all(r.result() == 200 for r in reads)
    # Its pool (TETHER_POOL_MAX_SIZE=3 here, 10 by default): opened on the first read.
    held = sessions(db, name).get(name, 0)
    assert 1 <= held <= 3 and peak <= 3, (held, peak)
    print(f"\ndashboard: {held} held after 24 reads from 12 threads, peak {peak}")
