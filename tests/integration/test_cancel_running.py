"""Cancelling a running task (docs/tasks.md#cancelling-a-running-task), with real workers.

What a user relies on: the reply of cancel(); the task's code told within a second
(a sync task that checks, an async task's coroutine cancelled); a task that ignores the
request killed after its grace period and its process replaced; the row CANCELLED with
TASK_CANCELLED "while running" and who asked, one attempt row, never retried; a
completion that wins stays COMPLETED; recovery after the worker's death ends the task
CANCELLED; a workflow step cancelled while running fails its workflow.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import attempt_rows, ensure_ledger, load_app_module, runs, task_row
from tests.cli_support import tether_command
from tests.conftest import WorkerFactory, WorkerProcess, wait_until
from tether import ErrorCode, StepStatus, TaskStatus, WorkflowStatus
from tether.cancelling import CancelReply
from tether.errors import InvalidOptionError, TaskNotFoundError

APP = "tests.apps.cancelling:app"
WAIT = 30.0
# A cancel reaches the task's code within a second: the notification takes milliseconds,
# the rest is the write of the outcome. The bound below is the figure.
TOLD_WITHIN = timedelta(seconds=1)


@pytest.fixture
def app(database_url: str, db: psycopg.Connection[Any]) -> ModuleType:
    ensure_ledger(db)
    return load_app_module("cancelling", database_url)


@pytest.fixture
def worker(workers: WorkerFactory) -> Iterator[WorkerProcess]:
    yield workers.start(APP, "--processes", "1", "--async-processes", "1")


def running(db: psycopg.Connection[Any], task_id: Any, token: str) -> dict[str, Any]:
    """Waits until the task's code is running (its token is in the ledger); returns its row."""
    wait_until(lambda: runs(db, token) == 1, WAIT, message=f"task {task_id} to start its code")
    row = task_row(db, task_id)
    assert row["status"] == "RUNNING"
    return row


def assert_cancelled_while_running(db: psycopg.Connection[Any], task_id: Any, by: str) -> dict[str, Any]:
    row = task_row(db, task_id)
    assert (row["status"], row["error_code"], row["retry_count"]) == ("CANCELLED", "TASK_CANCELLED", 0)
    assert row["completed_at"] is None and row["failed_at"] is None and row["cancelled_at"] is not None
    err = row["result"]["err"]
    assert err["code"] == "TASK_CANCELLED"
    assert "while running" in err["message"] and f"(requested by {by})" in err["message"]
    assert row["cancel_requested_by"] == by
    [attempt] = attempt_rows(db, task_id)
    assert (attempt["outcome"], attempt["error_code"], attempt["will_retry"]) == (
        "CANCELLED",
        "TASK_CANCELLED",
        False,
    )
    return row


@pytest.mark.timing
def test_a_sync_task_that_checks_stops_within_a_second(
    app: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    token = uuid.uuid4().hex
    handle = app.cooperative.send(token)
    running(db, handle.id, token)
    assert handle.cancel(by="ops@test") is CancelReply.REQUESTED
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TASK_CANCELLED
    row = assert_cancelled_while_running(db, handle.id, "ops@test")
    took = row["cancelled_at"] - row["cancel_requested_at"]
    print(f"sync task: cancel requested -> CANCELLED recorded: {took.total_seconds() * 1000:.1f} ms")
    assert took < TOLD_WITHIN
    assert handle.status() is TaskStatus.CANCELLED
    # Its policy retries every failure; a cancel is never retried, and the child lives on.
    assert runs(db, token) == 1
    assert app.quick.send(7).get(timeout=WAIT).ok == 7
    assert runs(db, token) == 1


@pytest.mark.timing
def test_a_sync_task_that_ignores_the_request_is_killed_after_its_grace_period(
    app: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    before = app.quick.send(-1).get(timeout=WAIT).ok  # the sync child's pid
    token = uuid.uuid4().hex
    handle = app.ignores.send(token)
    running(db, handle.id, token)
    assert handle.cancel(by="ops@test") is CancelReply.REQUESTED
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TASK_CANCELLED
    assert "went on for 1s after the request and its process was killed" in err.message
    assert err.data == {"cancel_grace_s": 1.0}
    row = assert_cancelled_while_running(db, handle.id, "ops@test")
    waited = row["cancelled_at"] - row["cancel_requested_at"]
    assert timedelta(seconds=1) <= waited < timedelta(seconds=3), waited
    assert runs(db, token) == 1
    # A replacement child runs the next task.
    after = app.quick.send(-1).get(timeout=WAIT).ok
    assert after != before
    assert "did not stop within 1s of its cancel request: killing sync child 0" in worker.log()


@pytest.mark.timing
def test_an_async_task_has_its_coroutine_cancelled_and_its_neighbours_go_on(
    app: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    token, other_token = uuid.uuid4().hex, uuid.uuid4().hex
    handle = app.snooze.send(token)
    neighbour = app.nap.send(other_token, 2.0)
    running(db, handle.id, token)
    running(db, neighbour.id, other_token)
    assert handle.cancel(by="ops@test") is CancelReply.REQUESTED
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TASK_CANCELLED
    row = assert_cancelled_while_running(db, handle.id, "ops@test")
    took = row["cancelled_at"] - row["cancel_requested_at"]
    print(f"async task: cancel requested -> CANCELLED recorded: {took.total_seconds() * 1000:.1f} ms")
    assert took < TOLD_WITHIN
    # The other task of the same async child was not disturbed.
    assert neighbour.get(timeout=WAIT).is_ok
    assert task_row(db, neighbour.id)["attempt"] == 1


def test_an_async_task_that_swallows_its_cancellation_is_killed_with_its_child(
    app: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    token = uuid.uuid4().hex
    handle = app.deaf.send(token)
    running(db, handle.id, token)
    assert handle.cancel() is CancelReply.REQUESTED
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TASK_CANCELLED
    assert "its process was killed" in err.message
    row = task_row(db, handle.id)
    assert (row["status"], row["retry_count"], row["cancel_requested_by"]) == ("CANCELLED", 0, None)
    assert runs(db, token) == 1
    # A new async child runs the next async task.
    assert app.nap.send(uuid.uuid4().hex, 0.01).get(timeout=WAIT).is_ok


def test_a_failure_after_the_request_ends_cancelled_and_is_not_retried(
    app: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    token = uuid.uuid4().hex
    handle = app.fails_when_cancelled.send(token)
    running(db, handle.id, token)
    assert handle.cancel(by="ops@test") is CancelReply.REQUESTED
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TASK_CANCELLED
    # The error it ended with is kept in the data.
    assert err.data["error"]["code"] == "UNHANDLED_EXCEPTION"
    assert "stopping, as asked" in err.data["error"]["message"]
    assert_cancelled_while_running(db, handle.id, "ops@test")
    assert runs(db, token) == 1


def test_a_task_that_completes_anyway_stays_completed_and_a_late_cancel_changes_nothing(
    app: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    token = uuid.uuid4().hex
    handle = app.finishes_anyway.send(token)
    running(db, handle.id, token)
    assert handle.cancel(by="ops@test") is CancelReply.REQUESTED
    assert handle.get(timeout=WAIT).ok == "done anyway"
    row = task_row(db, handle.id)
    assert (row["status"], row["error_code"], row["cancelled_at"]) == ("COMPLETED", None, None)
    assert row["cancel_requested_by"] == "ops@test"  # the request stays on record
    [attempt] = attempt_rows(db, handle.id)
    assert attempt["outcome"] == "COMPLETED"
    # A cancel after the end: nothing changes, and the reply says so (falsy).
    reply = handle.cancel(by="late@test")
    assert reply is CancelReply.ALREADY_ENDED and not reply
    assert task_row(db, handle.id) == row


def test_cancel_races_completion_and_exactly_one_wins(
    app: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    tokens = [uuid.uuid4().hex for _ in range(40)]
    handles = [app.short.send(t, 0.02) for t in tokens]
    replies = {}
    for handle in handles:
        wait_until(lambda h=handle: task_row(db, h.id)["status"] != "PENDING", WAIT, interval=0.001)
        replies[handle.id] = handle.cancel(by="race@test")
    for handle in handles:
        handle.get(timeout=WAIT)
    outcomes = {"COMPLETED": 0, "CANCELLED": 0}
    for handle in handles:
        row = task_row(db, handle.id)
        outcomes[row["status"]] += 1
        attempts = attempt_rows(db, handle.id)
        assert row["retry_count"] == 0
        if row["status"] == "COMPLETED":
            assert row["cancelled_at"] is None and row["error_code"] is None and "ok" in row["result"]
            assert [a["outcome"] for a in attempts] == ["COMPLETED"]
            assert replies[handle.id] in (CancelReply.REQUESTED, CancelReply.ALREADY_ENDED)
        else:
            assert row["status"] == "CANCELLED"
            assert row["completed_at"] is None and row["error_code"] == "TASK_CANCELLED"
            assert row["result"]["err"]["code"] == "TASK_CANCELLED"
            # Cancelled before its code ran (no attempt), or while it ran (one attempt).
            assert [a["outcome"] for a in attempts] in ([], ["CANCELLED"])
            assert replies[handle.id] in (CancelReply.CANCELLED, CancelReply.REQUESTED)
            assert (replies[handle.id] is CancelReply.CANCELLED) == (attempts == [])
    assert sum(outcomes.values()) == len(handles)
    assert all(runs(db, t) <= 1 for t in tokens)


def test_a_cancel_pending_when_the_worker_dies_ends_cancelled_on_recovery(
    app: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    first = workers.start(APP, "--processes", "1", "--async-processes", "0")
    token = uuid.uuid4().hex
    handle = app.deaf_forever.send(token)  # retries crashes; ignores the cancel for an hour
    running(db, handle.id, token)
    assert handle.cancel(by="ops@test") is CancelReply.REQUESTED
    first.kill()  # SIGKILL to the whole worker while the cancel is pending
    # A worker restarted on the same host recovers the dead one's task at start.
    workers.start(APP, "--processes", "1", "--async-processes", "0")
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TASK_CANCELLED
    assert err.data["error"]["code"] == "WORKER_CRASHED"
    row = task_row(db, handle.id)
    assert (row["status"], row["retry_count"]) == ("CANCELLED", 0)
    [attempt] = attempt_rows(db, handle.id)
    assert (attempt["outcome"], attempt["will_retry"]) == ("CANCELLED", False)
    assert runs(db, token) == 1


@pytest.mark.timing
def test_the_heartbeat_tells_the_worker_of_a_request_it_was_not_notified_of(
    app: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    workers.start(
        APP,
        "--processes",
        "1",
        "--async-processes",
        "0",
        env={"TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000", "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000"},
    )
    token = uuid.uuid4().hex
    handle = app.cooperative.send(token)
    running(db, handle.id, token)
    # The request written without its notification, as if the worker's listener missed it.
    requested_at = db.execute(
        "UPDATE tether_tasks SET cancel_requested_at = now(), cancel_requested_by = 'quiet@test' "
        "WHERE id = %s RETURNING cancel_requested_at",
        (handle.id,),
    ).fetchone()["cancel_requested_at"]
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TASK_CANCELLED
    row = assert_cancelled_while_running(db, handle.id, "quiet@test")
    # Within about one heartbeat interval (1 s here) plus the write.
    assert row["cancelled_at"] - requested_at < timedelta(seconds=3)


def test_cancelling_before_it_runs_and_unknown_ids(app: ModuleType, db: psycopg.Connection[Any]) -> None:
    handle = app.quick.send(1)  # no worker: it stays PENDING
    assert handle.cancel(by="ops@test") is CancelReply.CANCELLED
    row = task_row(db, handle.id)
    assert (row["status"], row["error_code"]) == ("CANCELLED", "TASK_CANCELLED")
    assert row["result"]["err"]["message"] == "cancelled before it ran (by ops@test)"
    assert attempt_rows(db, handle.id) == []
    with pytest.raises(TaskNotFoundError, match="no task with id"):
        app.app.handle(uuid.uuid4()).cancel()
    with pytest.raises(InvalidOptionError, match=r"^by must be who asks: .*; got 42 \(int\)"):
        handle.cancel(by=42)  # type: ignore[arg-type]


def test_a_workflow_step_cancelled_while_running_fails_its_workflow(
    app: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    token = uuid.uuid4().hex
    step = app.cooperative.node(args=(token,), name="long")
    after = app.quick.node(args=(1,), name="after", after=[step])
    flow = app.app.workflow("cancel-a-step", [step, after]).start()
    task = flow.task("long")
    running(db, task.id, token)
    assert task.cancel(by="ops@test") is CancelReply.REQUESTED
    result = flow.get(timeout=WAIT)
    assert result.err is not None
    info = flow.info()
    assert info.status is WorkflowStatus.FAILED
    steps = {s.name: s for s in info.steps}
    assert steps["long"].status is StepStatus.CANCELLED
    assert steps["after"].status is not StepStatus.COMPLETED
    assert_cancelled_while_running(db, task.id, "ops@test")


def test_the_cancel_command(
    app: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess, database_url: str
) -> None:
    token = uuid.uuid4().hex
    runner = app.cooperative.send(token)
    running(db, runner.id, token)
    waiting = app.quick.schedule(timedelta(hours=1), 1)
    done = tether_command(database_url, "cancel", str(runner.id), str(waiting.id), "--by", "cli@test")
    assert done.returncode == 0, done.stderr
    assert f"requested: task {runner.id} is RUNNING on worker" in done.stdout
    assert f"cancelled: task {waiting.id} cancelled before it ran" in done.stdout
    assert runner.get(timeout=WAIT).err.code == ErrorCode.TASK_CANCELLED
    assert_cancelled_while_running(db, runner.id, "cli@test")
    # Again: both have ended; nothing changes, it says so, and the exit status is 1.
    before = [task_row(db, runner.id), task_row(db, waiting.id)]
    again = tether_command(database_url, "cancel", str(runner.id), str(waiting.id), "--json")
    assert again.returncode == 1
    replies = json.loads(again.stdout)
    assert [r["reply"] for r in replies] == ["already_ended", "already_ended"]
    assert [r["status"] for r in replies] == ["CANCELLED", "CANCELLED"]
    assert [task_row(db, runner.id), task_row(db, waiting.id)] == before
    # A malformed id changes nothing and names the argument.
    bad = tether_command(database_url, "cancel", str(waiting.id), "not-an-id")
    assert bad.returncode != 0 and "not-an-id" in bad.stderr
    missing = tether_command(database_url, "cancel", str(uuid.uuid4()))
    assert missing.returncode == 1 and "not_found: no task with id" in missing.stdout


def test_a_cancelled_task_retried_by_hand_runs_again_on_the_same_child(
    app: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    """The child's slot still names the cancelled task: its next run (a new attempt) must not
    be taken for cancelled."""
    workers.start(APP, "--processes", "1", "--async-processes", "0")
    token = uuid.uuid4().hex
    handle = app.short.send(token, 2.0)
    wait_until(lambda: runs(db, token) == 1, WAIT, message="the first run")
    assert handle.cancel(by="ops@test") is CancelReply.REQUESTED
    assert handle.get(timeout=WAIT).err.code == ErrorCode.TASK_CANCELLED
    answer = handle.retry(by="ops@test")
    assert answer.retried, answer.reason
    assert handle.get(timeout=WAIT).ok == token
    row = task_row(db, handle.id)
    assert (row["status"], row["cancel_requested_at"]) == ("COMPLETED", None)
    assert [a["outcome"] for a in attempt_rows(db, handle.id)] == ["CANCELLED", "COMPLETED"]
    assert runs(db, token) == 2
