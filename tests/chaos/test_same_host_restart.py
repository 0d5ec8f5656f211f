"""A worker is restarted on the same host (a systemd unit, a pod's container) with the DEFAULT
recovery settings: stale thresholds of minutes.

The new worker's startup reconciliation sees that the old worker's process is gone (pid and
process start time) and recovers its tasks in seconds instead of minutes. A sibling worker
on the same host whose process is alive is never touched.
"""

from __future__ import annotations

from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest

from tests.apps.gate_locks import Gate, hold_gate
from tests.apps.support import task_row
from tests.chaos.conftest import (
    APP,
    check_history,
    child_pids,
    db_now,
    run_pids,
    runs,
    token,
    wait_all,
    wait_status,
    worker_row,
)
from tests.conftest import WorkerFactory, wait_until
from tether.config import RecoveryConfig

RECOVERED_WITHIN = timedelta(seconds=5)
GATE = 0x7E7E_0501


@pytest.mark.timing
def test_the_next_worker_on_the_host_recovers_a_killed_one_at_startup(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    defaults = RecoveryConfig()
    assert defaults.claimed_stale_threshold_ms >= 60_000 and defaults.running_stale_threshold_ms >= 60_000
    hold, hold_retry = chaos.app.tasks["hold"], chaos.app.tasks["hold_retry"]
    a = workers.start(APP, "--processes", "2", "--prefetch", "2")  # default thresholds: no env
    t_fail, t_retry = token(), token()
    fail = hold.send(t_fail, 120)
    retry = hold_retry.send(t_retry, 120, 0)
    toks = [token(), token()]
    claimed = [hold.send(t, 0) for t in toks]

    def a_holds_all() -> bool:
        rows = [task_row(db, h.id) for h in (fail, retry, *claimed)]
        return (
            runs(db, t_fail) == 1
            and runs(db, t_retry) == 1
            and [r["status"] for r in rows] == ["RUNNING", "RUNNING", "CLAIMED", "CLAIMED"]
            and all(r["claimed_by_worker_id"] == a.worker_id for r in rows)
        )

    wait_until(a_holds_all, message="A to run two tasks and hold two CLAIMED")
    killed_at = db_now(db)
    a.kill()  # SIGKILL to the whole group: A's registry row still says 'active'
    assert worker_row(db, a.worker_id)["status"] == "active"
    assert task_row(db, fail.id)["status"] == "RUNNING"

    b = workers.start(APP, "--processes", "2")
    registered = worker_row(db, b.worker_id)["started_at"]
    assert registered > killed_at

    row = wait_status(db, fail.id, {"FAILED", "COMPLETED", "PENDING"}, timeout=10)
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert row["failed_at"] - registered < RECOVERED_WITHIN, (row["failed_at"], registered)
    row, (attempt,) = check_history(db, fail.id)
    assert attempt["worker_id"] == a.worker_id and "on this host is gone" in attempt["error_message"]
    assert runs(db, t_fail) == 1

    row = wait_status(db, retry.id, {"FAILED", "COMPLETED"}, timeout=15)
    assert row["status"] == "COMPLETED" and row["result"] == {"ok": 2}, row
    row, attempts = check_history(db, retry.id)
    assert [(x["attempt"], x["worker_id"], x["will_retry"]) for x in attempts] == [
        (1, a.worker_id, True),
        (2, b.worker_id, False),
    ]
    assert attempts[0]["finished_at"] - registered < RECOVERED_WITHIN
    assert runs(db, t_retry) == 2

    wait_all(db, [h.id for h in claimed], {"COMPLETED", "FAILED"}, timeout=10)
    b_children = child_pids(b)
    for h, tok in zip(claimed, toks, strict=True):
        row, (attempt,) = check_history(db, h.id)
        assert row["status"] == "COMPLETED" and row["attempt"] == 2, row
        assert row["claimed_at"] - registered < RECOVERED_WITHIN
        assert attempt["worker_id"] == b.worker_id and run_pids(db, tok) == [attempt["pid"]]
        assert attempt["pid"] in b_children

    dead = worker_row(db, a.worker_id)
    assert dead["status"] == "inactive" and dead["inactive_at"] - registered < RECOVERED_WITHIN, dead
    summary = "startup reconciliation: 1 worker(s) marked inactive, 2 task(s) requeued, 1 retried, 1 failed"
    assert summary in b.log(), b.log()


def test_a_live_sibling_on_the_same_host_is_never_touched(
    db: Any, database_url: str, chaos: ModuleType, workers: WorkerFactory
) -> None:
    with hold_gate(database_url, GATE) as gate:
        sibling_kept(db, chaos, workers, gate)


def sibling_kept(db: Any, chaos: ModuleType, workers: WorkerFactory, gate: Gate) -> None:
    c = workers.start(APP, "--processes", "1", "--prefetch", "1")
    run_tok, wait_tok = token(), token()
    # Held until D's start-up is over, however long that takes on a loaded machine (a 4 s
    # hold once ended first, and the test saw C's own completion).
    running = chaos.app.tasks["hold_gated"].send(run_tok, GATE)
    queued = chaos.app.tasks["hold"].send(wait_tok, 0)
    wait_until(
        lambda: (
            task_row(db, running.id)["status"] == "RUNNING"
            and runs(db, run_tok) == 1
            and task_row(db, queued.id)["status"] == "CLAIMED"
        ),
        message="C to run one task and hold one CLAIMED",
    )
    before = {h.id: task_row(db, h.id) for h in (running, queued)}

    d = workers.start(APP, "--processes", "1")
    wait_until(lambda: "started: queues=" in d.log(), timeout=30, message="D to finish its startup")
    # D's reconciliation is over: C and what it holds are as they were.
    for h in (running, queued):
        row = task_row(db, h.id)
        assert (row["status"], row["attempt"], row["claimed_by_worker_id"], row["updated_at"]) == (
            before[h.id]["status"],
            before[h.id]["attempt"],
            c.worker_id,
            before[h.id]["updated_at"],
        ), row
    assert worker_row(db, c.worker_id)["status"] == "active"
    assert "startup reconciliation" not in d.log() and "is gone" not in d.log(), d.log()

    gate.open()
    wait_all(db, [running.id, queued.id], {"COMPLETED", "FAILED"}, timeout=30)
    for h, tok in ((running, run_tok), (queued, wait_tok)):
        row, (attempt,) = check_history(db, h.id)
        assert row["status"] == "COMPLETED" and row["attempt"] == 1, row
        assert attempt["worker_id"] == c.worker_id and runs(db, tok) == 1
    assert worker_row(db, c.worker_id)["status"] == "active"
    assert c.proc.poll() is None and d.proc.poll() is None


@pytest.mark.timing
def test_startup_reconciliation_also_recovers_a_dead_worker_already_marked_inactive(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    """With the default settings a silent worker is marked inactive after 3 heartbeat intervals
    (90 s) but its RUNNING tasks are recovered only after 5 minutes. A worker started on the
    same host in between must still recover them at once: the dead worker's process is gone.

    Heartbeats (and the reaper's check) are made fast here so that "marked inactive" comes in
    seconds; the stale thresholds keep their defaults of minutes.
    """
    env = {
        "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
        "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
        "TETHER_CHECK_INTERVAL_MS": "1000",
    }
    hold = chaos.app.tasks["hold"]
    # A survivor whose reaper will mark dead A inactive; busy with a long task of its own (and
    # holding nothing more), so that A gets the next two.
    watcher = workers.start(APP, "--processes", "1", "--prefetch", "0", env=env)
    busy = hold.send(token(), 30)
    wait_until(lambda: task_row(db, busy.id)["status"] == "RUNNING", message="the watcher to be busy")
    a = workers.start(APP, "--processes", "1", "--prefetch", "1", env=env)
    t_run, t_claimed = token(), token()
    running = hold.send(t_run, 120)
    claimed = hold.send(t_claimed, 0)
    wait_until(
        lambda: (
            runs(db, t_run) == 1
            and task_row(db, running.id)["claimed_by_worker_id"] == a.worker_id
            and task_row(db, claimed.id)["claimed_by_worker_id"] == a.worker_id
        ),
        message="A to run one task and hold one CLAIMED",
    )
    a.kill()
    wait_until(
        lambda: worker_row(db, a.worker_id)["status"] == "inactive",
        timeout=15,
        message="the watcher's reaper to mark dead A inactive",
    )
    assert task_row(db, running.id)["status"] == "RUNNING"  # minutes before it would turn stale
    assert task_row(db, claimed.id)["status"] == "CLAIMED"

    b = workers.start(APP, "--processes", "1", env=env)
    registered = worker_row(db, b.worker_id)["started_at"]
    try:
        row = wait_status(db, running.id, {"FAILED", "COMPLETED", "PENDING"}, timeout=5)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\nA (pid {a.pid}) is gone and marked inactive; B started on the same host at "
            f"{registered} and left its tasks alone. B's log:\n{b.log()}"
        ) from None
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert row["failed_at"] - registered < RECOVERED_WITHIN
    row = wait_status(db, claimed.id, {"COMPLETED", "FAILED"}, timeout=10)
    assert row["status"] == "COMPLETED" and runs(db, t_claimed) == 1
    assert watcher.proc.poll() is None


#: A due task starts this soon on a worker waiting for work, whichever path made it due. Far
#: below the 10 s poll the test sets, which is what it tells apart; a first run on a cold
#: machine once took 51 ms (claim 12 ms, then the child's start write), so 50 ms was too tight.
DUE_TASK_STARTS_WITHIN = timedelta(milliseconds=250)


@pytest.mark.timing
def test_a_retry_scheduled_by_startup_reconciliation_starts_when_due(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    """The retry is due 1 s after B's reconciliation; B's poll is 10 s away, so only the
    notification of the retry's due time (heard because B listens before it reconciles)
    can start it on time. Before that order, it waited for the next poll."""
    hold_retry = chaos.app.tasks["hold_retry"]
    a = workers.start(APP, "--processes", "1")
    tok = token()
    retry = hold_retry.send(tok, 120, 0)
    wait_until(lambda: runs(db, tok) == 1, message="A to start the task")
    a.kill()

    b = workers.start(APP, "--processes", "1", env={"TETHER_WORKER_POLL_INTERVAL_MS": "10000"})
    row = wait_status(db, retry.id, "COMPLETED", timeout=15)
    row, attempts = check_history(db, retry.id)
    assert [(x["attempt"], x["worker_id"], x["will_retry"]) for x in attempts] == [
        (1, a.worker_id, True),
        (2, b.worker_id, False),
    ]
    assert "on this host is gone" in attempts[0]["error_message"]
    late = row["started_at"] - row["run_at"]
    claimed_ms = (row["claimed_at"] - row["run_at"]).total_seconds() * 1000
    print(f"retry claimed {claimed_ms:.1f} ms, started {late.total_seconds() * 1000:.1f} ms after it was due")
    assert timedelta(0) <= late < DUE_TASK_STARTS_WITHIN, (row["run_at"], row["started_at"], late)
    assert runs(db, tok) == 2
