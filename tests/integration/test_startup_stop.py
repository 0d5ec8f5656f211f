"""SIGTERM at any moment of a worker's start-up stops it cleanly.

Whenever the stop comes, the process exits 0, its registry row ends `stopped` (never left
`active`; no row at all if the stop came before it registered), its children are gone,
and nothing it claimed is left CLAIMED or RUNNING: each task sent beforehand is PENDING
again or COMPLETED, and ran at most once.

Each window of the start-up is hit on purpose, not by luck: TETHER_TEST_SIGTERM_AT=<step>
makes the worker send itself a real SIGTERM as it reaches that step (worker/main.py,
STARTUP_STEPS). Then from outside, as a supervisor would: the moment its row, its first
child or its LISTEN shows.
"""

from __future__ import annotations

import contextlib
import socket
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import psutil
import psycopg
import pytest

from tests.apps.support import runs
from tests.conftest import WorkerFactory, WorkerProcess, wait_until
from tether.worker.main import SIGTERM_AT_ENV, STARTUP_STEPS

APP = "tests.apps.basic:app"
MARK_ENV = "TETHER_TEST_PROCESS_MARK"  # inherited by every process of the worker's tree
WAIT = 60.0

Conn = psycopg.Connection[Any]


def marked_processes(mark: str) -> list[int]:
    """Pids of live processes whose environment carries ``mark`` (the worker and its children)."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.status() != psutil.STATUS_ZOMBIE and process.environ().get(MARK_ENV) == mark:
                found.append(process.pid)
    return found


def registry_rows(db: Conn, pid: int) -> list[dict[str, Any]]:
    rows = db.execute(
        "SELECT id, status, stopped_at FROM tether_workers WHERE pid = %s AND hostname = %s",
        (pid, socket.gethostname()),
    ).fetchall()
    return [dict(r) for r in rows]


def stop_during_startup(
    basic: ModuleType,
    db: Conn,
    workers: WorkerFactory,
    *,
    at_step: str | None = None,
    when: Callable[[WorkerProcess], bool] | None = None,
) -> tuple[WorkerProcess, list[dict[str, Any]], list[int]]:
    """Send three tasks, start a worker, stop it at ``at_step`` (its own SIGTERM) or as soon as
    ``when`` says (ours); check the promises; return the worker, its registry rows and the tasks' attempts."""
    tokens = [uuid.uuid4().hex for _ in range(3)]
    handles = basic.record.send_many([(t,) for t in tokens])
    mark = uuid.uuid4().hex
    env = {MARK_ENV: mark}
    if at_step is not None:
        env[SIGTERM_AT_ENV] = at_step
    worker = workers.start(APP, "--queues", "default", "--processes", "2", wait=False, env=env)
    if when is not None:
        wait_until(lambda: not worker.alive() or when(worker), WAIT, 0.005, "the moment to stop")
        worker.proc.terminate()  # SIGTERM
    code = worker.proc.wait(WAIT)
    worker.stopped = True  # exited: its pid must not be signalled again
    log = worker.log()
    assert code == 0, log
    assert "Traceback" not in log, log

    # Its children (and multiprocessing's helper) are gone with it.
    wait_until(lambda: not marked_processes(mark), 10, message="the worker's processes to be gone")

    rows = registry_rows(db, worker.pid)
    assert [r for r in rows if r["status"] != "stopped"] == [], (rows, log)
    assert all(r["stopped_at"] is not None for r in rows)
    assert len(rows) <= 1
    if rows:
        assert f"worker {rows[0]['id']} stopped after" in log, log

    # Nothing claimed is left behind: each task is back to PENDING or ran once, to the end.
    states = db.execute(
        "SELECT id::text AS id, status, attempt FROM tether_tasks WHERE id = ANY(%s::uuid[])",
        ([str(h.id) for h in handles],),
    ).fetchall()
    by_id = {r["id"]: r["status"] for r in states}
    for handle, tok in zip(handles, tokens, strict=True):
        status = by_id[str(handle.id)]
        assert status in ("PENDING", "COMPLETED"), (states, log)
        assert runs(db, tok) == (1 if status == "COMPLETED" else 0), (states, log)
    for handle in handles:  # leave nothing runnable to the next test
        handle.cancel()
    return worker, rows, [r["attempt"] for r in states]


@pytest.mark.parametrize("step", STARTUP_STEPS)
def test_sigterm_at_each_step_of_the_start_up_stops_the_worker_cleanly(
    basic: ModuleType, db: Conn, workers: WorkerFactory, step: str
) -> None:
    worker, rows, attempts = stop_during_startup(basic, db, workers, at_step=step)
    if step == "begin":
        assert rows == [], rows  # stopped before registering: nothing to undo
    else:
        assert len(rows) == 1, (rows, worker.log())
    # A stop before the claim loop claims nothing; at "claimed" the first claim came back.
    assert attempts == [1 if step == "claimed" else 0] * 3, (attempts, worker.log())


def _row_shows(worker: WorkerProcess) -> bool:
    with psycopg.connect(worker.database_url, autocommit=True) as conn:
        return bool(conn.execute("SELECT 1 FROM tether_workers WHERE pid = %s", (worker.pid,)).fetchone())


def _a_child_shows(worker: WorkerProcess) -> bool:
    return bool(worker.task_children())


def _listening(worker: WorkerProcess) -> bool:
    with psycopg.connect(worker.database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND query ILIKE 'LISTEN tether_work%%'"
        ).fetchone()
        return bool(row and row[0])


# Registered rows expected: the children are made beside the registration (docs/workers.md),
# so a child may show before the worker's row is written; stopped then, it leaves none, and
# stop_during_startup checks the same promises either way (nothing claimed left behind).
@pytest.mark.parametrize(
    ("moment", "registered"),
    [(_row_shows, {1}), (_a_child_shows, {0, 1}), (_listening, {1})],
    ids=["row", "first-child", "listening"],
)
def test_sigterm_from_outside_the_moment_a_start_up_step_shows(
    basic: ModuleType,
    db: Conn,
    workers: WorkerFactory,
    moment: Callable[[WorkerProcess], bool],
    registered: set[int],
) -> None:
    _, rows, _ = stop_during_startup(basic, db, workers, when=moment)
    assert len(rows) in registered, rows
