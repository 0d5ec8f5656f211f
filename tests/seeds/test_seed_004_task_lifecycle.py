"""Seed 004, "Task Lifecycle": TaskStatus, TASK_TERMINAL_STATES, the transitions with their
timing fields, and good_until, run as written (see conftest.py) with a real worker."""

from __future__ import annotations

import uuid
from types import ModuleType
from typing import Any

import pytest

import tether
from tests.apps.support import attempt_rows, task_row
from tests.chaos.conftest import wait_status
from tests.conftest import WorkerFactory, wait_until
from tests.seeds.conftest import run_example

pytestmark = pytest.mark.usefixtures("db")

NAMES: dict[str, Any] = {name: getattr(tether, name) for name in tether.__all__}

STATUS_EXAMPLE = """
from horsies import TaskStatus, TASK_TERMINAL_STATES
status = TaskStatus.FAILED
status.is_terminal # True
TaskStatus.RUNNING.is_terminal # False
# Frozenset for use in queries or filters
TASK_TERMINAL_STATES # frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.EXPIRED})
"""  # noqa: E501 (the seed's line, as written)

GOOD_UNTIL_EXAMPLE = """
from datetime import datetime, timedelta, timezone
@app.task("urgent_task")
def urgent_task() -> TaskResult[str, TaskError]:
    ...
# Compute deadline at send time, not module load time
urgent_task.send(good_until=datetime.now(timezone.utc) + timedelta(minutes=5))
"""

#: The seed's table: value and whether it is terminal.
STATES = {
    "PENDING": False,
    "CLAIMED": False,
    "RUNNING": False,
    "COMPLETED": True,
    "FAILED": True,
    "CANCELLED": True,
    "EXPIRED": True,
}


async def test_task_status_and_the_terminal_states_example() -> None:
    namespace = dict(NAMES)
    await run_example(STATUS_EXAMPLE, namespace)
    assert namespace["status"].is_terminal is True
    assert namespace["TaskStatus"].RUNNING.is_terminal is False
    assert namespace["_"] == frozenset(
        {
            tether.TaskStatus.COMPLETED,
            tether.TaskStatus.FAILED,
            tether.TaskStatus.CANCELLED,
            tether.TaskStatus.EXPIRED,
        }
    )
    assert isinstance(tether.TASK_TERMINAL_STATES, frozenset)
    assert {s.name: (s.value, s.is_terminal) for s in tether.TaskStatus} == {
        name: (name, terminal) for name, terminal in STATES.items()
    }


def test_the_transitions_and_their_timing_fields(db: Any, basic: ModuleType, workers: WorkerFactory) -> None:
    workers.start("tests.apps.basic:app", "--processes", "1")
    ok = basic.add.send(2, 3)
    assert ok.get(timeout=30).ok == 5
    row = task_row(db, ok.id)
    # COMPLETED means ok; each stamp in order, all database time.
    assert row["status"] == "COMPLETED" and row["result"] == {"ok": 5}
    assert row["sent_at"] <= row["enqueued_at"] <= row["claimed_at"] <= row["started_at"]
    assert row["started_at"] <= row["completed_at"]
    assert row["failed_at"] is None and row["next_retry_at"] is None and row["claimed_by_worker_id"]

    err = basic.fail.send("NOPE")  # returns TaskResult(err=...)
    raised = basic.boom.send("bad")  # raises
    for handle, code in ((err, "NOPE"), (raised, "UNHANDLED_EXCEPTION")):
        result = handle.get(timeout=30)
        assert result.is_err and result.err is not None and result.err.code == code
        row = task_row(db, handle.id)
        assert row["status"] == "FAILED" and row["error_code"] == code  # an err is FAILED, never COMPLETED
        assert row["failed_at"] is not None and row["completed_at"] is None
        assert row["started_at"] <= row["failed_at"]

    # A retry: PENDING again with next_retry_at, retry_count up, enqueued_at moved (eligible again).
    flaky = basic.flaky.send(uuid.uuid4().hex, 1)  # fails once with TRANSIENT, which it retries
    assert flaky.get(timeout=30).ok == 2
    first, second = attempt_rows(db, flaky.id)
    assert (first["outcome"], first["will_retry"]) == ("FAILED", True)
    assert (second["outcome"], second["will_retry"]) == ("COMPLETED", False)
    row = task_row(db, flaky.id)
    assert (row["status"], row["retry_count"], row["attempt"]) == ("COMPLETED", 1, 2)
    assert row["next_retry_at"] is None  # cleared once it finished
    assert row["enqueued_at"] > row["sent_at"]  # moved on the retry; sent_at never moves

    # While a retry waits: PENDING, next_retry_at set and the same as the new enqueued_at.
    later = basic.retry_later.send(uuid.uuid4().hex)  # fails with TRANSIENT, retried in 60 s
    wait_until(lambda: task_row(db, later.id)["retry_count"] == 1, message="the retry to be scheduled")
    row = task_row(db, later.id)
    assert row["status"] == "PENDING" and row["claimed_at"] is None and row["started_at"] is None
    assert row["next_retry_at"] == row["enqueued_at"]
    waited = (row["next_retry_at"] - attempt_rows(db, later.id)[0]["finished_at"]).total_seconds()
    assert 59 <= waited <= 61


async def test_the_good_until_example_then_expiry(db: Any, database_url: str, workers: WorkerFactory) -> None:
    app = tether.Tether(tether.AppConfig(broker=tether.PostgresConfig(database_url=database_url)))
    namespace: dict[str, Any] = {**NAMES, "app": app}
    await run_example(GOOD_UNTIL_EXAMPLE, namespace)
    sent = namespace["_"]
    assert isinstance(sent, tether.TaskHandle)
    row = task_row(db, sent.id)
    # The deadline was computed at send time: about five minutes after it was sent.
    assert row["status"] == "PENDING"
    assert 299 <= (row["good_until"] - row["sent_at"]).total_seconds() <= 301

    # Nobody claims it before the deadline: a reaper (any worker's) makes it EXPIRED with
    # TASK_EXPIRED, and writes no attempt row (it never started). Here the deadline is moved
    # to now, which is what five minutes without a worker for it would do.
    db.execute("UPDATE tether_tasks SET good_until = now() WHERE id = %s", (sent.id,))
    workers.start("tests.apps.basic:app", "--processes", "1", env={"TETHER_CHECK_INTERVAL_MS": "1000"})
    wait_status(db, sent.id, "EXPIRED", timeout=20)
    row = task_row(db, sent.id)
    assert row["error_code"] == "TASK_EXPIRED" and row["expired_at"] is not None
    assert row["claimed_at"] is None and row["started_at"] is None
    assert attempt_rows(db, sent.id) == []
    result = sent.get(timeout=5)
    assert result.err is not None and result.err.code == "TASK_EXPIRED"
    app.close()
