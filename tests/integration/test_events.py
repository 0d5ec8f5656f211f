"""Events (docs/durable-steps.md#events) with real workers: a task waiting for an event is
PENDING and holds no slot; a send from another process delivers its payload and wakes it at
once; an event sent before anyone waits is delivered to the first waiter; a timeout raises
EventTimeoutError (code EVENT_TIMEOUT); a send inside the caller's transaction counts only
if it commits; bad input is refused naming the argument, and changes nothing.
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import attempt_rows, task_row
from tests.chaos.conftest import check_history, runs, token, wait_status
from tests.cli_support import run_json, tether_command
from tests.conftest import WorkerFactory, wait_until
from tests.integration.test_durable_sleep import APP, ASYNC_ONLY, ONE_CHILD, WAKE_BOUND_S, Conn
from tests.integration.test_durable_sleep import sleeps as sleeps  # the fixture: the same app and ledger
from tether.errors import EventError


def waiting(db: Conn, task_id: Any, key: str) -> dict[str, Any]:
    """Wait until the task waits for ``key`` (PENDING, a wait row); its SUSPENDED attempt row."""

    def seen() -> dict[str, Any] | None:
        wait = db.execute("SELECT key FROM tether_event_waits WHERE task_id = %s", (task_id,)).fetchone()
        if wait is None or wait["key"] != key or task_row(db, task_id)["status"] != "PENDING":
            return None
        return attempt_rows(db, task_id)[-1]

    return wait_until(seen, timeout=30, message=f"task {task_id} to wait for {key!r}")  # type: ignore[no-any-return]


def events(db: Conn, key: str) -> list[tuple[Any, str | None]]:
    rows = db.execute(
        "SELECT payload, delivered_to::text AS delivered_to FROM tether_events WHERE key = %s ORDER BY id",
        (key,),
    ).fetchall()
    return [(r["payload"], r["delivered_to"]) for r in rows]


@pytest.mark.timing
def test_an_event_from_another_process_resumes_the_waiting_task_with_its_payload(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory, database_url: str
) -> None:
    worker = workers.start(APP, *ONE_CHILD)
    tok, key = token(), f"approval:{token()}"
    handle = sleeps.wait_event.send(tok, key, 120)
    row = waiting(db, handle.id, key)
    assert (row["outcome"], row["event_key"]) == ("SUSPENDED", key)
    assert task_row(db, handle.id)["run_at"] == row["resume_at"]  # due at its timeout meanwhile
    # Its slot is free: another task runs while it waits.
    assert sleeps.quick.send(tok).get(timeout=10).ok == "quick"

    sent = tether_command(database_url, "send-event", key, '{"approved": true, "by": "ann"}', "--json")
    assert sent.returncode == 0, sent.stderr
    answer = json.loads(sent.stdout)
    assert answer["delivered_to"] == str(handle.id)
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    row, attempts = check_history(db, handle.id)
    assert [(a["outcome"], a["worker_id"]) for a in attempts] == [
        ("SUSPENDED", worker.worker_id),
        ("COMPLETED", worker.worker_id),
    ]
    assert row["result"] == {
        "ok": {"payload": {"approved": True, "by": "ann"}, "attempt": attempts[1]["attempt"]}
    }
    assert [runs(db, f"{tok}:{s}") for s in ("before", "after")] == [1, 1]
    assert events(db, key) == [({"approved": True, "by": "ann"}, str(handle.id))]
    assert db.execute("SELECT count(*) AS n FROM tether_event_waits").fetchone()["n"] == 0
    # Woken at once: the send made it due and told the worker.
    sent_at = db.execute("SELECT delivered_at FROM tether_events WHERE key = %s", (key,)).fetchone()[
        "delivered_at"
    ]
    assert 0 <= (attempts[1]["started_at"] - sent_at).total_seconds() < WAKE_BOUND_S


def test_an_event_sent_first_is_delivered_to_the_first_waiter(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    """Each send is one event: of two sent before anyone waits, the first waiter gets the first
    (without suspending), the second stays kept for the next waiter."""
    key = f"early:{token()}"
    first = sleeps.app.send_event(key, {"n": 1})
    second = sleeps.app.send_event(key, {"n": 2})
    assert first.delivered_to is None and second.delivered_to is None
    assert second.event_id > first.event_id
    workers.start(APP, *ONE_CHILD)
    tok = token()
    handle = sleeps.wait_event.send(tok, key, 60)
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    assert row["result"]["ok"]["payload"] == {"n": 1}
    assert [a["outcome"] for a in attempt_rows(db, handle.id)] == ["COMPLETED"]  # taken at once
    assert events(db, key) == [({"n": 1}, str(handle.id)), ({"n": 2}, None)]
    # The next waiter gets the second.
    other = sleeps.wait_event.send(token(), key, 60)
    assert wait_status(db, other.id, "COMPLETED", timeout=30)["result"]["ok"]["payload"] == {"n": 2}


@pytest.mark.timing
def test_a_timeout_gives_event_timeout(sleeps: ModuleType, db: Conn, workers: WorkerFactory) -> None:
    workers.start(APP, *ONE_CHILD)
    caught = sleeps.wait_catches.send(f"never:{token()}", 1)
    uncaught = sleeps.wait_uncaught.send(f"never:{token()}", 1)
    row = wait_status(db, caught.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    ok = row["result"]["ok"]
    assert ok["timed_out"] == "EVENT_TIMEOUT" and ok["key"].startswith("never:")
    assert ok["message"].startswith(f"wait_for_event({ok['key']!r}): no event came before the timeout of 1s")
    steps = db.execute(
        "SELECT name, result FROM tether_task_steps WHERE task_id = %s", (caught.id,)
    ).fetchall()
    assert [(s["name"], s["result"]["timed_out"]) for s in steps] == [("tether.event", True)]

    row = wait_status(db, uncaught.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert (row["status"], row["error_code"]) == ("FAILED", "EVENT_TIMEOUT"), row
    assert row["result"]["err"]["data"]["timeout_s"] == 1
    for handle in (caught, uncaught):
        attempts = attempt_rows(db, handle.id)
        assert attempts[0]["outcome"] == "SUSPENDED"
        late = (attempts[1]["started_at"] - attempts[0]["resume_at"]).total_seconds()
        assert 0 <= late < WAKE_BOUND_S, late
    assert db.execute("SELECT count(*) AS n FROM tether_event_waits").fetchone()["n"] == 0


def test_a_send_in_the_callers_transaction_counts_only_if_it_commits(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory, direct_url: str, database_url: str
) -> None:
    """(And a waiting task is shown waiting by tether task ID.)"""
    workers.start(APP, *ONE_CHILD)
    tok, key = token(), f"tx:{token()}"
    handle = sleeps.wait_event.send(tok, key, 120)
    row = waiting(db, handle.id, key)
    timeout = row["resume_at"].isoformat(sep=" ", timespec="seconds")
    shown = run_json(database_url, "task", str(handle.id))["suspension"]["state"]
    assert shown == f"waiting for event {key!r} (timeout at {timeout}; after step 'before')"
    # handle.info() gives it too, typed: the wait's key, its timeout, the step before it.
    suspension = handle.info().suspension
    assert suspension is not None and suspension.describe() == shown
    assert (suspension.kind, suspension.event_key, suspension.waiting) == ("event", key, True)
    assert (suspension.until, suspension.run_at, suspension.after_step) == (
        row["resume_at"],
        row["resume_at"],
        "before",
    )
    with psycopg.connect(direct_url) as conn:
        with conn.transaction(force_rollback=True):
            sent = sleeps.app.with_options(connection=conn).send_event(key, "rolled back")
            assert sent.delivered_to == handle.id  # as seen inside the transaction
        assert events(db, key) == []
        assert task_row(db, handle.id)["status"] == "PENDING"
        with conn.transaction():
            sleeps.app.with_options(connection=conn).send_event(key, "committed")
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["result"]["ok"]["payload"] == "committed", row
    assert handle.info().suspension is None  # done waiting: nothing to show


def test_bad_events_are_refused_and_change_nothing(sleeps: ModuleType, db: Conn, database_url: str) -> None:
    with pytest.raises(EventError, match=r"send_event: key must be a non-empty string of at most 200"):
        sleeps.app.send_event("", 1)
    with pytest.raises(EventError, match=r"send_event: payload is not JSON"):
        sleeps.app.send_event("k", object())
    with pytest.raises(EventError, match=r"send_event: key 'a\\tb' contains control characters"):
        sleeps.app.send_event("a\tb", 1)
    bad = tether_command(database_url, "send-event", "k", "{not json")
    assert bad.returncode == 1 and "error: send-event: PAYLOAD is not JSON" in bad.stderr, bad.stderr
    bad = tether_command(database_url, "send-event", "", "1")
    assert bad.returncode == 1 and "error: send-event: key must be a non-empty string" in bad.stderr, (
        bad.stderr
    )
    assert db.execute("SELECT count(*) AS n FROM tether_events").fetchone()["n"] == 0


@pytest.mark.timing
def test_async_tasks_wait_in_the_async_executor(sleeps: ModuleType, db: Conn, workers: WorkerFactory) -> None:
    workers.start(APP, *ASYNC_ONLY)
    tok, key = token(), f"async:{token()}"
    handle = sleeps.wait_event_async.send(tok, key, 120)
    waiting(db, handle.id, key)
    assert sleeps.app.send_event(key, [1, 2, 3]).delivered_to == handle.id
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["status"] == "COMPLETED", row
    assert row["result"]["ok"]["payload"] == [1, 2, 3]
    assert [a["outcome"] for a in attempt_rows(db, handle.id)] == ["SUSPENDED", "COMPLETED"]
    assert [runs(db, f"{tok}:{s}") for s in ("before", "after")] == [1, 1]


def test_cancel_a_waiting_task_and_the_event_goes_to_the_next_waiter(
    sleeps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    workers.start(APP, *ONE_CHILD)
    key = f"cancel:{token()}"
    handle = sleeps.wait_event.send(token(), key, 120)
    waiting(db, handle.id, key)
    assert handle.cancel()
    assert wait_status(db, handle.id, "CANCELLED", timeout=10)["error_code"] == "TASK_CANCELLED"
    sent = sleeps.app.send_event(key, "for whoever waits next")
    assert sent.delivered_to is None  # a cancelled waiter gets nothing
    assert events(db, key) == [("for whoever waits next", None)]
    # Retried by hand, it waits afresh and takes the kept event at once.
    assert handle.retry().retried
    row = wait_status(db, handle.id, {"COMPLETED", "FAILED"}, timeout=30)
    assert row["result"]["ok"]["payload"] == "for whoever waits next", row
    assert db.execute("SELECT count(*) AS n FROM tether_event_waits").fetchone()["n"] == 0
