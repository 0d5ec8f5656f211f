"""Fenced writes: a worker that lost its claim changes nothing, whatever it tries to write.

No worker process here: the test drives the claim statement and two Recorders (the class
a worker child uses for its writes) as two workers, A and B, and plays the reaper with
plain SQL, so every step of the race happens in a known order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import attempt_rows, load_app_module, task_row
from tether import ErrorCode, TaskStatus
from tether.broker.claims import TaskPayload
from tether.broker.queries import q
from tether.cancelling import CancelReply
from tether.config import AppConfig, PostgresConfig
from tether.outcomes import Outcome
from tether.worker.recorder import Recorder

# The claim's parameters for a worker with one kind of child (worker/lanes.py).
NO_ASYNC_LANE = {"async_limit": 0, "async_names": []}
# No marks (worker/claim_marks.py): the claim reads each queue from its start.
NO_MARKS: dict[str, list[Any]] = {
    "mark_queues": [],
    "mark_priorities": [],
    "mark_run_ats": [],
    "mark_ids": [],
}

A, B = "host-1-aaaa", "host-2-bbbb"
COMPLETED = Outcome(TaskStatus.COMPLETED, '{"ok": 3}', None, None, None)
FAILED = Outcome(TaskStatus.FAILED, '{"err": {"code": "X", "message": "m", "data": null}}', "X", "m", None)
RETRY = Outcome(TaskStatus.FAILED, '{"err": {"code": "X", "message": "m", "data": null}}', "X", "m", 0.0)


@pytest.fixture
def basic(database_url: str) -> ModuleType:
    return load_app_module("basic", database_url)


@pytest.fixture
def recorders(database_url: str) -> Iterator[tuple[Recorder, Recorder]]:
    config = AppConfig(broker=PostgresConfig(database_url=database_url, connect_timeout_s=2))
    a, b = Recorder(database_url, A, config), Recorder(database_url, B, config)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def claim(db: psycopg.Connection[Any], worker_id: str, limit: int = 1) -> list[TaskPayload]:
    rows = db.execute(
        q("claim_tasks"),
        {
            "queues": ["default"],
            "limit": limit,
            "other_limit": limit,
            **NO_ASYNC_LANE,
            "worker_id": worker_id,
            "skip_names": [],
            **NO_MARKS,
        },
    ).fetchall()
    return sorted((TaskPayload.from_row(r) for r in rows), key=lambda t: t.id)


def requeue(db: psycopg.Connection[Any], task_id: str) -> None:
    """What recovery does to a task whose worker was declared dead: back to PENDING, unowned."""
    n = db.execute(
        "UPDATE tether_tasks SET status = 'PENDING', claimed_at = NULL, started_at = NULL, "
        "claimed_by_worker_id = NULL WHERE id = %s AND status IN ('CLAIMED', 'RUNNING')",
        (task_id,),
    ).rowcount
    assert n == 1


def lost_warnings(caplog: pytest.LogCaptureFixture, task_id: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "lost task" in r.getMessage() and task_id in r.getMessage()
    ]


@pytest.mark.parametrize("outcome", [COMPLETED, FAILED, RETRY], ids=["completed", "failed", "retry"])
def test_a_zombie_cannot_record_over_the_new_attempt(
    db: psycopg.Connection[Any],
    basic: ModuleType,
    recorders: tuple[Recorder, Recorder],
    caplog: pytest.LogCaptureFixture,
    outcome: Outcome,
) -> None:
    rec_a, rec_b = recorders
    handle = basic.add.send(1, 2)
    (task_a,) = claim(db, A)
    assert task_a.attempt == 1 and rec_a.start(task_a)
    requeue(db, task_a.id)  # A is declared dead while its code runs
    (task_b,) = claim(db, B)
    assert task_b.id == task_a.id and task_b.attempt == 2
    assert rec_b.start(task_b)

    with caplog.at_level(logging.WARNING, logger="tether.worker.recorder"):
        assert rec_a.record(task_a, outcome) == (None, None)
    assert lost_warnings(caplog, task_a.id), caplog.text
    row = task_row(db, task_a.id)
    assert (row["status"], row["attempt"], row["claimed_by_worker_id"]) == ("RUNNING", 2, B)
    assert row["result"] is None and row["completed_at"] is None and row["failed_at"] is None
    assert row["retry_count"] == 0 and row["error_code"] is None
    assert attempt_rows(db, task_a.id) == []  # no history row for the lost write either

    assert rec_b.record(task_b, COMPLETED) == ("COMPLETED", None)
    row = task_row(db, task_b.id)
    assert (row["status"], row["attempt"], row["claimed_by_worker_id"]) == ("COMPLETED", 2, B)
    (attempt,) = attempt_rows(db, task_b.id)
    assert (attempt["attempt"], attempt["worker_id"], attempt["outcome"]) == (2, B, "COMPLETED")
    assert handle.get(timeout=5).ok == 3


def test_the_attempt_number_fences_the_same_worker_too(
    db: psycopg.Connection[Any],
    basic: ModuleType,
    recorders: tuple[Recorder, Recorder],
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec_a, _ = recorders
    basic.add.send(1, 2)
    (old,) = claim(db, A)
    assert rec_a.start(old)
    requeue(db, old.id)
    (new,) = claim(db, A)  # the same worker claims it again: only the attempt differs
    assert new.attempt == old.attempt + 1 and rec_a.start(new)

    with caplog.at_level(logging.WARNING, logger="tether.worker.recorder"):
        assert rec_a.record(old, FAILED) == (None, None)
    assert lost_warnings(caplog, old.id)
    assert task_row(db, old.id)["status"] == "RUNNING"
    assert rec_a.record(new, COMPLETED) == ("COMPLETED", None)
    assert [a["attempt"] for a in attempt_rows(db, new.id)] == [new.attempt]


def test_a_lost_outcome_does_not_stop_the_next_task_starting(
    db: psycopg.Connection[Any],
    basic: ModuleType,
    recorders: tuple[Recorder, Recorder],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The child records an outcome and starts its next task in one transaction.
    rec_a, _ = recorders
    basic.add.send(1, 2)
    basic.add.send(3, 4)
    first, second = claim(db, A, limit=2)
    assert rec_a.start(first)
    requeue(db, first.id)
    (stolen,) = claim(db, B)
    assert stolen.id == first.id

    with caplog.at_level(logging.WARNING, logger="tether.worker.recorder"):
        assert rec_a.record(first, COMPLETED, next_task=second) == (None, True)
    assert lost_warnings(caplog, first.id)
    assert task_row(db, first.id)["status"] == "CLAIMED"
    row = task_row(db, second.id)
    assert (row["status"], row["claimed_by_worker_id"]) == ("RUNNING", A)


def test_start_after_losing_the_claim_is_refused(
    db: psycopg.Connection[Any],
    basic: ModuleType,
    recorders: tuple[Recorder, Recorder],
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec_a, rec_b = recorders
    basic.add.send(1, 2)
    (task_a,) = claim(db, A)
    requeue(db, task_a.id)  # stale claim requeued before A's child started it
    (task_b,) = claim(db, B)

    with caplog.at_level(logging.WARNING, logger="tether.worker.recorder"):
        assert rec_a.start(task_a) is False
    assert lost_warnings(caplog, task_a.id)
    row = task_row(db, task_a.id)
    assert (row["status"], row["attempt"], row["claimed_by_worker_id"]) == ("CLAIMED", 2, B)
    assert row["started_at"] is None

    assert rec_b.start(task_b) is True
    row = task_row(db, task_b.id)
    assert (row["status"], row["claimed_by_worker_id"]) == ("RUNNING", B)
    assert row["started_at"] >= row["claimed_at"]


def test_a_cancelled_claimed_task_cannot_start(
    db: psycopg.Connection[Any],
    basic: ModuleType,
    recorders: tuple[Recorder, Recorder],
) -> None:
    rec_a, _ = recorders
    handle = basic.add.send(1, 2)
    (task,) = claim(db, A)
    assert task_row(db, task.id)["status"] == "CLAIMED"
    assert handle.cancel() is CancelReply.CANCELLED

    assert rec_a.start(task) is False
    row = task_row(db, task.id)
    assert row["status"] == "CANCELLED" and row["started_at"] is None
    assert handle.status() is TaskStatus.CANCELLED
    assert handle.get(timeout=5).err.code == ErrorCode.TASK_CANCELLED
    # And nothing it might still try to record lands.
    assert rec_a.record(task, COMPLETED) == (None, None)
    assert task_row(db, task.id)["status"] == "CANCELLED"
    assert attempt_rows(db, task.id) == []


def test_releasing_a_stale_claim_leaves_the_newer_claim_alone(
    db: psycopg.Connection[Any],
    basic: ModuleType,
    recorders: tuple[Recorder, Recorder],
) -> None:
    # Release (graceful shutdown, a child that died before starting) is a transition too:
    # it must present the attempt it holds, like every other fenced write.
    rec_a, _ = recorders
    basic.add.send(1, 2)
    (old,) = claim(db, A)
    requeue(db, old.id)
    (new,) = claim(db, A)  # the same worker holds a newer claim of the same task
    assert new.attempt == old.attempt + 1

    assert rec_a.release([old]) == set()
    row = task_row(db, new.id)
    assert (row["status"], row["attempt"], row["claimed_by_worker_id"]) == ("CLAIMED", new.attempt, A)
    assert rec_a.start(new) is True
    assert rec_a.release([new]) == set()  # started: no longer releasable
    assert task_row(db, new.id)["status"] == "RUNNING"
