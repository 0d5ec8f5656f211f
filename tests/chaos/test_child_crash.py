"""A worker's child process dies mid-task (SIGKILL from outside, or os._exit in the task).

The worker's main process sees the death at once (process sentinel), records the task as
WORKER_CRASHED (or schedules its retry when the policy says so) without waiting for any
heartbeat to go stale, starts a replacement child and goes on working.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest

from tests.chaos.conftest import (
    APP,
    FAST,
    check_history,
    child_pids,
    db_now,
    run_pids,
    runs,
    token,
    wait_status,
)
from tests.conftest import WorkerFactory, wait_until

# The crash is seen through the child's sentinel, not by staleness: well under a second.
CRASH_SEEN_WITHIN = timedelta(seconds=1)


def wait_running_in_child(db: Any, worker: Any, task_id: Any, tok: str) -> int:
    """Until the task is RUNNING and its code has written the ledger; returns the child's pid."""
    wait_status(db, task_id, "RUNNING")
    wait_until(lambda: runs(db, tok) == 1, message=f"task {task_id} to write the ledger")
    (pid,) = run_pids(db, tok)
    assert pid in child_pids(worker), (pid, child_pids(worker))
    return pid


def assert_worker_goes_on(db: Any, chaos: ModuleType, worker: Any, dead_child: int) -> None:
    """The worker replaced the dead child and runs the next task to completion."""
    after = token()
    handle = chaos.app.tasks["hold"].send(after)
    result = handle.get(timeout=30)
    assert result.is_ok and result.ok == after, (result, worker.log())
    (pid,) = run_pids(db, after)
    assert pid != dead_child and pid in child_pids(worker)
    assert worker.proc.poll() is None
    check_history(db, handle.id)


@pytest.mark.smoke
@pytest.mark.timing
def test_kill_9_of_a_child_fails_its_task_at_once(db: Any, chaos: ModuleType, workers: WorkerFactory) -> None:
    worker = workers.start(APP, "--processes", "1", env=FAST)
    tok = token()
    handle = chaos.app.tasks["hold"].send(tok, 60)
    pid = wait_running_in_child(db, worker, handle.id, tok)

    killed_at = db_now(db)
    os.kill(pid, signal.SIGKILL)
    row = wait_status(db, handle.id, {"FAILED", "COMPLETED", "PENDING"}, timeout=10)

    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert row["failed_at"] - killed_at < CRASH_SEEN_WITHIN, (row["failed_at"], killed_at)
    assert row["result"]["err"]["code"] == "WORKER_CRASHED"
    assert row["retry_count"] == 0 and row["next_retry_at"] is None
    assert runs(db, tok) == 1
    row, (attempt,) = check_history(db, handle.id)
    assert attempt["attempt"] == 1 and attempt["worker_id"] == worker.worker_id
    assert attempt["started_at"] == row["started_at"]
    result = handle.get(timeout=5)
    assert result.is_err and result.err.code == "WORKER_CRASHED"
    assert "exited with code -9 holding 1 task(s)" in worker.log(), worker.log()

    assert_worker_goes_on(db, chaos, worker, pid)


@pytest.mark.timing
def test_kill_9_of_a_child_retries_a_task_whose_policy_says_so(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--processes", "1", env=FAST)
    tok = token()
    handle = chaos.app.tasks["hold_retry"].send(tok, 60, 0)  # 60 s the first time, 0 on the retry
    pid = wait_running_in_child(db, worker, handle.id, tok)

    killed_at = db_now(db)
    os.kill(pid, signal.SIGKILL)
    pending = wait_status(db, handle.id, "PENDING", timeout=10)  # the retry waits 1 s

    assert pending["retry_count"] == 1 and pending["error_code"] == "WORKER_CRASHED", pending
    assert pending["claimed_by_worker_id"] is None and pending["started_at"] is None
    (first,) = check_history(db, handle.id)[1]
    assert first["will_retry"] and first["error_code"] == "WORKER_CRASHED" and first["attempt"] == 1
    assert first["finished_at"] - killed_at < CRASH_SEEN_WITHIN
    assert pending["next_retry_at"] - first["finished_at"] == timedelta(seconds=1)

    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED" and row["result"] == {"ok": 2}, row
    assert row["started_at"] >= pending["next_retry_at"]
    assert runs(db, tok) == 2
    pids = run_pids(db, tok)
    assert pids[0] == pid and pids[1] != pid and pids[1] in child_pids(worker)
    row, attempts = check_history(db, handle.id)
    assert [(a["attempt"], a["outcome"], a["will_retry"]) for a in attempts] == [
        (1, "FAILED", True),
        (2, "COMPLETED", False),
    ]
    assert row["retry_count"] == 1 and row["attempt"] == 2

    assert_worker_goes_on(db, chaos, worker, pid)


def test_a_task_that_exits_its_child_is_a_crash(db: Any, chaos: ModuleType, workers: WorkerFactory) -> None:
    worker = workers.start(APP, "--processes", "1", env=FAST)
    plain, retried = token(), token()
    sent_at = db_now(db)
    crash = chaos.app.tasks["crash_child"].send(plain)
    once = chaos.app.tasks["crash_once"].send(retried)

    row = wait_status(db, crash.id, {"FAILED", "COMPLETED"}, timeout=30)
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert runs(db, plain) == 1
    (dead,) = run_pids(db, plain)
    assert row["failed_at"] - sent_at < timedelta(seconds=10)
    (attempt,) = check_history(db, crash.id)[1]
    assert attempt["outcome"] == "FAILED" and attempt["error_code"] == "WORKER_CRASHED"
    # The child may also hold its next task (pushed ahead): never started, so released.
    assert "exited with code 13 holding" in worker.log(), worker.log()

    row = wait_status(db, once.id, {"FAILED", "COMPLETED"}, timeout=30)
    assert row["status"] == "COMPLETED" and row["result"] == {"ok": 2}, row
    assert runs(db, retried) == 2
    row, attempts = check_history(db, once.id)
    assert [(a["outcome"], a["will_retry"], a["error_code"]) for a in attempts] == [
        ("FAILED", True, "WORKER_CRASHED"),
        ("COMPLETED", False, None),
    ]
    first_pid, second_pid = run_pids(db, retried)
    assert first_pid != second_pid and first_pid not in child_pids(worker)

    assert_worker_goes_on(db, chaos, worker, dead)


@pytest.mark.smoke
def test_tasks_handed_ahead_to_a_killed_child_go_back_and_run_once(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    """A busy child holds up to two tasks handed to it ahead of time. Killed, it ran none of
    them: they go back to PENDING and run once each, on its replacement."""
    worker = workers.start(APP, "--processes", "1", "--prefetch", "4", env=FAST)
    long = token()
    held = chaos.app.tasks["hold"].send(long, 60)
    pid = wait_running_in_child(db, worker, held.id, long)
    toks = [token() for _ in range(3)]
    waiting = [chaos.app.tasks["work"].send(t) for t in toks]
    # Claimed while the only child is busy: two are handed to it at once, one stays in the buffer.
    for handle in waiting:
        wait_status(db, handle.id, "CLAIMED")

    os.kill(pid, signal.SIGKILL)
    row = wait_status(db, held.id, {"FAILED", "COMPLETED"}, timeout=10)
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert "exited with code -9 holding 3 task(s)" in worker.log(), worker.log()

    for tok, handle in zip(toks, waiting, strict=True):
        result = handle.get(timeout=30)
        assert result.is_ok and result.ok == tok, (result, worker.log())
        assert runs(db, tok) == 1
        check_history(db, handle.id)
    assert all(p != pid for t in toks for p in run_pids(db, t))
