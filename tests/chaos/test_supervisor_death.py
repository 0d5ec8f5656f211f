"""kill -9 of a worker's MAIN process only (the supervisor), not of its whole group.

Two promises meet here (DESIGN.md sections 2 and 3):
- children die with their parent: no orphan keeps running task code that the rules will
  declare crashed (and may retry elsewhere);
- rule 4, "the process that ran the code records its outcome, so the death of a supervisor
  after the work finished never turns a success into a crash".
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from types import ModuleType
from typing import Any

import psutil
import pytest

from tests.apps.support import task_row
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
    worker_row,
)
from tests.conftest import WorkerFactory, wait_until

RECOVERED_WITHIN = timedelta(seconds=4)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timing
def test_children_die_with_their_supervisor(db: Any, chaos: ModuleType, workers: WorkerFactory) -> None:
    a = workers.start(APP, "--processes", "1", env=FAST)
    tok = token()
    handle = chaos.app.tasks["hold_then_mark"].send(tok, 3)
    wait_until(
        lambda: task_row(db, handle.id)["status"] == "RUNNING" and runs(db, tok) == 1,
        message="the task to run on A",
    )
    (child,) = run_pids(db, tok)
    assert child in child_pids(a)
    b = workers.start(APP, "--processes", "1", env=FAST)

    killed_at = db_now(db)
    os.kill(a.pid, signal.SIGKILL)  # the main process only
    a.proc.wait(timeout=10)
    wait_until(lambda: gone(child), timeout=2, message=f"A's child {child} to die with its parent")

    row = wait_status(db, handle.id, {"FAILED", "COMPLETED", "PENDING"}, timeout=15)
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert row["failed_at"] - killed_at < RECOVERED_WITHIN
    check_history(db, handle.id)
    # The code did not go on in an orphan: its last line would have run by now.
    wait_until(
        lambda: db_now(db) - row["started_at"] > timedelta(seconds=3.5),
        timeout=10,
        message="the task's code to be due",
    )
    assert runs(db, tok) == 1 and runs(db, tok + ":done") == 0
    wait_until(
        lambda: worker_row(db, a.worker_id)["status"] == "inactive",
        timeout=10,
        message="A to be marked inactive",
    )
    assert b.proc.poll() is None


def test_a_supervisor_dying_after_the_work_finished_does_not_turn_success_into_a_crash(
    db: Any, chaos: ModuleType, workers: WorkerFactory, stopped_groups: list[int]
) -> None:
    a = workers.start(APP, "--processes", "1", env=FAST)
    tok = token()
    handle = chaos.app.tasks["hold_then_mark"].send(tok, 1)
    wait_until(
        lambda: task_row(db, handle.id)["status"] == "RUNNING" and runs(db, tok) == 1,
        message="the task to run on A",
    )
    (child,) = run_pids(db, tok)

    # Freeze the supervisor (main process only) while the child finishes the task's code:
    # the supervisor is busy, hung, about to be OOM-killed. Then it dies.
    os.kill(a.pid, signal.SIGSTOP)
    stopped_groups.append(a.pid)
    wait_until(lambda: runs(db, tok + ":done") == 1, timeout=10, message="the task's code to finish")
    finished_at = db.execute(
        "SELECT at FROM tether_chaos_ledger WHERE token = %s", (tok + ":done",)
    ).fetchone()["at"]
    # The marker is the code's last side effect, not its end: the function still has to
    # return before the child lifts its die-with-parent guard (until then a supervisor's
    # death rightly kills it). It then blocks asking the frozen supervisor for its next
    # task, and stays blocked for as long as the supervisor is frozen; that state cannot
    # be seen from outside, so give it a second, far more than it needs.
    time.sleep(1.0)
    killed_at = db_now(db)
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait(timeout=10)
    wait_until(lambda: gone(child), timeout=10, message=f"A's child {child} to exit")

    b = workers.start(APP, "--processes", "1", env=FAST)  # recovers whatever A left behind
    row = wait_status(db, handle.id, {"FAILED", "COMPLETED"}, timeout=15)
    row, attempts = check_history(db, handle.id)
    assert row["status"] == "COMPLETED" and row["result"] == {"ok": tok}, (
        f"the task's code finished at {finished_at}, its supervisor was killed at {killed_at}, "
        f"and the task ended {row['status']} {row['error_code']}: {attempts}\nA's log:\n{a.log()}"
    )
    assert runs(db, tok) == 1
    assert [(x["attempt"], x["worker_id"], x["pid"]) for x in attempts] == [(1, a.worker_id, child)]
    assert b.proc.poll() is None
