"""SIGSTOP of a worker's whole process group for longer than the running threshold, then SIGCONT.

A stopped worker looks dead: the survivor recovers its tasks by the rules while it is
frozen. When it wakes up it still believes it holds them, and its children finish their
code and try to record it. Every one of those late writes is fenced (status + attempt +
owner) and must change nothing; the worker notices, says so, and goes on working.
"""

from __future__ import annotations

import os
import re
import signal
from datetime import timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import attempt_rows, task_row
from tests.chaos.conftest import (
    APP,
    FAST,
    check_history,
    db_now,
    run_pids,
    runs,
    token,
    wait_all,
    worker_row,
)
from tests.conftest import WorkerFactory, wait_until

TASK_SECONDS = 3.0  # A's running tasks: their code is over by the time A is continued


def late_write_seen(log: str, task_id: str) -> bool:
    """A's log says what became of its own attempt at ``task_id`` once it was continued."""
    patterns = [
        rf"WARNING .*lost task {task_id} .*nothing was changed",  # the child's fenced write matched nothing
        # the crash record matched nothing (one WARNING per dead child, its tasks grouped by outcome)
        rf"WARNING .*of dead \w+ child .*already settled elsewhere: [^;\n]*{task_id}",
    ]
    return any(re.search(p, log) for p in patterns)


@pytest.mark.timing
def test_a_stopped_worker_is_recovered_and_its_late_writes_change_nothing(
    db: Any, chaos: ModuleType, workers: WorkerFactory, stopped_groups: list[int]
) -> None:
    hold, hold_retry = chaos.app.tasks["hold"], chaos.app.tasks["hold_retry"]
    a = workers.start(APP, "--processes", "2", "--prefetch", "2", env=FAST)
    t_fail, t_retry, t_c1, t_c2 = token(), token(), token(), token()
    fail = hold.send(t_fail, TASK_SECONDS)
    retry = hold_retry.send(t_retry, TASK_SECONDS, 0)
    claimed = [hold.send(t_c1, 0), hold.send(t_c2, 0)]
    ids = [str(h.id) for h in (fail, retry, *claimed)]

    def a_holds_all() -> bool:
        rows = [task_row(db, i) for i in ids]
        return (
            runs(db, t_fail) == 1
            and runs(db, t_retry) == 1
            and [r["status"] for r in rows] == ["RUNNING", "RUNNING", "CLAIMED", "CLAIMED"]
            and all(r["claimed_by_worker_id"] == a.worker_id for r in rows)
        )

    wait_until(a_holds_all, message="A to run two tasks and hold two CLAIMED")
    b = workers.start(APP, "--processes", "2", env=FAST)
    stopped_at = db_now(db)
    os.killpg(a.pid, signal.SIGSTOP)
    stopped_groups.append(a.pid)

    # While A is frozen, B's reaper recovers everything A held, by the rules, and B runs
    # what may run again. Continue A only once its tasks' code would have finished too.
    wait_all(db, ids, {"COMPLETED", "FAILED"}, timeout=20, why="A's tasks to be recovered while A is stopped")
    wait_until(
        lambda: worker_row(db, a.worker_id)["status"] == "inactive",
        timeout=10,
        message="A to be marked inactive",
    )
    started = max(task_row(db, i)["claimed_at"] for i in ids[:2])
    wait_until(
        lambda: db_now(db) - started > timedelta(seconds=TASK_SECONDS + 0.5),
        timeout=10,
        message="A's task code to be due",
    )

    row, (attempt,) = check_history(db, fail.id)
    assert (row["status"], row["error_code"], attempt["worker_id"]) == (
        "FAILED",
        "WORKER_CRASHED",
        a.worker_id,
    )
    assert row["failed_at"] > stopped_at
    row, attempts = check_history(db, retry.id)
    assert row["status"] == "COMPLETED" and row["claimed_by_worker_id"] == b.worker_id, row
    assert [(x["attempt"], x["worker_id"], x["will_retry"]) for x in attempts] == [
        (1, a.worker_id, True),
        (2, b.worker_id, False),
    ]
    for h in claimed:
        row, (attempt,) = check_history(db, h.id)
        assert row["status"] == "COMPLETED" and attempt["worker_id"] == b.worker_id, row
    assert [runs(db, t) for t in (t_fail, t_retry, t_c1, t_c2)] == [1, 2, 1, 1]
    before = {i: (task_row(db, i), attempt_rows(db, i)) for i in ids}
    ledger_before = {t: run_pids(db, t) for t in (t_fail, t_retry, t_c1, t_c2)}

    os.killpg(a.pid, signal.SIGCONT)

    # A wakes up, heartbeats again (its row turns active), and its attempts at the two
    # tasks it was running end in fenced writes that match nothing.
    wait_until(
        lambda: worker_row(db, a.worker_id)["status"] == "active",
        timeout=10,
        message="A's registry row to be active again",
    )
    try:
        wait_until(
            lambda: all(late_write_seen(a.log(), i) for i in ids[:2]),
            timeout=15,
            message="A to try (and fail) to record the tasks it was running",
        )
    except AssertionError:
        raise AssertionError(f"A's log:\n{a.log()}") from None
    log = a.log()
    seen = re.search(r"WARNING .*lost task|isolating itself|has not stamped its heartbeat", log)
    assert seen, log
    assert a.proc.poll() is None, log

    after = {i: (task_row(db, i), attempt_rows(db, i)) for i in ids}
    for i in ids:
        assert after[i] == before[i], (i, before[i], after[i], log)
    assert {t: run_pids(db, t) for t in ledger_before} == ledger_before

    # A goes on working: with B stopped, A alone runs a new task.
    assert b.stop() == 0, b.log()
    new_tok = token()
    handle = hold.send(new_tok, 0)
    result = handle.get(timeout=30)
    assert result.is_ok, (result, a.log())
    row, (attempt,) = check_history(db, handle.id)
    assert row["claimed_by_worker_id"] == a.worker_id and attempt["worker_id"] == a.worker_id
    assert runs(db, new_tok) == 1
    assert worker_row(db, a.worker_id)["status"] == "active"


REAPER_LOCK_KEY = 2122188290  # broker/sql/recovery.sql: reaper_lock

# pg_locks shows the advisory locks of every database on the server: only this test's
# database counts (the reapers of tests running beside it take the same key in theirs).
LOCK_HOLDER = """
SELECT a.pid, a.application_name, a.state, a.xact_start, now() - a.xact_start AS open_for
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.classid = 0 AND l.objid = %s AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


@pytest.mark.timing
def test_a_worker_hung_in_the_middle_of_a_reaper_tick_does_not_stop_recovery(
    db: Any, database_url: str, chaos: ModuleType, workers: WorkerFactory, stopped_groups: list[int]
) -> None:
    """Only one reaper acts per tick (an advisory lock held to COMMIT). A worker that hangs while
    its reaper holds that lock (SIGSTOP here; a GC pause, a swap storm, a network black hole in
    life) must not stop every other worker from recovering tasks for as long as it hangs."""
    hold = chaos.app.tasks["hold"]
    a = workers.start(APP, "--processes", "1", "--prefetch", "1", env=FAST)
    t_run, t_claimed = token(), token()
    running = hold.send(t_run, 60)
    claimed = hold.send(t_claimed, 0)
    wait_until(
        lambda: (
            runs(db, t_run) == 1
            and task_row(db, running.id)["status"] == "RUNNING"
            and task_row(db, claimed.id)["status"] == "CLAIMED"
        ),
        message="A to run one task and hold one CLAIMED",
    )

    # Catch A's reaper inside its pass: a brief table lock makes its first write wait while
    # it holds the reaper lock; A is stopped right then, and the table lock released. SHARE
    # mode stops writes only: the scheduler, which takes turns with the reaper on one
    # connection, reads tether_tasks and must not be the one caught waiting.
    with psycopg.connect(database_url) as blocker:
        blocker.execute("LOCK TABLE tether_tasks IN SHARE MODE")
        holder = wait_until(
            lambda: db.execute(LOCK_HOLDER, (REAPER_LOCK_KEY,)).fetchone(),
            timeout=10,
            message="A's reaper to take the reaper lock",
        )
        assert holder["application_name"] == "tether-maintenance", holder
        os.killpg(a.pid, signal.SIGSTOP)
        stopped_groups.append(a.pid)
        blocker.rollback()
    stopped_at = db_now(db)
    b = workers.start(APP, "--processes", "1", env=FAST)

    def recovered() -> bool:
        return (
            task_row(db, running.id)["status"] == "FAILED"
            and task_row(db, claimed.id)["status"] == "COMPLETED"
        )

    try:
        wait_until(recovered, timeout=8, message="B to recover the tasks of hung worker A")
    except AssertionError as exc:
        holder = db.execute(LOCK_HOLDER, (REAPER_LOCK_KEY,)).fetchone()
        raise AssertionError(
            f"{exc}: stopped at {stopped_at}; running task now {task_row(db, running.id)['status']}, "
            f"claimed task now {task_row(db, claimed.id)['status']}; the reaper lock is held by {holder}\n"
            f"B's log:\n{b.log()}"
        ) from None
    row, _ = check_history(db, running.id)
    assert row["error_code"] == "WORKER_CRASHED" and row["failed_at"] - stopped_at < timedelta(seconds=5)
    assert runs(db, t_claimed) == 1
