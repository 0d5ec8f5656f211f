"""kill -9 of a worker's whole process group (main process and children) while another lives.

Nothing of the dead worker is left to record anything: the survivor's reaper must find its
tasks by their stale heartbeats and recover them by the rules. RUNNING -> FAILED with
WORKER_CRASHED, or retried when the policy lists WORKER_CRASHED; CLAIMED -> PENDING (its
code never ran) and then run by the survivor, once.
"""

from __future__ import annotations

from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest

from tests.apps.support import task_row
from tests.chaos.conftest import (
    APP,
    CHECK_S,
    FAST,
    HEARTBEAT_S,
    RUNNING_STALE_S,
    check_history,
    child_pids,
    db_now,
    last_heartbeat,
    run_pids,
    runs,
    token,
    wait_all,
    wait_status,
    worker_row,
)
from tests.conftest import WorkerFactory, wait_until

# Stale threshold (2 s) + reaper check interval (1 s) + slack.
RECOVERED_WITHIN = timedelta(seconds=4)
# A worker is marked inactive when its heartbeat is 3 intervals old (3 s), by the next tick.
INACTIVE_WITHIN = timedelta(seconds=3 * HEARTBEAT_S + CHECK_S + 1)


def held_by(db: Any, task_id: Any, worker_id: str, want: str) -> bool:
    row = task_row(db, task_id)
    return row["status"] == want and row["claimed_by_worker_id"] == worker_id


@pytest.mark.timing
def test_a_killed_worker_s_tasks_are_recovered_by_the_survivor(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    hold, hold_retry = chaos.app.tasks["hold"], chaos.app.tasks["hold_retry"]
    a = workers.start(APP, "--processes", "2", "--prefetch", "2", env=FAST)
    t_fail, t_retry, t_c1, t_c2 = token(), token(), token(), token()
    # Claimed in this order: the first two run (60 s), the last two wait in A's buffer.
    fail = hold.send(t_fail, 60)
    retry = hold_retry.send(t_retry, 60, 0)
    claimed = [hold.send(t_c1, 0), hold.send(t_c2, 0)]
    wait_until(
        lambda: (
            runs(db, t_fail) == 1
            and runs(db, t_retry) == 1
            and held_by(db, fail.id, a.worker_id, "RUNNING")
            and held_by(db, retry.id, a.worker_id, "RUNNING")
            and all(held_by(db, h.id, a.worker_id, "CLAIMED") for h in claimed)
        ),
        message="A to run two tasks and hold two CLAIMED",
    )
    b = workers.start(APP, "--processes", "2", env=FAST)
    assert all(task_row(db, h.id)["claimed_by_worker_id"] == a.worker_id for h in [fail, retry, *claimed])
    # The stale check below is judged against A's last runner heartbeat: have one first
    # (on a loaded machine B can register before A's first heartbeat interval has passed).
    wait_until(
        lambda: last_heartbeat(db, fail.id, "runner") is not None,
        timeout=10,
        message="a runner heartbeat for the long task",
    )

    killed_at = db_now(db)
    a.kill()  # SIGKILL to A's whole process group, by pid

    # RUNNING, no retry policy: FAILED with WORKER_CRASHED, by B's reaper, after the threshold.
    row = wait_status(db, fail.id, {"FAILED", "COMPLETED", "PENDING"}, timeout=15)
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert row["failed_at"] - killed_at < RECOVERED_WITHIN, (row["failed_at"], killed_at)
    last_beat = last_heartbeat(db, fail.id, "runner")
    assert last_beat is not None and last_beat < killed_at
    assert row["failed_at"] - last_beat >= timedelta(seconds=RUNNING_STALE_S)  # not before it was stale
    row, (attempt,) = check_history(db, fail.id)
    assert (attempt["attempt"], attempt["worker_id"]) == (1, a.worker_id)
    assert "no runner heartbeat" in attempt["error_message"]
    assert runs(db, t_fail) == 1

    # RUNNING, policy retries WORKER_CRASHED: retried, and completed by B.
    row = wait_status(db, retry.id, {"FAILED", "COMPLETED"}, timeout=15)
    assert row["status"] == "COMPLETED" and row["result"] == {"ok": 2}, row
    row, attempts = check_history(db, retry.id)
    assert [(x["attempt"], x["outcome"], x["will_retry"], x["worker_id"]) for x in attempts] == [
        (1, "FAILED", True, a.worker_id),
        (2, "COMPLETED", False, b.worker_id),
    ]
    assert attempts[0]["error_code"] == "WORKER_CRASHED"
    assert attempts[0]["finished_at"] - killed_at < RECOVERED_WITHIN
    assert runs(db, t_retry) == 2 and run_pids(db, t_retry)[1] in child_pids(b)

    # CLAIMED, never started: back to PENDING, then run once, by B.
    wait_all(db, [h.id for h in claimed], {"COMPLETED", "FAILED"}, timeout=15)
    b_children = child_pids(b)
    for h, tok in zip(claimed, [t_c1, t_c2], strict=True):
        row, (attempt,) = check_history(db, h.id)
        assert row["status"] == "COMPLETED", row
        assert row["attempt"] == 2 and row["claimed_by_worker_id"] == b.worker_id  # A's claim was 1
        assert (attempt["attempt"], attempt["worker_id"]) == (2, b.worker_id)
        assert row["claimed_at"] - killed_at < RECOVERED_WITHIN, (row["claimed_at"], killed_at)
        assert run_pids(db, tok) == [attempt["pid"]] and attempt["pid"] in b_children

    # The dead worker is marked inactive; the survivor is still active.
    dead = wait_until(
        lambda: (r := worker_row(db, a.worker_id))["status"] == "inactive" and r,
        timeout=10,
        message="worker A to be marked inactive",
    )
    assert dead["inactive_at"] - killed_at < INACTIVE_WITHIN, (dead["inactive_at"], killed_at)
    assert worker_row(db, b.worker_id)["status"] == "active"
    assert b.proc.poll() is None


@pytest.mark.timing
def test_claimed_tasks_of_a_killed_worker_are_requeued_never_having_run(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    hold = chaos.app.tasks["hold"]
    a = workers.start(APP, "--processes", "1", "--prefetch", "5", env=FAST)
    running_tok = token()
    running = hold.send(running_tok, 60)
    toks = [token() for _ in range(5)]
    # Sent at once: a worker that already holds work claims only in batches.
    claimed = hold.send_many([(t, 0.3) for t in toks])
    wait_until(
        lambda: (
            runs(db, running_tok) == 1
            and held_by(db, running.id, a.worker_id, "RUNNING")
            and all(held_by(db, h.id, a.worker_id, "CLAIMED") for h in claimed)
        ),
        message="A to run one task and hold five CLAIMED",
    )
    # A's claimer heartbeats, not just the claim's time, are what goes stale.
    wait_until(
        lambda: all(last_heartbeat(db, h.id, "claimer") is not None for h in claimed),
        timeout=10,
        message="claimer heartbeats for the CLAIMED tasks",
    )
    b = workers.start(APP, "--processes", "2", env=FAST)

    killed_at = db_now(db)
    a.kill()
    assert all(runs(db, t) == 0 for t in toks)  # never ran on A

    wait_all(db, [h.id for h in claimed], {"COMPLETED", "FAILED"}, timeout=20)
    b_children = child_pids(b)
    first_claimed = min(task_row(db, h.id)["claimed_at"] for h in claimed)
    assert first_claimed - killed_at < RECOVERED_WITHIN, (first_claimed, killed_at)
    for h, tok in zip(claimed, toks, strict=True):
        row, (attempt,) = check_history(db, h.id)
        assert row["status"] == "COMPLETED" and row["result"] == {"ok": tok}, row
        assert row["attempt"] == 2 and attempt["attempt"] == 2, (row, attempt)
        assert attempt["worker_id"] == b.worker_id and row["claimed_by_worker_id"] == b.worker_id
        # Ran exactly once, in one of B's children, after B claimed it.
        assert run_pids(db, tok) == [attempt["pid"]] and attempt["pid"] in b_children
        (at,) = [
            r["at"]
            for r in db.execute("SELECT at FROM tether_chaos_ledger WHERE token = %s", (tok,)).fetchall()
        ]
        assert at >= row["claimed_at"] > killed_at

    row = wait_status(db, running.id, {"FAILED", "COMPLETED", "PENDING"}, timeout=15)
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert row["failed_at"] - killed_at < RECOVERED_WITHIN
    check_history(db, running.id)
    assert runs(db, running_tok) == 1
    wait_until(
        lambda: worker_row(db, a.worker_id)["status"] == "inactive",
        timeout=10,
        message="worker A to be marked inactive",
    )
