"""Children made by the worker's fork server (tether.worker.start_method, docs/workers.md).

By default a worker forks its fork server from its main process before the event loop
starts, and every child (at start-up and every replacement) is forked from that server:
each is the server's child, not the main process's. ``spawn`` makes them the old way.
What users rely on: the children are where the docs say; the server's death takes its
children with it and the worker records their tasks and goes on; a SIGTERM to the whole
process group (a service manager's stop) is a graceful stop, not the server's death.
"""

from __future__ import annotations

import os
import signal
import uuid
from types import ModuleType
from typing import Any

import psutil
import pytest

from tests.apps.support import runs, task_row
from tests.conftest import WorkerFactory, wait_until

APP = "tests.apps.basic:app"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def fork_server(main_pid: int) -> psutil.Process:
    """The main process's one child that is neither a task child nor the resource tracker."""
    (server,) = [
        p
        for p in psutil.Process(main_pid).children()
        if not any(word in " ".join(p.cmdline()) for word in ("resource_tracker", "spawn_main"))
    ]
    return server


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_children_are_the_fork_server_s_or_spawned_by_the_main_process(
    basic: ModuleType, db: Any, workers: WorkerFactory, method: str
) -> None:
    worker = workers.start(
        APP, "--processes", "2", "--async-processes", "0", env={"TETHER_WORKER_START_METHOD": method}
    )
    wait_until(lambda: len(worker.task_children()) == 2, message="its two children")
    children = worker.task_children()
    if method == "spawn":
        assert {c.ppid() for c in children} == {worker.pid}
        assert all("spawn_main" in " ".join(c.cmdline()) for c in children)
    else:
        server = fork_server(worker.pid)
        assert {c.ppid() for c in children} == {server.pid}
        # Forked from the main process (no new interpreter): the same command line.
        assert server.cmdline() == psutil.Process(worker.pid).cmdline()
    handle = basic.add.send(2, 3)
    assert handle.get(timeout=30).ok == 5
    assert worker.stop() == 0, worker.log()


def test_a_dead_fork_server_takes_its_children_and_the_worker_carries_on(
    basic: ModuleType, db: Any, workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--processes", "2", "--async-processes", "0")
    tok = uuid.uuid4().hex
    held = basic.sleep.send(60.0, tok)
    wait_until(
        lambda: task_row(db, held.id)["status"] == "RUNNING" and runs(db, tok) == 1,
        message="the task to run",
    )
    server = fork_server(worker.pid)
    children = [c.pid for c in worker.task_children()]
    assert len(children) == 2
    server.send_signal(signal.SIGKILL)
    # Their parent-death signal: no child goes on running task code unsupervised.
    wait_until(lambda: all(gone(pid) for pid in children), timeout=10, message="the server's children to die")
    wait_until(
        lambda: task_row(db, held.id)["status"] == "FAILED",
        timeout=30,
        message="the running task to be recorded as crashed",
    )
    assert task_row(db, held.id)["error_code"] == "WORKER_CRASHED"
    # New children, from a new server (started the standard way), run the next task.
    assert basic.add.send(1, 1).get(timeout=60).ok == 2
    assert not set(children) & {c.pid for c in worker.task_children()}
    assert worker.proc.poll() is None
    assert worker.stop() == 0, worker.log()


def test_sigterm_to_the_whole_process_group_lets_the_running_task_finish(
    basic: ModuleType, db: Any, workers: WorkerFactory
) -> None:
    """systemd's stop signals every process of the service: the fork server ignores it (its
    death would kill the children mid-task), the children leave it to the main process."""
    worker = workers.start(APP, "--processes", "1", "--async-processes", "0")
    tok = uuid.uuid4().hex
    handle = basic.sleep.send(1.5, tok)
    wait_until(
        lambda: task_row(db, handle.id)["status"] == "RUNNING" and runs(db, tok) == 1,
        message="the task to run",
    )
    os.killpg(worker.pid, signal.SIGTERM)
    assert worker.proc.wait(timeout=60) == 0, worker.log()
    worker.stopped = True
    row = task_row(db, handle.id)
    assert (row["status"], row["result"]) == ("COMPLETED", {"ok": 1.5}), (row, worker.log())


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_children_keep_their_start_up_out_of_garbage_collection(
    basic: ModuleType, db: Any, workers: WorkerFactory, method: str
) -> None:
    """worker/heap.py: a full collection walking every object of the imports stalled pickups;
    a child freezes them (gc.freeze) before its first task, sync and async alike."""
    worker = workers.start(
        APP, "--processes", "1", "--async-processes", "1", env={"TETHER_WORKER_START_METHOD": method}
    )
    sync_frozen = basic.freeze_count.send().get(timeout=30).ok
    async_frozen = basic.freeze_count_async.send().get(timeout=30).ok
    # tether, psycopg, pydantic and the app: tens of thousands of objects (none without the freeze).
    assert sync_frozen > 10_000 and async_frozen > 10_000, (sync_frozen, async_frozen)
    assert worker.stop() == 0, worker.log()
