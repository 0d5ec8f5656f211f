"""Step writes are fenced like outcomes (docs/durable-steps.md): an attempt that lost its task
records no step, also when its write was waiting for the row while the task was recovered.

As tests/integration/test_fencing.py: no worker process; the test drives the claim and two
Recorders (the class a worker child writes its steps with) as workers A and B, and plays
the reaper with plain SQL, so every step of the race happens in a known order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import load_app_module, task_row
from tests.conftest import wait_until
from tests.integration.test_fencing import A, B, claim, lost_warnings, requeue
from tether.config import AppConfig, PostgresConfig
from tether.worker.recorder import Recorder

Conn = psycopg.Connection[Any]


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


def stored(db: Conn, task_id: str) -> list[tuple[str, int, Any, int]]:
    rows = db.execute(
        "SELECT name, occurrence, result, attempt FROM tether_task_steps WHERE task_id = %s"
        " ORDER BY written_at",
        (task_id,),
    ).fetchall()
    return [(r["name"], r["occurrence"], r["result"], r["attempt"]) for r in rows]


def test_a_zombie_attempt_cannot_record_a_step(
    db: Conn, basic: ModuleType, recorders: tuple[Recorder, Recorder], caplog: pytest.LogCaptureFixture
) -> None:
    rec_a, rec_b = recorders
    basic.add.send(1, 2)
    (task_a,) = claim(db, A)
    assert rec_a.start(task_a)
    assert rec_a.load_steps(task_a) == {}
    assert rec_a.write_step(task_a, "one", 0, '{"b": 2, "a": 1}') == '{"a": 1, "b": 2}'  # as jsonb keeps it
    requeue(db, task_a.id)  # A is declared dead while its code runs
    (task_b,) = claim(db, B)
    assert rec_b.start(task_b)

    with caplog.at_level(logging.WARNING, logger="tether.worker.recorder"):
        assert rec_a.write_step(task_a, "two", 0, "20") is None
    (warning,) = lost_warnings(caplog, task_a.id)
    assert "could not record step 'two'" in warning and "nothing was changed" in warning

    # B, the live attempt, gets A's first step back and records the second.
    assert rec_b.load_steps(task_b) == {("one", 0): '{"a": 1, "b": 2}'}
    assert rec_b.write_step(task_b, "two", 0, "20") == "20"
    assert stored(db, task_a.id) == [("one", 0, {"a": 1, "b": 2}, 1), ("two", 0, 20, 2)]


def test_a_step_write_waiting_for_the_row_during_a_recovery_records_nothing(
    db: Conn,
    database_url: str,
    basic: ModuleType,
    recorders: tuple[Recorder, Recorder],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A recovery has updated the task's row, not yet committed, when A's step write arrives: the
    write waits for the row (FOR SHARE conflicts with the update), then re-reads it as the
    recovery left it and matches nothing. Without the row lock, the write would check the
    fence in its snapshot (still RUNNING under A) and store the step of a lost attempt."""
    rec_a, _ = recorders
    basic.add.send(1, 2)
    (task,) = claim(db, A)
    assert rec_a.start(task)
    answers: list[str | None] = []
    with psycopg.connect(database_url, autocommit=False) as reaper:
        # The recovery's UPDATE, not yet committed: it holds the row (FOR NO KEY UPDATE).
        reaper.execute(
            "UPDATE tether_tasks SET status = 'FAILED', error_code = 'WORKER_CRASHED', failed_at = now()"
            " WHERE id = %s",
            (task.id,),
        )
        writing = threading.Thread(target=lambda: answers.append(rec_a.write_step(task, "one", 0, "1")))
        with caplog.at_level(logging.WARNING, logger="tether.worker.recorder"):
            writing.start()
            wait_until(
                lambda: (
                    db.execute(
                        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND query LIKE %s",
                        ("%tether_task_steps%",),
                    ).fetchone()["n"]
                    == 1
                ),
                timeout=10,
                message="A's step write to wait for the task's row",
            )
            reaper.commit()
            writing.join(timeout=10)
    assert answers == [None]
    assert lost_warnings(caplog, task.id), caplog.text
    assert stored(db, task.id) == []
    assert task_row(db, task.id)["status"] == "FAILED"


def test_a_write_retried_after_its_commit_finds_its_own_step(
    db: Conn, basic: ModuleType, recorders: tuple[Recorder, Recorder]
) -> None:
    """A connection lost around the COMMIT makes the recorder run the write again: the step is
    there (ON CONFLICT), still held by this attempt, so the write counts as done, once."""
    rec_a, _ = recorders
    basic.add.send(1, 2)
    (task,) = claim(db, A)
    assert rec_a.start(task)
    assert rec_a.write_step(task, "one", 0, "1") == "1"
    assert rec_a.write_step(task, "one", 0, "1") == "1"
    assert stored(db, task.id) == [("one", 0, 1, task.attempt)]


def test_a_batch_of_steps_is_fenced_row_by_row(
    db: Conn, basic: ModuleType, recorders: tuple[Recorder, Recorder], caplog: pytest.LogCaptureFixture
) -> None:
    """An async child's batch (write_steps): the steps of a task A lost add nothing, the others
    are written, a row already written by this attempt counts as done."""
    rec_a, rec_b = recorders
    basic.add.send(1, 2)
    basic.add.send(3, 4)
    kept, lost = claim(db, A, limit=2)
    assert rec_a.start(kept) and rec_a.start(lost)
    assert rec_a.write_step(kept, "one", 0, "1") == "1"
    requeue(db, lost.id)
    (again,) = claim(db, B)
    assert again.id == lost.id and rec_b.start(again)

    writes = [
        (kept, "one", 0, "1"),  # already there: a retry after a lost COMMIT
        (kept, "one", 1, '{"y": 2, "x": 1}'),
        (lost, "one", 0, "10"),
        (kept, "two", 0, "20"),
    ]
    with caplog.at_level(logging.WARNING, logger="tether.worker.recorder"):
        assert rec_a.write_steps(writes) == ["1", '{"x": 1, "y": 2}', None, "20"]
    assert lost_warnings(caplog, lost.id)
    assert sorted(stored(db, kept.id)) == [
        ("one", 0, 1, kept.attempt),
        ("one", 1, {"x": 1, "y": 2}, kept.attempt),
        ("two", 0, 20, kept.attempt),
    ]
    assert stored(db, lost.id) == []
