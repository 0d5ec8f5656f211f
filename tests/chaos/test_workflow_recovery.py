"""Workflows whose worker dies: real worker processes, real signals, fast recovery settings.

A step's task outcome commits first and the workflow advances in the next transaction, by
the process that ended the task. Here that process dies (or never gets the chance), and the
workflow must still end, by the rules: a step whose task crashed without a crash retry fails
(WORKER_CRASHED) and skips its dependents while independent branches complete; a step whose
policy retries WORKER_CRASHED runs again and its dependents run once; a step whose outcome
was recorded by a process that died before advancing is settled by the reaper's
reconciliation. Every step's code is counted through the ledger (tests.apps.basic.ledger).
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import ensure_ledger, load_app_module, runs, task_row, workflow_row
from tests.apps.support import workflow_steps as steps
from tests.chaos.conftest import FAST, check_history, child_pids, db_now
from tests.conftest import WorkerFactory, WorkerProcess, wait_until
from tether import ErrorCode

APP = "tests.apps.flows:app"
WAIT = 60.0
# Generous bounds for "recovered by the reaper" (stale threshold 2 s + check interval 1 s)
# and "recorded by the worker's main process at once" on a loaded 2-core machine.
REAPED_WITHIN = timedelta(seconds=15)
SETTLED_AT_ONCE = timedelta(seconds=10)
#: The child-kill test proves the main process acts, not staleness: thresholds far away.
SLOW_STALE = {
    **FAST,
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "120000",
    "TETHER_RUNNING_STALE_THRESHOLD_MS": "120000",
    "TETHER_CHECK_INTERVAL_MS": "60000",
}
RECONCILED = "step(s) whose task had ended without advancing the workflow"

Conn = psycopg.Connection[Any]


@pytest.fixture
def flows(database_url: str, db: Conn) -> Iterator[ModuleType]:
    ensure_ledger(db)
    yield load_app_module("flows", database_url)


def token() -> str:
    return uuid.uuid4().hex


def ledger_pids(conn: Conn, tok: str) -> list[int]:
    rows = conn.execute("SELECT pid FROM tether_test_ledger WHERE token = %s ORDER BY at", (tok,)).fetchall()
    return [r["pid"] for r in rows]


def wait_step_running(db: Conn, handle: Any, node: str, tok: str, worker: WorkerProcess) -> int:
    """Until the step's task is RUNNING on ``worker`` and its code has started; returns the child's pid."""

    def running() -> bool:
        row = steps(db, handle.id)[node]
        return (
            row["task_status"] == "RUNNING"
            and row["claimed_by_worker_id"] == worker.worker_id
            and runs(db, tok) == 1
        )

    wait_until(running, timeout=WAIT, message=f"step {node} to run on worker {worker.pid}")
    (pid,) = ledger_pids(db, tok)
    assert pid in child_pids(worker), (pid, child_pids(worker))
    return pid


def wait_finished(db: Conn, handle: Any) -> dict[str, Any]:
    try:
        return wait_until(
            lambda: (
                (r := workflow_row(db, handle.id))["status"] in ("COMPLETED", "FAILED", "CANCELLED") and r
            ),
            timeout=WAIT,
            message=f"workflow {handle.id} to finish",
        )
    except AssertionError as exc:
        now = {n: (r["status"], r["task_status"]) for n, r in steps(db, handle.id).items()}
        raise AssertionError(f"{exc}; steps now: {now}") from None


def test_a_killed_worker_s_step_fails_its_dependents_skip_and_other_branches_complete(
    db: Conn, flows: ModuleType, workers: WorkerFactory
) -> None:
    """SIGKILL of a worker's whole process group mid-step, no crash retry: the survivor's reaper
    fails the task WORKER_CRASHED and settles the step in the same tick."""
    a = workers.start(APP, "--queues", "default", "--processes", "1", env=FAST)
    t_slow, t_after, t_side, t_side_next = token(), token(), token(), token()
    slow = flows.sleep.node(args=(60.0,), kwargs={"token": t_slow}, name="slow")
    after = flows.add.node(args=(1,), kwargs={"token": t_after}, after=[slow], name="after")
    after2 = flows.add.node(args=(2,), after=[after], name="after2")
    # An independent branch only the survivor serves (queue `other`): it runs across the kill.
    side = flows.sleep.with_options(queue="other").node(args=(1.0,), kwargs={"token": t_side}, name="side")
    side_next = flows.add.with_options(queue="other").node(
        kwargs={"b": 1, "token": t_side_next}, args_from={"a": side}, name="side_next"
    )
    handle = flows.app.workflow("kill-worker", [slow, after, after2, side, side_next]).start()
    slow_pid = wait_step_running(db, handle, "slow", t_slow, a)
    b = workers.start(APP, "--queues", "default,other", "--processes", "2", env=FAST)
    # B's start-up looks for dead workers on this host once: past it, only B's reaper
    # (staleness) can find A's crash, which is the path this test is about.
    wait_until(lambda: "started: queues=" in b.log(), timeout=30, message="B to finish its startup")

    killed_at = db_now(db)
    a.kill()  # SIGKILL to A's process group: nothing of A is left to record or advance

    wf = wait_finished(db, handle)
    assert wf["status"] == "FAILED", wf
    assert (wf["steps_total"], wf["steps_done"], wf["steps_failed"]) == (5, 5, 1)
    result = handle.get(timeout=5)
    assert result.err is not None and result.err.code == ErrorCode.WORKFLOW_FAILED, result
    failed = result.err.data["failed_steps"]
    assert list(failed) == ["slow"] and failed["slow"]["code"] == ErrorCode.WORKER_CRASHED, failed
    assert "no runner heartbeat" in failed["slow"]["message"]

    rows = steps(db, handle.id)
    assert (rows["slow"]["status"], rows["slow"]["error_code"], rows["slow"]["task_status"]) == (
        "FAILED",
        "WORKER_CRASHED",
        "FAILED",
    )
    for name in ("after", "after2"):
        assert (rows[name]["status"], rows[name]["task_status"]) == ("SKIPPED", None), rows[name]
        assert rows[name]["error_code"] == "DEPENDENCY_FAILED"
    assert rows["side"]["status"] == rows["side_next"]["status"] == "COMPLETED"
    assert rows["side_next"]["result"] == {"ok": 2.0}
    # Failed by B's reaper once stale (the reaper writes no pid), not before; within bounds.
    task, (attempt,) = check_history(db, rows["slow"]["task_id"])
    assert task["error_code"] == "WORKER_CRASHED" and task["retry_count"] == 0
    assert (attempt["worker_id"], attempt["pid"]) == (a.worker_id, None)
    assert timedelta(0) < rows["slow"]["finished_at"] - killed_at < REAPED_WITHIN
    assert rows["slow"]["finished_at"] >= task["failed_at"]
    # Each step's code ran as often as the rules allow: the crashed one once, skipped ones never.
    assert ledger_pids(db, t_slow) == [slow_pid]
    assert (runs(db, t_after), runs(db, t_side), runs(db, t_side_next)) == (0, 1, 1)
    assert set(ledger_pids(db, t_side) + ledger_pids(db, t_side_next)) <= child_pids(b)
    # The reaper's reconciliation settled the step, in the survivor.
    assert f"workflow {handle.id}: settled 1 {RECONCILED}" in b.log(), b.log()
    assert b.proc.poll() is None


def test_a_killed_worker_s_step_is_retried_when_its_policy_lists_worker_crashed(
    db: Conn, flows: ModuleType, workers: WorkerFactory
) -> None:
    """The same kill, with wf.crash_retry: retried on the survivor; its dependent runs once."""
    a = workers.start(APP, "--queues", "default", "--processes", "1", env=FAST)
    t_step, t_dep = token(), token()
    # The first attempt outlasts B's start-up however slow (CI ran it under load: A finished a
    # 4 s step before B was up and A was killed); the retry is short.
    step = flows.crash_retry.node(args=(60.0, t_step, 0.5), name="step")
    dep = flows.add.node(args=(1,), kwargs={"b": 2, "token": t_dep}, after=[step], name="dep")
    handle = flows.app.workflow("kill-worker-retry", [step, dep]).start()
    first_pid = wait_step_running(db, handle, "step", t_step, a)
    b = workers.start(APP, "--queues", "default", "--processes", "1", env=FAST)

    killed_at = db_now(db)
    a.kill()

    wf = wait_finished(db, handle)
    assert wf["status"] == "COMPLETED", (wf, steps(db, handle.id))
    assert (wf["steps_total"], wf["steps_done"], wf["steps_failed"]) == (2, 2, 0)
    assert handle.get(timeout=5).ok == 3

    rows = steps(db, handle.id)
    assert (rows["step"]["status"], rows["step"]["result"]) == ("COMPLETED", {"ok": t_step})
    assert (rows["dep"]["status"], rows["dep"]["result"]) == ("COMPLETED", {"ok": 3})
    task, attempts = check_history(db, rows["step"]["task_id"])
    assert [(x["attempt"], x["outcome"], x["will_retry"], x["worker_id"]) for x in attempts] == [
        (1, "FAILED", True, a.worker_id),
        (2, "COMPLETED", False, b.worker_id),
    ]
    assert attempts[0]["error_code"] == "WORKER_CRASHED"
    assert attempts[0]["finished_at"] - killed_at < REAPED_WITHIN
    assert task["retry_count"] == 1
    # The step settled once, from the retry (not from the crash): the dependent started after it.
    assert rows["dep"]["enqueued_at"] >= rows["step"]["finished_at"] >= attempts[1]["finished_at"]
    # Ran twice (the first run killed on A, the retry on B); the dependent once, on B.
    pids = ledger_pids(db, t_step)
    assert len(pids) == 2 and pids[0] == first_pid and pids[1] in child_pids(b), (pids, child_pids(b))
    assert runs(db, t_dep) == 1 and ledger_pids(db, t_dep)[0] in child_pids(b)
    assert b.proc.poll() is None


def test_a_killed_child_s_step_is_failed_and_advanced_at_once_by_the_main_process(
    db: Conn, flows: ModuleType, workers: WorkerFactory
) -> None:
    """SIGKILL of the child only: the main process records WORKER_CRASHED and advances the
    workflow itself, long before any stale threshold (120 s here) could come into play."""
    w = workers.start(APP, "--processes", "2", env=SLOW_STALE)
    t_slow, t_after, t_side = token(), token(), token()
    slow = flows.sleep.node(args=(60.0,), kwargs={"token": t_slow}, name="slow")
    after = flows.add.node(args=(1,), kwargs={"token": t_after}, after=[slow], name="after")
    side = flows.sleep.node(args=(1.0,), kwargs={"token": t_side}, name="side")
    side_next = flows.add.node(kwargs={"b": 1}, args_from={"a": side}, name="side_next")
    handle = flows.app.workflow("kill-child", [slow, after, side, side_next]).start()
    pid = wait_step_running(db, handle, "slow", t_slow, w)

    killed_at = db_now(db)
    os.kill(pid, signal.SIGKILL)

    wf = wait_finished(db, handle)
    assert wf["status"] == "FAILED", wf
    assert (wf["steps_done"], wf["steps_failed"]) == (4, 1)
    assert wf["finished_at"] - killed_at < SETTLED_AT_ONCE, (wf["finished_at"], killed_at)
    rows = steps(db, handle.id)
    assert (rows["slow"]["status"], rows["slow"]["error_code"]) == ("FAILED", "WORKER_CRASHED")
    assert rows["slow"]["finished_at"] - killed_at < SETTLED_AT_ONCE
    assert (rows["after"]["status"], rows["after"]["task_status"]) == ("SKIPPED", None)
    assert (rows["side_next"]["status"], rows["side_next"]["result"]) == ("COMPLETED", {"ok": 2.0})
    result = handle.get(timeout=5)
    assert result.err is not None and result.err.code == ErrorCode.WORKFLOW_FAILED
    assert result.err.data["failed_steps"]["slow"]["code"] == ErrorCode.WORKER_CRASHED
    # Recorded by the worker's main process (its pid on the attempt row; a reaper leaves none),
    # and advanced by it too: the reconciliation did not have to step in.
    task, (attempt,) = check_history(db, rows["slow"]["task_id"])
    assert task["status"] == "FAILED" and task["retry_count"] == 0
    assert (attempt["worker_id"], attempt["pid"]) == (w.worker_id, w.pid)
    log = w.log()
    assert "exited with code -9 holding 1 task(s)" in log, log
    assert RECONCILED not in log, log
    assert (runs(db, t_slow), runs(db, t_after), runs(db, t_side)) == (1, 0, 1)
    assert w.proc.poll() is None


def test_steps_whose_process_died_before_advancing_are_reconciled_by_the_reaper(
    db: Conn, flows: ModuleType, workers: WorkerFactory
) -> None:
    """TETHER_TEST_FAULT=die_before_advance: each child exits right after recording a step's
    outcome, so only the reaper's reconciliation moves the workflow on, step by step."""
    w = workers.start(APP, "--processes", "1", env={**FAST, "TETHER_TEST_FAULT": "die_before_advance"})
    toks = [token(), token(), token()]
    n0 = flows.number.node(args=(5,), kwargs={"token": toks[0]}, name="n0")
    n1 = flows.add.node(kwargs={"b": 10, "token": toks[1]}, args_from={"a": n0}, name="n1")
    n2 = flows.add.node(kwargs={"b": 100, "token": toks[2]}, args_from={"a": n1}, name="n2")
    handle = flows.app.workflow("die-before-advance", [n0, n1, n2]).start()

    result = handle.get(timeout=WAIT)

    assert result.is_ok and result.ok == 115, (result, w.log())
    wf = workflow_row(db, handle.id)
    assert (wf["status"], wf["steps_done"], wf["steps_failed"]) == ("COMPLETED", 3, 0)
    rows = steps(db, handle.id)
    assert {n: (r["status"], r["task_status"]) for n, r in rows.items()} == dict.fromkeys(
        rows, ("COMPLETED", "COMPLETED")
    )
    assert {n: r["result"] for n, r in rows.items()} == {"n0": {"ok": 5}, "n1": {"ok": 15}, "n2": {"ok": 115}}
    assert rows["n1"]["task_kwargs"] == {"b": 10, "token": toks[1], "a": 5}
    assert rows["n2"]["task_kwargs"] == {"b": 100, "token": toks[2], "a": 15}
    for name, tok in zip(("n0", "n1", "n2"), toks, strict=True):
        # Ran once, in a child that recorded the outcome itself and then died.
        (pid,) = ledger_pids(db, tok)
        task, (attempt,) = check_history(db, rows[name]["task_id"])
        assert task["attempt"] == 1 and attempt["pid"] == pid, (task, attempt)
        assert pid not in child_pids(w)
    # Each step was settled by the reaper's reconciliation, after its child had died.
    log = w.log()
    assert log.count("exited with code 17 holding 1 task(s)") == 3, log
    assert log.count(f"workflow {handle.id}: settled 1 {RECONCILED}") == 3, log
    assert w.proc.poll() is None
    assert task_row(db, rows["n2"]["task_id"])["workflow_id"] == handle.id
