"""Requests whose answer is lost with their connection still answer what they did.

PostgresBroker.run repeats work on another pooled connection when the first turns out
dead. A statement may have run and committed before its connection died; repeated, a
request that changes something would answer for the state its first attempt left
("already paused", "already ended", "it is PENDING") instead of for what it did. Each
test here loses that answer for real: the app reaches the database through a proxy
(tests/wire_cutter.py) that ends the connection right after the server finished the
chosen statement's transaction, before the client reads that it did. The test then
checks that the repeat happened (the broker's warning), that the change was made once,
and that the answer is the one the first attempt earned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import connect, load_app_module
from tests.conftest import wait_until
from tests.wire_cutter import WireCutter
from tether import AppConfig, PostgresConfig, Tether
from tether.cancelling import CancelReply
from tether.periodic import sync_declared
from tether.queue_control import pause_queue, resume_queue
from tether.result import TaskStatus
from tether.retrying import RetryFilter

Conn = psycopg.Connection[Any]


@pytest.fixture
def cutter(database_url: str) -> Iterator[WireCutter]:
    with WireCutter(database_url) as proxy:
        yield proxy


@pytest.fixture
def proxied(cutter: WireCutter, db: Conn) -> Iterator[Tether]:
    """An app that reaches the test database only through the cutter."""
    app = Tether(AppConfig(broker=PostgresConfig(database_url=cutter.url), queues=["default"]))
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def lost(cutter: WireCutter, caplog: pytest.LogCaptureFixture) -> Iterator[Any]:
    """lost(text): the next statement containing ``text`` loses its answer. At the end of the
    test: it did, and the broker repeated the request on another connection."""
    caplog.set_level(logging.INFO, logger="tether.broker")
    wanted: list[str] = []

    def arm(text: str) -> None:
        wanted.append(text)
        cutter.cut_after(text)

    yield arm
    assert wanted, "the test armed no cut"
    assert len(cutter.cut) == len(wanted) and all(w in c for w, c in zip(wanted, cutter.cut, strict=True)), (
        f"expected answers lost after {wanted}, the proxy cut {cutter.cut}"
    )
    repeats = [r for r in caplog.get_records("call") if "a pooled connection was dead" in r.getMessage()]
    assert len(repeats) == len(wanted), caplog.text


def status_of(db: Conn, task_id: Any) -> str:
    row = db.execute("SELECT status FROM tether_tasks WHERE id = %s", (task_id,)).fetchone()
    assert row is not None
    return str(row["status"])


def test_a_queue_pause_whose_answer_was_lost_says_it_paused(proxied: Tether, lost: Any, db: Conn) -> None:
    lost("INSERT INTO tether_paused_queues")
    assert pause_queue(proxied.broker, "default", by="ops") is True
    rows = db.execute("SELECT queue, paused_by FROM tether_paused_queues").fetchall()
    assert [(r["queue"], r["paused_by"]) for r in rows] == [("default", "ops")]
    assert pause_queue(proxied.broker, "default", by="ops") is False  # a new request: paused already


def test_a_queue_resume_whose_answer_was_lost_says_it_resumed(proxied: Tether, lost: Any, db: Conn) -> None:
    assert pause_queue(proxied.broker, "default", by="ops") is True
    lost("DELETE FROM tether_paused_queues")
    assert resume_queue(proxied.broker, "default", by="ops") is True
    assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}
    assert resume_queue(proxied.broker, "default", by="ops") is False  # a new request: not paused


def test_a_cancel_whose_answer_was_lost_says_it_cancelled(
    basic: ModuleType, proxied: Tether, lost: Any, db: Conn
) -> None:
    task = basic.add.send(1, 2)  # no worker: it stays PENDING
    lost("cancelled before it ran")
    answer = proxied.handle(task.id).cancel(by="ops")
    assert (answer, status_of(db, task.id)) == (CancelReply.CANCELLED, "CANCELLED")
    assert proxied.handle(task.id).cancel() == CancelReply.ALREADY_ENDED  # a new request


def cancelled_tasks(basic: ModuleType, n: int) -> list[Any]:
    """``n`` CANCELLED tasks: ended, so a retry takes them (no worker runs here)."""
    handles = [basic.add.send(i, 1) for i in range(n)]
    assert all(h.cancel() for h in handles)
    return handles


RETRY_STATEMENT = "by_key FROM held"  # retries.sql retry_tasks: the statement that retries


def test_a_retry_whose_answer_was_lost_says_it_retried(
    basic: ModuleType, proxied: Tether, lost: Any, db: Conn
) -> None:
    [task] = cancelled_tasks(basic, 1)
    lost(RETRY_STATEMENT)
    answer = proxied.handle(task.id).retry(by="ops")
    assert (answer.retried, answer.status, status_of(db, task.id)) == (True, TaskStatus.PENDING, "PENDING")


def test_a_bulk_retry_whose_batch_answer_was_lost_counts_the_batch_as_retried(
    basic: ModuleType, proxied: Tether, lost: Any, db: Conn
) -> None:
    handles = cancelled_tasks(basic, 3)
    lost(RETRY_STATEMENT)
    bulk = proxied.retry_tasks(RetryFilter(statuses=("CANCELLED",)), by="ops")
    assert (bulk.matched, bulk.retried, bulk.skipped, bulk.skips) == (3, 3, 0, [])
    assert {status_of(db, h.id) for h in handles} == {"PENDING"}


@pytest.mark.parametrize("request_", ["pause", "resume"])
def test_a_schedule_pause_or_resume_whose_answer_was_lost_says_it_changed_it(
    basic: ModuleType, proxied: Tether, lost: Any, db: Conn, request_: str
) -> None:
    schedule = basic.app.periodic("*/5 * * * *", basic.add, name="add-5m", args=(1, 2))
    try:
        with basic.app.broker.connection() as conn:
            sync_declared(conn, [schedule], ["default"])  # what a starting worker does
    finally:
        basic.app.schedules.clear()
    if request_ == "resume":
        assert proxied.pause_schedule("add-5m") is True
    lost("slots_after = CASE WHEN")  # schedules.sql set_schedule_paused
    changed = getattr(proxied, f"{request_}_schedule")("add-5m")
    paused = db.execute("SELECT paused FROM tether_schedules").fetchone()
    assert (changed, paused) == (True, {"paused": request_ == "pause"})


@pytest.mark.parametrize(
    ("request_", "statement", "after"),
    [
        ("pause", "SET status = 'PAUSED'", "PAUSED"),
        ("resume", "SET status = 'RUNNING', paused_at = NULL", "RUNNING"),
        ("cancel", "UPDATE tether_workflows SET status = 'CANCELLED'", "CANCELLED"),
    ],
)
def test_a_workflow_request_whose_answer_was_lost_says_it_changed_it(
    database_url: str, proxied: Tether, lost: Any, db: Conn, request_: str, statement: str, after: str
) -> None:
    flows = load_app_module("flows", database_url)
    first = flows.number.node(args=(1,))
    second = flows.add.node(kwargs={"b": 2}, args_from={"a": first})
    started = flows.app.workflow("pair", [first, second]).start()  # no worker: it stays RUNNING
    handle = proxied.workflow_handle(started.id)
    if request_ == "resume":
        assert handle.pause() is True
    lost(statement)
    changed = getattr(handle, request_)()
    row = db.execute("SELECT status FROM tether_workflows WHERE id = %s", (started.id,)).fetchone()
    assert (changed, row) == (True, {"status": after})


def test_a_first_attempt_that_commits_while_the_repeat_works_gives_the_answer(
    proxied: Tether, cutter: WireCutter, db: Conn, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The connection ends as soon as the client's COMMIT has passed to the server, and the
    server commits only later, while the repeat is already at work: held here by a deferred
    trigger that waits for a lock the test holds. The repeat's pause waits for the first
    attempt's row, finds the queue paused, and would say "already paused"; the primary key of
    the answers makes it roll back and return the first attempt's answer instead."""
    caplog.set_level(logging.INFO, logger="tether.broker")
    db.execute(
        "CREATE FUNCTION tether_test_hold_commit() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN PERFORM pg_advisory_xact_lock_shared(4242); RETURN NULL; END $$"
    )
    db.execute(
        "CREATE CONSTRAINT TRIGGER tether_test_hold_commit AFTER INSERT ON tether_request_answers"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION tether_test_hold_commit()"
    )
    answers: list[bool] = []
    try:
        with connect(database_url) as holder:
            holder.execute("SELECT pg_advisory_lock(4242)")
            cutter.cut_at_commit("INSERT INTO tether_paused_queues")
            thread = threading.Thread(target=lambda: answers.append(pause_queue(proxied.broker, "default")))
            thread.start()
            try:
                wait_until(
                    lambda: (
                        db.execute(
                            "SELECT count(*) AS n FROM pg_stat_activity WHERE query LIKE 'WITH paused AS%%'"
                            " AND wait_event_type = 'Lock' AND datname = current_database()"
                        ).fetchone()
                        == {"n": 1}
                    ),
                    message="the repeat's pause to wait for the first attempt's row",
                )
                assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}
            finally:
                holder.execute("SELECT pg_advisory_unlock(4242)")  # the first attempt commits now
                thread.join(timeout=30)
    finally:
        db.execute("DROP TRIGGER tether_test_hold_commit ON tether_request_answers")
        db.execute("DROP FUNCTION tether_test_hold_commit()")
    assert answers == [True]
    assert len(cutter.cut) == 1 and db.execute(
        "SELECT count(*) AS n FROM tether_paused_queues"
    ).fetchone() == {"n": 1}
    logged = caplog.text
    assert "a pooled connection was dead" in logged
    assert "the request's first attempt committed while it was repeated" in logged, logged
