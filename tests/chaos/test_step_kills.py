"""Checkpointed steps under real kills (docs/durable-steps.md): only the interrupted step runs twice.

A 3-step task whose process is killed (kill -9) during its second step: with WORKER_CRASHED
in its retry policy it completes, step 1 having run once, step 2 twice, step 3 once; without
it, it ends FAILED with its first step recorded, and an operator's retry (`tether retry`)
resumes it after that step, while a retry from scratch runs every step again. Each time,
`tether task ID` and handle.info() list the steps with the attempts that recorded them. A
worker frozen (SIGSTOP) during step 2 and recovered elsewhere can never record that step
when it wakes: its write is fenced.
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
from rich.console import Console

import tether.cli.common
from tests.apps.support import attempt_rows, load_app_module, task_row
from tests.chaos.conftest import (
    FAST,
    check_history,
    db_now,
    ensure_chaos_ledger,
    run_pids,
    runs,
    token,
    wait_status,
)
from tests.cli_support import run, run_json
from tests.conftest import WorkerFactory, wait_until

APP = "tests.apps.steps:app"
ONE_CHILD = ("--processes", "1", "--async-processes", "0")

Conn = psycopg.Connection[Any]


@pytest.fixture
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables wide enough that no cell is cut (the CLI prints through tether.cli.common.console)."""
    monkeypatch.setattr(tether.cli.common, "console", Console(width=200))


@pytest.fixture
def steps(database_url: str, db: Conn) -> ModuleType:
    ensure_chaos_ledger(db)
    db.execute("TRUNCATE tether_chaos_ledger")
    return load_app_module("steps", database_url)


def stored(db: Conn, task_id: Any) -> list[tuple[str, Any, int]]:
    """(name, result, attempt) of each stored step, in the order recorded."""
    rows = db.execute(
        "SELECT name, result, attempt FROM tether_task_steps WHERE task_id = %s ORDER BY written_at",
        (task_id,),
    ).fetchall()
    return [(r["name"], r["result"], r["attempt"]) for r in rows]


def late_outcome_seen(log: str, task_id: str) -> bool:
    """A's log says what became of its attempt's outcome once it was continued (test_sigstop.py)."""
    patterns = [
        rf"WARNING .*lost task {task_id} .*could not record its outcome",  # the child's write missed
        # or the child was killed on waking (its heartbeat slot went stale) and the crash record missed
        rf"WARNING .*of dead \w+ child .*already settled elsewhere: [^;\n]*{task_id}",
    ]
    return any(re.search(p, log) for p in patterns)


def step_counts(db: Conn, tok: str) -> list[int]:
    return [runs(db, f"{tok}:{s}") for s in ("one", "two", "three")]


def listed(handle: Any, database_url: str) -> list[tuple[str, int, int]]:
    """(name, attempt, size) of each step as handle.info() lists it, checked against what
    `tether task ID --json` and its text list (the same rows, in the same order)."""
    info = handle.info()
    shown = [(s.name, s.attempt, s.size) for s in info.steps]
    assert [s.occurrence for s in info.steps] == [0] * len(shown)  # one call of each name
    assert all(a.written_at <= b.written_at for a, b in zip(info.steps, info.steps[1:], strict=False))
    as_json = run_json(database_url, "task", str(handle.id))["steps"]
    assert [(s["name"], s["attempt"], s["size"]) for s in as_json] == shown
    text = run(database_url, "task", str(handle.id)).stdout
    assert ("Steps" in text) == bool(shown)
    for name, attempt, size in shown:
        assert re.search(rf"│ {name}\s+│ 0\s+│ {attempt}\s+│ [\d:. -]+│ {size}\s+│", text), text
    return shown


def in_step_two(db: Conn, tok: str, task_id: Any) -> None:
    wait_until(
        lambda: runs(db, f"{tok}:two") == 1 and [s[0] for s in stored(db, task_id)] == ["one"],
        timeout=30,
        message="the task to be inside its second step, its first stored",
    )


@pytest.mark.timing
@pytest.mark.parametrize("killed", ["child", "worker"])
def test_a_task_killed_in_its_second_step_resumes_there(
    steps: ModuleType, db: Conn, workers: WorkerFactory, killed: str, database_url: str, wide_console: None
) -> None:
    """kill -9 of the child (its worker records the crash at once), or of the whole worker
    (another worker's reaper recovers the task once its heartbeats are stale)."""
    a = workers.start(APP, *ONE_CHILD, env=FAST)
    tok = token()
    handle = steps.three_steps.send(tok, 60)
    in_step_two(db, tok, handle.id)
    if killed == "child":
        os.kill(run_pids(db, f"{tok}:two")[0], signal.SIGKILL)
    else:
        b = workers.start(APP, *ONE_CHILD, env=FAST)
        a.kill()  # SIGKILL to A's whole process group, by pid

    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    row, attempts = check_history(db, handle.id)
    assert [(x["outcome"], x["will_retry"], x["error_code"]) for x in attempts] == [
        ("FAILED", True, "WORKER_CRASHED"),
        ("COMPLETED", False, None),
    ]
    first, second = (x["attempt"] for x in attempts)
    assert row["result"] == {"ok": {"total": 321, "attempt": second}}  # built from all three
    assert step_counts(db, tok) == [1, 2, 1]  # only the interrupted step ran twice
    assert stored(db, handle.id) == [("one", 1, first), ("two", 20, second), ("three", 300, second)]
    if killed == "worker":
        assert attempts[1]["worker_id"] == b.worker_id
    # Listed with the attempts that recorded them; sizes are the bytes of 1, 20 and 300 as JSON.
    assert listed(handle, database_url) == [("one", first, 1), ("two", second, 2), ("three", second, 3)]


def failed_in_step_two(steps: ModuleType, db: Conn, workers: WorkerFactory) -> tuple[Any, str, int]:
    """A task without crash retries killed in its second step: FAILED with WORKER_CRASHED, its
    first step recorded. Returns its handle, its token and its attempt."""
    workers.start(APP, *ONE_CHILD, env=FAST)
    tok = token()
    handle = steps.three_steps_no_retry.send(tok, 60)
    in_step_two(db, tok, handle.id)
    os.kill(run_pids(db, f"{tok}:two")[0], signal.SIGKILL)

    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert (row["status"], row["error_code"]) == ("FAILED", "WORKER_CRASHED"), row
    row, (attempt,) = check_history(db, handle.id)
    assert stored(db, handle.id) == [("one", 1, attempt["attempt"])]
    assert step_counts(db, tok) == [1, 1, 0]
    return handle, tok, attempt["attempt"]


@pytest.mark.timing
def test_without_crash_retries_it_fails_with_its_completed_steps_recorded_and_a_retry_resumes_there(
    steps: ModuleType, db: Conn, workers: WorkerFactory, database_url: str, wide_console: None
) -> None:
    handle, tok, first = failed_in_step_two(steps, db, workers)
    assert listed(handle, database_url) == [("one", first, 1)]

    # The operator's retry keeps the recorded step: the new attempt resumes after it.
    out = run(database_url, "retry", str(handle.id)).stdout
    assert out == f"task {handle.id}: retried: PENDING as a new attempt\n1 of 1 task(s) retried\n"
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    second = row["attempt"]
    assert second > first
    assert [(a["attempt"], a["outcome"]) for a in attempt_rows(db, handle.id)] == [
        (first, "FAILED"),
        (second, "COMPLETED"),
    ]
    assert row["result"] == {"ok": {"total": 321, "attempt": second}}  # built from all three
    assert step_counts(db, tok) == [1, 2, 1]  # step 1 not run again; step 2, interrupted, ran again
    assert listed(handle, database_url) == [("one", first, 1), ("two", second, 2), ("three", second, 3)]


@pytest.mark.timing
def test_a_retry_from_scratch_runs_every_step_again(
    steps: ModuleType, db: Conn, workers: WorkerFactory, database_url: str, wide_console: None
) -> None:
    handle, tok, first = failed_in_step_two(steps, db, workers)

    answer = handle.retry(from_scratch=True, by="test")
    assert answer.retried and answer.reason == (
        "retried from scratch: PENDING as a new attempt, its recorded steps deleted"
    )
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    second = row["attempt"]
    assert second > first
    assert row["result"] == {"ok": {"total": 321, "attempt": second}}
    assert step_counts(db, tok) == [2, 2, 1]  # step 1 ran again: its record was deleted
    assert listed(handle, database_url) == [("one", second, 1), ("two", second, 2), ("three", second, 3)]


@pytest.mark.timing
def test_a_frozen_attempt_cannot_record_a_step_after_its_task_was_recovered(
    steps: ModuleType, db: Conn, workers: WorkerFactory, stopped_groups: list[int]
) -> None:
    hold_s = 5.0  # step 2's first run: long enough for B to start before A is frozen
    a = workers.start(APP, *ONE_CHILD, env=FAST)
    tok = token()
    handle = steps.three_steps.send(tok, hold_s)
    in_step_two(db, tok, handle.id)
    (zombie,) = run_pids(db, f"{tok}:two")
    b = workers.start(APP, *ONE_CHILD, env=FAST)
    os.killpg(a.pid, signal.SIGSTOP)
    stopped_groups.append(a.pid)

    # While A is frozen, B's reaper retries the task (WORKER_CRASHED is in its policy), and
    # B runs it again: step 1 from its record, step 2 again (the interrupted one), step 3.
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED" and row["claimed_by_worker_id"] == b.worker_id, row
    row, attempts = check_history(db, handle.id)
    first, second = (x["attempt"] for x in attempts)
    recorded = [("one", 1, first), ("two", 20, second), ("three", 300, second)]
    assert stored(db, handle.id) == recorded
    started = db.execute(
        "SELECT min(at) AS at FROM tether_chaos_ledger WHERE token = %s", (f"{tok}:two",)
    ).fetchone()
    wait_until(
        lambda: db_now(db) - started["at"] > timedelta(seconds=hold_s + 0.5),
        timeout=10,
        message="A's step 2 code to be over once continued",
    )
    before = task_row(db, handle.id)

    # Wake only A's child (its parent stays frozen, so nothing kills the child first): its
    # step 2 ends and tries to record itself, as attempt `first` of a task now COMPLETED.
    os.kill(zombie, signal.SIGCONT)
    lost = rf"WARNING .*lost task {handle.id} \(three_steps\) attempt {first}: could not record step 'two'"
    try:
        wait_until(lambda: re.search(lost, a.log()), timeout=15, message="A's child to lose its step write")
    except AssertionError:
        raise AssertionError(f"A's log:\n{a.log()}") from None
    assert stored(db, handle.id) == recorded  # the zombie's step changed nothing
    assert task_row(db, handle.id) == before
    assert step_counts(db, tok) == [1, 2, 1]  # and its step 3 never ran: the attempt ended there

    # A wakes whole: its child's outcome write (the StepLostError) is fenced too.
    os.killpg(a.pid, signal.SIGCONT)
    try:
        wait_until(lambda: late_outcome_seen(a.log(), str(handle.id)), timeout=15, message="A's late outcome")
    except AssertionError:
        raise AssertionError(f"A's log:\n{a.log()}") from None
    assert stored(db, handle.id) == recorded and task_row(db, handle.id) == before
    assert step_counts(db, tok) == [1, 2, 1]
