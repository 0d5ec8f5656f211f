"""One worker loses the database (the others do not) for longer than the running threshold.

The worker connects as its own login role; "the network goes" is that role losing its
right to log in and every connection it has being terminated, so each reconnect fails at
once, the way a refused connection does. The survivor declares the cut-off worker dead after
the stale threshold and recovers its tasks. The cut-off worker, which cannot know whether it
is the one that is dead, must fence itself off in that same time (DESIGN.md section 3): kill
its children, so that no code of a task that may be retried elsewhere keeps running, and
stop claiming. When the database comes back it writes nothing over the recovery and goes on.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any

import psutil
import pytest
from psycopg import sql

from tests.apps.support import attempt_rows, task_row
from tests.chaos.conftest import (
    APP,
    FAST,
    HEARTBEAT_S,
    RUNNING_STALE_S,
    check_history,
    child_pids,
    db_now,
    run_pids,
    runs,
    terminate,
    token,
    wait_all,
    worker_row,
)
from tests.conftest import WorkerFactory, wait_until

# The worker must give up its running tasks once its heartbeat has failed for the running
# threshold: it checks at each heartbeat tick, so threshold + one interval, plus slack.
FENCED_WITHIN = timedelta(seconds=RUNNING_STALE_S + HEARTBEAT_S + 0.5)


@pytest.mark.timing
def test_a_worker_cut_off_from_the_database_fences_itself(
    db: Any, chaos: ModuleType, workers: WorkerFactory, worker_role: tuple[str, str]
) -> None:
    role, role_url = worker_role
    hold, hold_retry, mark = (chaos.app.tasks[n] for n in ("hold", "hold_retry", "hold_then_mark"))
    a = workers.start(
        APP, "--processes", "2", "--prefetch", "1", env={**FAST, "TETHER_DATABASE_URL": role_url}
    )
    t_fail, t_retry, t_claimed = token(), token(), token()
    fail = mark.send(t_fail, 30)
    retry = hold_retry.send(t_retry, 30, 0)
    claimed = hold.send(t_claimed, 0)
    ids = [str(fail.id), str(retry.id), str(claimed.id)]

    def a_holds_all() -> bool:
        rows = [task_row(db, i) for i in ids]
        return (
            runs(db, t_fail) == 1
            and runs(db, t_retry) == 1
            and [r["status"] for r in rows] == ["RUNNING", "RUNNING", "CLAIMED"]
            and all(r["claimed_by_worker_id"] == a.worker_id for r in rows)
        )

    wait_until(a_holds_all, message="A to run two tasks and hold one CLAIMED")
    a_children = set(run_pids(db, t_fail) + run_pids(db, t_retry))
    assert len(a_children) == 2 and a_children <= child_pids(a)
    b = workers.start(APP, "--processes", "2", env=FAST)

    # The network goes: A can neither keep its connections nor open new ones.
    db.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))
    cut_at = db_now(db)
    assert terminate(db, role) >= 4  # pool, listener, reaper, recorders, children's, ledger's
    last_beat = worker_row(db, a.worker_id)["last_heartbeat_at"]

    fenced_at: list[datetime] = []

    def a_children_gone() -> bool:
        """A's children no longer run code: frozen by the fence (SIGSTOP) or gone."""
        running = set()
        for pid in a_children & child_pids(a):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_STOPPED:
                    running.add(pid)
            except psutil.NoSuchProcess:
                continue
        if not running:
            fenced_at.append(db_now(db))
            return True
        return False

    try:
        wait_until(a_children_gone, timeout=20, message="A to freeze its children (self-fencing)")
    except AssertionError:
        raise AssertionError(f"A's log:\n{a.log()}") from None
    assert "isolating itself" in a.log(), a.log()

    # Meanwhile B recovered A's tasks by the rules and ran what may run again.
    wait_all(db, ids, {"COMPLETED", "FAILED"}, timeout=20, why="A's tasks to be recovered by B")
    row, (attempt,) = check_history(db, fail.id)
    assert (row["status"], row["error_code"], attempt["worker_id"]) == (
        "FAILED",
        "WORKER_CRASHED",
        a.worker_id,
    )
    row, attempts = check_history(db, retry.id)
    assert row["status"] == "COMPLETED" and [x["worker_id"] for x in attempts] == [a.worker_id, b.worker_id]
    row, (attempt,) = check_history(db, claimed.id)
    assert row["status"] == "COMPLETED" and attempt["worker_id"] == b.worker_id
    assert runs(db, t_claimed) == 1

    # A fenced itself within the running threshold of its last heartbeat: by the time the
    # rules let B run the task again, A's copy of its code was no longer running.
    b_rerun_at = db.execute(
        "SELECT max(at) AS at FROM tether_chaos_ledger WHERE token = %s", (t_retry,)
    ).fetchone()["at"]
    assert fenced_at[0] - last_beat < FENCED_WITHIN, (
        f"A's last heartbeat {last_beat}, cut at {cut_at}, A's children still alive at "
        f"{fenced_at[0]} ({(fenced_at[0] - last_beat).total_seconds():.1f}s after its last heartbeat); "
        f"B re-ran the retried task at {b_rerun_at}\nA's log:\n{a.log()}"
    )
    assert runs(db, t_fail + ":done") == 0  # A's code was cut off, not finished
    before = {i: (task_row(db, i), attempt_rows(db, i)) for i in ids}

    # The network comes back: A writes nothing over the recovery, and goes on.
    db.execute(sql.SQL("ALTER ROLE {} LOGIN").format(sql.Identifier(role)))
    wait_until(lambda: "claiming resumes" in a.log(), timeout=20, message="A to rejoin")
    wait_until(
        lambda: all(re.search(rf"already settled elsewhere: [^;]*{i}", a.log()) for i in ids[:2]),
        timeout=20,
        message="A's crash records of its killed children to find the tasks settled",
    )
    assert {i: (task_row(db, i), attempt_rows(db, i)) for i in ids} == before
    assert worker_row(db, a.worker_id)["status"] == "active"
    assert b.stop() == 0, b.log()
    handle = hold.send(token(), 0)
    assert handle.get(timeout=30).is_ok, a.log()
    assert task_row(db, handle.id)["claimed_by_worker_id"] == a.worker_id
