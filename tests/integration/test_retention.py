"""Retention in small batches (worker/retention.py, broker/sql/retention.sql), on PostgreSQL.

The reaper runs ``Retention.run`` after a pass that acted; here the test runs it itself, with
a clock it turns and batches of a few rows, and checks which rows go, in how many batches,
and what a batch that ran out of budget leaves for the next pass.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

from tether.config import RecoveryConfig
from tether.worker.retention import FROM_THE_START_EVERY_S, Retention

Conn = psycopg.Connection[Any]
CONFIG = RecoveryConfig(
    heartbeat_retention_hours=24, worker_state_retention_hours=168, terminal_record_retention_hours=720
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def heartbeats(db: Conn, n: int, hours_old: float, sender: str = "gone-1-ab") -> None:
    db.execute(
        "INSERT INTO tether_heartbeats (task_id, sender_id, role, sent_at, hostname, pid)"
        " SELECT gen_random_uuid(), %s, 'runner', now() - make_interval(hours => %s) - g * interval '1 ms',"
        " 'gone', 1 FROM generate_series(1, %s) g",
        (sender, hours_old, n),
    )


def tasks(db: Conn, n: int, status: str, hours_old: float) -> list[Any]:
    rows = db.execute(
        "INSERT INTO tether_tasks (id, name, queue, status, updated_at)"
        " SELECT gen_random_uuid(), 'old', 'default', %s,"
        " now() - make_interval(hours => %s) - g * interval '1 ms'"
        " FROM generate_series(1, %s) g RETURNING id",
        (status, hours_old, n),
    ).fetchall()
    ids = [r["id"] for r in rows]
    db.execute(
        "INSERT INTO tether_task_attempts (task_id, attempt, outcome)"
        " SELECT unnest(%s::uuid[]), 1, 'COMPLETED'",
        (ids,),
    )
    return ids


def count(db: Conn, statement: str, *params: Any) -> int:
    return int(db.execute(statement, params).fetchone()["n"])


def old_beats(db: Conn) -> int:
    return count(
        db, "SELECT count(*) AS n FROM tether_heartbeats WHERE sent_at < now() - interval '24 hours'"
    )


def logged(caplog: pytest.LogCaptureFixture) -> str:
    return " ".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("retention: pruned"))


def test_a_pass_deletes_in_batches_exactly_the_rows_past_retention(
    db: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    heartbeats(db, 35, 25)
    heartbeats(db, 5, 23, sender="young-1-ab")
    finished = tasks(db, 23, "COMPLETED", 721)
    pending = tasks(db, 2, "PENDING", 721)  # old, but not finished: never pruned
    recent = tasks(db, 3, "FAILED", 719)
    retention = Retention(CONFIG, batch=10, budget_s=60, clock=Clock())

    with caplog.at_level(logging.INFO, logger="tether.recovery"):
        assert retention.run(db) == {"heartbeats": 35, "tasks": 23}
    assert not retention.behind
    assert old_beats(db) == 0
    assert count(db, "SELECT count(*) AS n FROM tether_heartbeats WHERE sender_id = 'young-1-ab'") == 5
    left = {r["id"] for r in db.execute("SELECT id FROM tether_tasks").fetchall()}
    assert left == {*pending, *recent}
    attempts = count(db, "SELECT count(*) AS n FROM tether_task_attempts WHERE task_id = ANY(%s)", finished)
    assert attempts == 0  # with their task
    # 4 + 3 batches of at most 10 rows that found rows, 1 each for the other five kinds.
    assert "35 heartbeats, 23 tasks in 12 batch(es)" in logged(caplog)


def test_events_no_task_took_are_pruned_and_delivered_ones_go_with_their_task(db: Conn) -> None:
    """docs/durable-steps.md#events: an undelivered event is kept for the terminal record
    retention; a delivered one lives as long as the task it went to."""
    (finished,) = tasks(db, 1, "COMPLETED", 721)
    (waiting,) = tasks(db, 1, "PENDING", 721)
    db.execute(
        "INSERT INTO tether_events (key, payload, sent_at, delivered_to, delivered_at) VALUES"
        " ('old', '1', now() - interval '721 hours', NULL, NULL),"
        " ('young', '2', now() - interval '719 hours', NULL, NULL),"
        " ('to-finished', '3', now() - interval '721 hours', %s, now()),"
        " ('to-pending', '4', now() - interval '721 hours', %s, now())",
        (finished, waiting),
    )
    retention = Retention(CONFIG, batch=10, budget_s=60, clock=Clock())
    assert retention.run(db) == {"tasks": 1, "events": 1}
    left = [r["key"] for r in db.execute("SELECT key FROM tether_events ORDER BY key").fetchall()]
    assert left == ["to-pending", "young"]


def steps(db: Conn, ids: list[Any], per_task: int) -> None:
    """``per_task`` recorded steps for each task (as a running attempt writes them)."""
    db.execute(
        "INSERT INTO tether_task_steps (task_id, name, occurrence, result, attempt)"
        " SELECT t, 'step', g, to_jsonb(g), 1 FROM unnest(%s::uuid[]) t, generate_series(0, %s - 1) g",
        (ids, per_task),
    )


def steps_of(db: Conn, ids: list[Any]) -> int:
    return count(db, "SELECT count(*) AS n FROM tether_task_steps WHERE task_id = ANY(%s)", ids)


def test_a_pruned_task_takes_its_recorded_steps_with_it(db: Conn) -> None:
    """Checkpointed steps go with their task (their foreign key cascades): none is left
    behind by retention, and the steps of the tasks it keeps stay."""
    finished = tasks(db, 12, "FAILED", 721)
    pending = tasks(db, 2, "PENDING", 721)  # not finished: kept, and a retry would need its steps
    recent = tasks(db, 3, "COMPLETED", 719)
    for ids in (finished, pending, recent):
        steps(db, ids, 3)
    assert steps_of(db, finished) == 36

    assert Retention(CONFIG, batch=5, budget_s=60, clock=Clock()).run(db) == {"tasks": 12}
    assert steps_of(db, finished) == 0
    assert steps_of(db, pending) == 6 and steps_of(db, recent) == 9
    orphans = count(
        db,
        "SELECT count(*) AS n FROM tether_task_steps s"
        " WHERE NOT EXISTS (SELECT 1 FROM tether_tasks t WHERE t.id = s.task_id)",
    )
    assert orphans == 0


def test_a_pass_out_of_budget_leaves_the_rest_for_the_next_and_says_it_is_behind(db: Conn) -> None:
    heartbeats(db, 25, 25)
    clock = Clock()
    retention = Retention(CONFIG, batch=10, budget_s=0, clock=clock)
    assert retention.run(db) == {"heartbeats": 10}  # one batch, then out of budget
    assert retention.behind and retention.due
    assert old_beats(db) == 15
    assert retention.run(db) == {"heartbeats": 10}
    assert retention.run(db) == {"heartbeats": 5}  # caught up
    assert not retention.behind and not retention.due  # the next pass in a minute
    clock.now += 60
    assert retention.due


def test_each_batch_reads_from_where_the_last_stopped_and_the_hourly_pass_from_the_start(db: Conn) -> None:
    heartbeats(db, 10, 30)
    clock = Clock()
    retention = Retention(CONFIG, batch=100, budget_s=60, clock=clock)
    assert retention.run(db) == {"heartbeats": 10}
    # Written with a time older than where the last batch stopped (by hand): not read by the
    # passes that go on from there...
    heartbeats(db, 3, 40)
    heartbeats(db, 2, 25)
    clock.now += 60
    assert retention.run(db) == {"heartbeats": 2}
    assert old_beats(db) == 3
    # ...but by the pass from the start, once an hour.
    clock.now += FROM_THE_START_EVERY_S
    assert retention.run(db) == {"heartbeats": 3}
    assert old_beats(db) == 0


def test_none_in_the_config_turns_that_kind_off(db: Conn) -> None:
    heartbeats(db, 3, 48)
    tasks(db, 2, "COMPLETED", 800)
    config = RecoveryConfig(heartbeat_retention_hours=None)
    assert Retention(config, clock=Clock()).run(db) == {"tasks": 2}
    assert old_beats(db) == 3
