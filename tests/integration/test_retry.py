"""Retrying FAILED, CANCELLED and EXPIRED tasks by hand (docs/tasks.md#retrying-by-hand), on a
real database with real worker processes: one by id (handle.retry(), `tether retry ID`), in
bulk by filter (app.retry_tasks(), `tether retry --status ...`), workflow steps
(docs/workflows.md#retrying-a-step) and unique keys.

Gated tasks (tests/apps/retrying.py) fail with GATE_CLOSED until the test opens their gate,
so a retried task succeeds exactly when the test says so. Tasks that need no worker to end
are CANCELLED (cancel() before they run) or EXPIRED (the reaper's expiry rule, run here).
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner, Result
from rich.console import Console

import tether.cli
import tether.cli.common
from tests.apps.support import attempt_rows, ensure_ledger, load_app_module, runs, task_row
from tests.apps.support import workflow_row as wf_row
from tests.apps.support import workflow_steps as steps
from tests.cli_support import tether_command
from tests.conftest import REPO, WorkerFactory, WorkerProcess, wait_until
from tether import BulkRetry, RetryAnswer, RetryFilter, TaskStatus, WorkflowStatus
from tether.broker.recovery import expire_pending
from tether.errors import InvalidOptionError, TaskNotFoundError
from tether.retrying import retry_task, retry_tasks

APP = "tests.apps.retrying:app"
WAIT = 60.0
Conn = psycopg.Connection[Any]


@pytest.fixture
def rt(database_url: str, db: Conn) -> ModuleType:
    """tests/apps/retrying.py on clean tables, with the ledger and the gates in place."""
    ensure_ledger(db)
    module = load_app_module("retrying", database_url)
    db.execute(module.GATES_DDL)
    db.execute("TRUNCATE tether_test_gates")
    return module


def token() -> str:
    return uuid.uuid4().hex


def open_gate(db: Conn, gate: str) -> None:
    db.execute("INSERT INTO tether_test_gates (gate) VALUES (%s) ON CONFLICT DO NOTHING", (gate,))


def worker(workers: WorkerFactory, queues: str = "default,other", processes: int = 2) -> WorkerProcess:
    return workers.start(APP, "--queues", queues, "--processes", str(processes))


def snapshot(db: Conn) -> dict[str, list[dict[str, Any]]]:
    """Every row a retry could touch, in a fixed order."""
    tables = {
        "tasks": "SELECT * FROM tether_tasks ORDER BY id",
        "attempts": "SELECT * FROM tether_task_attempts ORDER BY task_id, attempt",
        "keys": "SELECT * FROM tether_unique_keys ORDER BY task_name, unique_key",
        "workflows": "SELECT * FROM tether_workflows ORDER BY id",
        "steps": "SELECT * FROM tether_workflow_tasks ORDER BY workflow_id, node",
    }
    return {name: [dict(r) for r in db.execute(sql).fetchall()] for name, sql in tables.items()}


def statuses_of(db: Conn, ids: list[Any]) -> dict[str, int]:
    rows = db.execute(
        "SELECT status, count(*) AS n FROM tether_tasks WHERE id = ANY(%s) GROUP BY status", (ids,)
    ).fetchall()
    return {r["status"]: r["n"] for r in rows}


def cancelled(task: Any, *args: Any, **kwargs: Any) -> Any:
    """A task sent and cancelled before it ran (no worker needed): CANCELLED."""
    handle = task.send(*args, **kwargs)
    assert handle.cancel(by="test")
    assert handle.status() is TaskStatus.CANCELLED
    return handle


def expire_now(db: Conn) -> int:
    """The reaper's expiry rule, run here: PENDING tasks past good_until become EXPIRED."""
    with db.transaction():
        return expire_pending(db)


def key_row(db: Conn, name: str, key: str) -> dict[str, Any] | None:
    row = db.execute(
        "SELECT * FROM tether_unique_keys WHERE task_name = %s AND unique_key = %s", (name, key)
    ).fetchone()
    return None if row is None else dict(row)


# -- one task ------------------------------------------------------------------------------------


def test_a_failed_task_runs_again_as_a_new_attempt_and_completes(
    db: Conn, rt: ModuleType, workers: WorkerFactory
) -> None:
    gate, tok = token(), token()
    handle = rt.gated.send(gate, tok, 7)
    worker(workers)
    first = handle.get(timeout=WAIT)
    assert first.err is not None and first.err.code == "GATE_CLOSED"
    failed = task_row(db, handle.id)
    assert (failed["status"], failed["attempt"], failed["failed_at"] is not None) == ("FAILED", 1, True)

    open_gate(db, gate)
    answer = handle.retry(by="test-operator")

    assert isinstance(answer, RetryAnswer)
    assert answer.task_id == handle.id and answer.retried is True
    assert answer.status is TaskStatus.PENDING
    assert answer.reason == "retried: PENDING as a new attempt"
    assert answer.workflow_id is None
    again = handle.get(timeout=WAIT)
    assert again.ok == 7
    done = task_row(db, handle.id)
    assert done["status"] == "COMPLETED"
    assert done["attempt"] == 2 and done["retry_count"] == 0
    assert done["error_code"] is None and done["failed_at"] is None
    assert done["sent_at"] == failed["sent_at"] and done["args"] == failed["args"]
    history = attempt_rows(db, handle.id)
    assert [(a["attempt"], a["outcome"], a["error_code"]) for a in history] == [
        (1, "FAILED", "GATE_CLOSED"),
        (2, "COMPLETED", None),
    ]
    assert history[0]["finished_at"] <= history[1]["started_at"]
    assert runs(db, tok) == 2
    info = handle.info()
    assert [a.attempt for a in info.attempts] == [1, 2]


def test_the_retry_policy_starts_over(db: Conn, rt: ModuleType, workers: WorkerFactory) -> None:
    gate, tok = token(), token()
    handle = rt.gated_policy.send(gate, tok)  # one automatic retry of GATE_CLOSED
    worker(workers)
    assert handle.get(timeout=WAIT).err.code == "GATE_CLOSED"
    row = task_row(db, handle.id)
    assert (row["status"], row["retry_count"], row["attempt"]) == ("FAILED", 1, 2)

    # Retried by hand with the gate still closed: the policy's one retry applies again.
    assert handle.retry().retried
    assert handle.get(timeout=WAIT).err.code == "GATE_CLOSED"
    row = task_row(db, handle.id)
    assert (row["status"], row["retry_count"], row["attempt"]) == ("FAILED", 1, 4)
    assert [(a["attempt"], a["will_retry"]) for a in attempt_rows(db, handle.id)] == [
        (1, True),
        (2, False),
        (3, True),
        (4, False),
    ]

    open_gate(db, gate)
    assert handle.retry().retried
    assert handle.get(timeout=WAIT).ok == 1
    row = task_row(db, handle.id)
    assert (row["status"], row["retry_count"], row["attempt"]) == ("COMPLETED", 0, 5)
    assert [a["attempt"] for a in attempt_rows(db, handle.id)] == [1, 2, 3, 4, 5]
    assert runs(db, tok) == 5


def test_cancelled_and_expired_tasks_are_retried(db: Conn, rt: ModuleType, workers: WorkerFactory) -> None:
    gate = token()
    open_gate(db, gate)
    was_cancelled = cancelled(rt.gated, gate, token(), 1)
    later = datetime.now(UTC) + timedelta(hours=1)
    kept_deadline = cancelled(rt.gated, gate, token(), 2, good_until=later)
    expired = rt.gated.send(gate, token(), 3, good_until=datetime.now(UTC) - timedelta(seconds=1))
    assert expire_now(db) == 1
    assert expired.status() is TaskStatus.EXPIRED
    # As a RUNNING task's cancel request leaves it on the row: the retry must clear it, or
    # the new run's first failure would settle as CANCELLED.
    db.execute(
        "UPDATE tether_tasks SET cancel_requested_at = now(), cancel_requested_by = 'alice' WHERE id = %s",
        (was_cancelled.id,),
    )
    before = {h.id: task_row(db, h.id) for h in (was_cancelled, kept_deadline, expired)}

    answers = [h.retry(by="test") for h in (was_cancelled, kept_deadline, expired)]

    assert [(a.retried, a.status) for a in answers] == [(True, TaskStatus.PENDING)] * 3
    now = db.execute("SELECT now() AS now").fetchone()["now"]
    for handle in (was_cancelled, kept_deadline, expired):
        row, old = task_row(db, handle.id), before[handle.id]
        assert row["status"] == "PENDING" and row["attempt"] == old["attempt"] == 0
        assert row["retry_count"] == 0 and row["result"] is None and row["error_code"] is None
        for column in (
            "cancelled_at",
            "expired_at",
            "failed_at",
            "completed_at",
            "claimed_at",
            "started_at",
            "next_retry_at",
            "cancel_requested_at",
            "cancel_requested_by",
        ):
            assert row[column] is None, column
        assert old["enqueued_at"] < row["enqueued_at"] == row["run_at"] <= now
        assert row["sent_at"] == old["sent_at"]
    assert task_row(db, expired.id)["good_until"] is None  # it had passed: cleared
    assert task_row(db, kept_deadline.id)["good_until"] == later  # still ahead: kept

    worker(workers)
    assert [h.get(timeout=WAIT).ok for h in (was_cancelled, kept_deadline, expired)] == [1, 2, 3]
    for handle in (was_cancelled, kept_deadline, expired):
        assert [a["attempt"] for a in attempt_rows(db, handle.id)] == [1]


def test_tasks_that_have_not_ended_or_completed_are_refused(
    db: Conn, rt: ModuleType, workers: WorkerFactory
) -> None:
    pending = rt.gated.with_options(queue="other").send(token())  # no worker serves `other`
    running_token = token()
    running = rt.sleep.send(60, running_token)
    completed = rt.number.send(5)
    worker(workers, queues="default")
    assert completed.get(timeout=WAIT).ok == 5
    # RUNNING is written before the body runs: wait for the body's own ledger row too (through
    # PgBouncer, CI saw the row come after the status), so the last check counts runs only.
    wait_until(
        lambda: task_row(db, running.id)["status"] == "RUNNING" and runs(db, running_token) == 1,
        timeout=WAIT,
        message="RUNNING, its body begun",
    )
    before = snapshot(db)

    answers = {name: h.retry() for name, h in (("p", pending), ("r", running), ("c", completed))}

    assert {n: (a.retried, a.status) for n, a in answers.items()} == {
        "p": (False, TaskStatus.PENDING),
        "r": (False, TaskStatus.RUNNING),
        "c": (False, TaskStatus.COMPLETED),
    }
    assert answers["r"].reason == (
        "not retried: it is RUNNING (only FAILED, CANCELLED and EXPIRED tasks can be retried)"
    )
    assert answers["p"].reason.startswith("not retried: it is PENDING")
    assert answers["c"].reason.startswith("not retried: it is COMPLETED")
    assert snapshot(db) == before
    assert runs(db, running_token) == 1


def test_an_unknown_id_raises_task_not_found(db: Conn, rt: ModuleType) -> None:
    missing = uuid.uuid4()
    with pytest.raises(TaskNotFoundError, match=str(missing)):
        rt.app.handle(missing).retry()
    with pytest.raises(TaskNotFoundError):
        retry_task(rt.app.broker, str(missing))
    with pytest.raises(ValueError, match="is not a UUID"):
        retry_task(rt.app.broker, "not-a-uuid")


def test_retry_async(db: Conn, rt: ModuleType) -> None:
    handle = cancelled(rt.gated, token())
    answer = asyncio.run(handle.retry_async(by="async-test"))
    assert answer.retried and handle.status() is TaskStatus.PENDING
    again = asyncio.run(handle.retry_async())
    assert not again.retried and again.reason.startswith("not retried: it is PENDING")


def test_a_periodic_task_keeps_its_slot(db: Conn, rt: ModuleType) -> None:
    """Nothing is unique per slot but the task row itself: a retry reuses that row."""
    handle = cancelled(rt.gated, token())
    slot = datetime(2026, 1, 1, tzinfo=UTC)
    db.execute(
        "UPDATE tether_tasks SET schedule_name = 'every-minute', schedule_slot = %s WHERE id = %s",
        (slot, handle.id),
    )
    assert handle.retry().retried
    row = task_row(db, handle.id)
    assert (row["status"], row["schedule_name"], row["schedule_slot"]) == ("PENDING", "every-minute", slot)


# -- in bulk ---------------------------------------------------------------------------------------


def test_bulk_retry_of_1000_failed_tasks(db: Conn, rt: ModuleType, workers: WorkerFactory) -> None:
    gate = token()
    handles = rt.gated.send_many([(gate, f"{gate}:{i}", i) for i in range(1000)])
    ids = [h.id for h in handles]
    other_failure = rt.fail.send("OTHER")  # another name: the filter leaves it alone
    first = worker(workers, processes=4)
    assert all(h.get(timeout=WAIT).err.code == "GATE_CLOSED" for h in handles)
    assert other_failure.get(timeout=WAIT).err.code == "OTHER"
    assert first.stop() == 0, first.log()
    assert statuses_of(db, ids) == {"FAILED": 1000}
    before = {r["id"]: dict(r) for r in db.execute("SELECT * FROM tether_tasks WHERE id = ANY(%s)", (ids,))}
    open_gate(db, gate)

    started = time.perf_counter()
    done = rt.app.retry_tasks(RetryFilter(name="retry.gated", error_code="GATE_CLOSED"), by="bulk-test")
    took = time.perf_counter() - started

    print(f"bulk retry of 1,000 failed tasks took {took * 1000:.0f} ms")
    assert isinstance(done, BulkRetry)
    assert (done.matched, done.retried, done.skipped, done.dry_run) == (1000, 1000, 0, False)
    assert [s.id for s in done.sample] == sorted(ids)[:10]
    assert all(s.status is TaskStatus.FAILED and s.error_code == "GATE_CLOSED" for s in done.sample)
    assert done.skips == []
    assert statuses_of(db, ids) == {"PENDING": 1000}
    rows = db.execute("SELECT * FROM tether_tasks WHERE id = ANY(%s)", (ids,)).fetchall()
    for row in rows:
        old = before[row["id"]]
        assert (row["attempt"], row["retry_count"], row["result"], row["failed_at"]) == (1, 0, None, None)
        assert row["run_at"] == row["enqueued_at"] > old["enqueued_at"]
    assert task_row(db, other_failure.id)["status"] == "FAILED"
    count = db.execute(
        "SELECT count(*) AS n FROM tether_task_attempts WHERE task_id = ANY(%s)", (ids,)
    ).fetchone()
    assert count["n"] == 1000  # the failed attempts, kept

    worker(workers, processes=4)
    assert [h.get(timeout=WAIT).ok for h in handles] == list(range(1000))
    assert statuses_of(db, ids) == {"COMPLETED": 1000}
    history = db.execute(
        "SELECT attempt, outcome, count(*) AS n FROM tether_task_attempts WHERE task_id = ANY(%s)"
        " GROUP BY attempt, outcome ORDER BY attempt",
        (ids,),
    ).fetchall()
    assert [(r["attempt"], r["outcome"], r["n"]) for r in history] == [
        (1, "FAILED", 1000),
        (2, "COMPLETED", 1000),
    ]


def test_a_dry_run_changes_nothing(db: Conn, rt: ModuleType) -> None:
    handles = [cancelled(rt.gated, token()) for _ in range(12)]
    rt.gated.with_options(queue="other").send(token())  # PENDING: never matched
    before = snapshot(db)

    dry = rt.app.retry_tasks(RetryFilter(statuses=("CANCELLED",)), dry_run=True)
    small = retry_tasks(rt.app.broker, RetryFilter(statuses=("CANCELLED",)), dry_run=True, sample_size=3)
    none = rt.app.retry_tasks(RetryFilter(), dry_run=True)  # FAILED: none

    assert (dry.matched, dry.retried, dry.skipped, dry.dry_run) == (12, 0, 0, True)
    assert [s.id for s in dry.sample] == sorted(h.id for h in handles)[:10]
    assert all(s.status is TaskStatus.CANCELLED and s.name == "retry.gated" for s in dry.sample)
    assert all(s.error_code == "TASK_CANCELLED" and s.queue == "default" for s in dry.sample)
    assert [s.id for s in small.sample] == sorted(h.id for h in handles)[:3] and small.matched == 12
    assert (none.matched, none.sample) == (0, [])
    assert snapshot(db) == before


def test_filters_select_exactly_the_right_rows(db: Conn, rt: ModuleType, workers: WorkerFactory) -> None:
    made = {
        "a_default": rt.fail.send("A"),
        "b_default": rt.fail.send("B"),
        "a_other": rt.fail.with_options(queue="other").send("A"),
        "gated": rt.gated.send(token()),
        "old_a": rt.fail.send("A"),
        "ok": rt.number.send(1),
    }
    w = worker(workers)
    for handle in made.values():
        handle.get(timeout=WAIT)
    assert w.stop() == 0, w.log()
    made["cancelled"] = cancelled(rt.fail.with_options(queue="other"), "C")
    made["expired"] = rt.fail.send("E", good_until=datetime.now(UTC) - timedelta(seconds=1))
    assert expire_now(db) == 1
    # One failure three hours old (the test says when it ended).
    db.execute(
        "UPDATE tether_tasks SET failed_at = failed_at - interval '3 hours',"
        " updated_at = updated_at - interval '3 hours' WHERE id = %s",
        (made["old_a"].id,),
    )
    ids = {name: h.id for name, h in made.items()}

    def matched(**given: Any) -> set[str]:
        done = rt.app.retry_tasks(RetryFilter(**given), dry_run=True)
        names = {name for name, i in ids.items() if i in {s.id for s in done.sample}}
        assert done.matched == len(done.sample) == len(names)
        return names

    failed = {"a_default", "b_default", "a_other", "gated", "old_a"}
    assert matched() == failed
    assert matched(queue="other") == {"a_other"}
    assert matched(queue="other", statuses=("FAILED", "CANCELLED")) == {"a_other", "cancelled"}
    assert matched(statuses=("EXPIRED",)) == {"expired"}
    assert matched(statuses=("failed", "CANCELLED", "EXPIRED")) == failed | {"cancelled", "expired"}
    assert matched(name="retry.gated") == {"gated"}
    assert matched(error_code="A") == {"a_default", "a_other", "old_a"}
    assert matched(error_code="A", since=timedelta(hours=1)) == {"a_default", "a_other"}
    assert matched(error_code="A", until=timedelta(hours=1)) == {"old_a"}
    an_hour_ago = datetime.now(UTC) - timedelta(hours=1)
    assert matched(error_code="A", since=an_hour_ago - timedelta(hours=3), until=an_hour_ago) == {"old_a"}
    assert matched(error_code="NOPE") == set()
    before = snapshot(db)

    done = rt.app.retry_tasks(RetryFilter(error_code="A", queue="default"), by="filters-test")

    assert (done.matched, done.retried, done.skipped) == (2, 2, 0)
    after = snapshot(db)
    changed = {
        name
        for name, i in ids.items()
        if next(r for r in before["tasks"] if r["id"] == i) != next(r for r in after["tasks"] if r["id"] == i)
    }
    assert changed == {"a_default", "old_a"}
    assert {task_row(db, ids[n])["status"] for n in changed} == {"PENDING"}
    assert (before["attempts"], before["keys"]) == (after["attempts"], after["keys"])


def test_bad_filters_are_refused_before_anything_is_read(db: Conn, rt: ModuleType) -> None:
    bad: list[tuple[Any, str]] = [
        (RetryFilter(statuses=()), "filter.statuses is empty"),
        (RetryFilter(statuses=("COMPLETED",)), "'COMPLETED' cannot be retried"),
        (RetryFilter(statuses=("RUNNING", "FAILED")), "'RUNNING' cannot be retried"),
        (RetryFilter(queue=""), "filter.queue"),
        (RetryFilter(name=3), "filter.name"),  # type: ignore[arg-type]
        (RetryFilter(error_code="a\x00b"), "filter.error_code"),
        (RetryFilter(since=datetime(2026, 1, 1)), "filter.since must be timezone-aware"),
        (RetryFilter(until=timedelta(0)), "filter.until must be a positive timedelta"),
        (RetryFilter(since="1h"), "filter.since must be an aware datetime or a timedelta"),  # type: ignore[arg-type]
        (
            RetryFilter(since=datetime(2026, 2, 1, tzinfo=UTC), until=datetime(2026, 1, 1, tzinfo=UTC)),
            "filter.since .* must be before filter.until",
        ),
        (RetryFilter(since=timedelta(hours=1), until=timedelta(hours=2)), "must be before filter.until"),
        (RetryFilter(since=datetime.now(UTC) + timedelta(days=1)), "must be before filter.until"),
        ("FAILED", "filter must be a RetryFilter"),
    ]
    for given, message in bad:
        with pytest.raises(InvalidOptionError, match=message):
            rt.app.retry_tasks(given)
    with pytest.raises(InvalidOptionError, match="sample_size"):
        retry_tasks(rt.app.broker, RetryFilter(), sample_size=-1)
    with pytest.raises(InvalidOptionError, match="by must be"):
        rt.app.retry_tasks(RetryFilter(), by="")
    with pytest.raises(InvalidOptionError, match="by must be"):
        rt.app.handle(uuid.uuid4()).retry(by="x" * 201)


# -- unique keys -----------------------------------------------------------------------------------


def test_a_retried_task_takes_its_unique_key_back(db: Conn, rt: ModuleType, workers: WorkerFactory) -> None:
    keyed = rt.gated.with_options(unique_key="invoice-1")
    gate = token()
    first = keyed.send(gate)
    w = worker(workers)
    assert first.get(timeout=WAIT).err.code == "GATE_CLOSED"
    assert w.stop() == 0, w.log()
    released = key_row(db, "retry.gated", "invoice-1")
    assert released is not None and (released["task_id"], released["active"]) == (first.id, False)

    assert first.retry().retried

    taken = key_row(db, "retry.gated", "invoice-1")
    assert taken is not None and (taken["task_id"], taken["active"]) == (first.id, True)
    assert taken["sent_at"] > released["sent_at"]  # a retry counts as a send of the key
    # While it waits to run again, a send with the key returns it.
    again = keyed.send(gate)
    assert again.deduplicated and again.id == first.id
    open_gate(db, gate)
    worker(workers)
    assert first.get(timeout=WAIT).ok == 1
    assert key_row(db, "retry.gated", "invoice-1")["active"] is False


def test_a_key_held_by_a_newer_live_task_refuses_the_retry(db: Conn, rt: ModuleType) -> None:
    keyed = rt.gated.with_options(unique_key="order-9", queue="other")
    old = cancelled(keyed, token())
    newer = keyed.send(token())  # the key was free: a new task holds it
    assert not newer.deduplicated
    before = snapshot(db)

    answer = old.retry()

    assert (answer.retried, answer.status) == (False, TaskStatus.CANCELLED)
    assert answer.reason == (
        f"not retried: its unique key 'order-9' is held by task {newer.id}, which has not ended "
        "(a task may not run twice at once under one key)"
    )
    assert snapshot(db)["tasks"] == before["tasks"]
    assert key_row(db, "retry.gated", "order-9")["task_id"] == newer.id
    bulk = rt.app.retry_tasks(RetryFilter(statuses=("CANCELLED",)))
    assert (bulk.matched, bulk.retried, bulk.skipped) == (1, 0, 1)
    assert bulk.skips == [answer]

    # Once the newer one has ended too, the older one takes the key back, and the newer
    # one is refused in its turn.
    assert newer.cancel()
    assert old.retry().retried
    held = key_row(db, "retry.gated", "order-9")
    assert held is not None and (held["task_id"], held["active"]) == (old.id, True)
    refused = newer.retry()
    assert not refused.retried and f"held by task {old.id}" in refused.reason


def test_bulk_retry_of_tasks_sharing_a_key_retries_the_first(db: Conn, rt: ModuleType) -> None:
    keyed = rt.gated.with_options(unique_key="shared", queue="other")
    first = cancelled(keyed, token())
    second = cancelled(keyed, token())
    plain = cancelled(rt.gated.with_options(queue="other"), token())

    done = rt.app.retry_tasks(RetryFilter(statuses=("CANCELLED",)))

    assert (done.matched, done.retried, done.skipped) == (3, 2, 1)
    assert [(s.task_id, s.retried) for s in done.skips] == [(second.id, False)]
    assert f"held by task {first.id}" in done.skips[0].reason
    assert (first.status(), second.status(), plain.status()) == (
        TaskStatus.PENDING,
        TaskStatus.CANCELLED,
        TaskStatus.PENDING,
    )
    held = key_row(db, "retry.gated", "shared")
    assert held is not None and (held["task_id"], held["active"]) == (first.id, True)


def test_a_key_whose_row_was_pruned_is_taken_again(db: Conn, rt: ModuleType) -> None:
    handle = cancelled(rt.gated.with_options(unique_key="gone", queue="other"), token())
    db.execute("DELETE FROM tether_unique_keys WHERE unique_key = 'gone'")
    assert handle.retry().retried
    held = key_row(db, "retry.gated", "gone")
    assert held is not None and (held["task_id"], held["active"]) == (handle.id, True)


# -- workflow steps --------------------------------------------------------------------------------


def _failing_chain(rt: ModuleType, gate: str) -> Any:
    """top -> middle (gated) -> bottom, and a side step that depends on nothing."""
    top = rt.number.node(args=(10,), name="top")
    middle = rt.gated.node(kwargs={"gate": gate}, args_from={"value": top}, name="middle")
    bottom = rt.add.node(kwargs={"b": 5}, args_from={"a": middle}, name="bottom")
    side = rt.number.node(args=(1,), name="side")
    return rt.app.workflow("retry-chain", [top, middle, bottom, side], output=bottom).start()


def test_a_retried_step_reopens_its_failed_workflow_which_then_completes(
    db: Conn, rt: ModuleType, workers: WorkerFactory
) -> None:
    gate = token()
    flow = _failing_chain(rt, gate)
    w = worker(workers)
    ended = flow.get(timeout=WAIT)
    assert ended.err is not None and ended.err.code == "WORKFLOW_FAILED"
    assert w.stop() == 0, w.log()
    rows = steps(db, flow.id)
    assert {n: r["status"] for n, r in rows.items()} == {
        "top": "COMPLETED",
        "middle": "FAILED",
        "bottom": "SKIPPED",
        "side": "COMPLETED",
    }
    wf = wf_row(db, flow.id)
    assert (wf["status"], wf["steps_done"], wf["steps_failed"]) == ("FAILED", 4, 1)
    open_gate(db, gate)

    answer = flow.task("middle").retry(by="wf-test")

    assert answer.retried and answer.status is TaskStatus.PENDING
    assert (answer.workflow_id, answer.workflow_status) == (flow.id, "RUNNING")
    assert answer.reason == (
        f"retried: PENDING as a new attempt; step 'middle' is ENQUEUED again and its workflow "
        f"{flow.id} is RUNNING; skipped step(s) waiting again: bottom"
    )
    rows = steps(db, flow.id)
    assert {n: (r["status"], r["task_status"]) for n, r in rows.items()} == {
        "top": ("COMPLETED", "COMPLETED"),
        "middle": ("ENQUEUED", "PENDING"),
        "bottom": ("WAITING", None),
        "side": ("COMPLETED", "COMPLETED"),
    }
    assert rows["middle"]["result"] is None and rows["middle"]["finished_at"] is None
    assert (rows["bottom"]["waiting_on"], rows["bottom"]["deps_ok"], rows["bottom"]["deps_failed"]) == (
        1,
        0,
        0,
    )
    assert rows["bottom"]["result"] is None and rows["bottom"]["error_code"] is None
    wf = wf_row(db, flow.id)
    assert (wf["status"], wf["steps_done"], wf["steps_failed"], wf["finished_at"]) == ("RUNNING", 2, 0, None)
    assert flow.status() is WorkflowStatus.RUNNING

    worker(workers)
    result = flow.get(timeout=WAIT)
    assert result.ok == 15, result
    wf = wf_row(db, flow.id)
    assert (wf["status"], wf["steps_done"], wf["steps_failed"]) == ("COMPLETED", 4, 0)
    middle = steps(db, flow.id)["middle"]
    assert [a["attempt"] for a in attempt_rows(db, middle["task_id"])] == [1, 2]


def test_a_retried_step_of_a_paused_workflow_waits_for_resume(
    db: Conn, rt: ModuleType, workers: WorkerFactory
) -> None:
    """on_error='pause': top -> middle (gated) -> bottom; x (on `other`) -> y keeps the
    workflow open while it is paused."""
    gate = token()
    top = rt.number.node(args=(10,), name="top")
    middle = rt.gated.node(kwargs={"gate": gate}, args_from={"value": top}, name="middle")
    bottom = rt.add.node(kwargs={"b": 5}, args_from={"a": middle}, name="bottom")
    x = rt.number.with_options(queue="other").node(args=(1,), name="x")
    y = rt.add.node(args_from={"a": x}, name="y")
    flow = rt.app.workflow("paused", [top, middle, bottom, x, y], on_error="pause", output=bottom).start()
    worker(workers, queues="default")
    wait_until(lambda: flow.status() is WorkflowStatus.PAUSED, timeout=WAIT, message="PAUSED")
    assert steps(db, flow.id)["bottom"]["status"] == "SKIPPED"
    open_gate(db, gate)

    answer = flow.task("middle").retry()

    assert answer.retried and answer.workflow_status == "PAUSED"
    # The step's task runs (a pause holds steps that become ready, not tasks), and its
    # dependent becomes READY and waits for resume().
    wait_until(lambda: steps(db, flow.id)["bottom"]["status"] == "READY", timeout=WAIT, message="READY")
    assert steps(db, flow.id)["middle"]["status"] == "COMPLETED"
    assert flow.status() is WorkflowStatus.PAUSED
    worker(workers, queues="other")
    wait_until(lambda: steps(db, flow.id)["y"]["status"] == "READY", timeout=WAIT, message="y READY")
    assert flow.resume()
    assert flow.get(timeout=WAIT).ok == 15
    wf = wf_row(db, flow.id)
    assert (wf["status"], wf["steps_done"], wf["steps_failed"]) == ("COMPLETED", 5, 0)


def test_skips_cascade_back_and_other_failures_keep_theirs(db: Conn, rt: ModuleType) -> None:
    """a (cancelled) -> b -> c; d waits for a and e (both cancelled): only a is retried, so b
    and c wait again, d stays SKIPPED (e has not completed either)."""
    a = rt.gated.with_options(queue="other").node(kwargs={"gate": "g"}, name="a")
    e = rt.gated.with_options(queue="other").node(kwargs={"gate": "g"}, name="e")
    b = rt.add.node(args_from={"a": a}, name="b")
    c = rt.add.node(args_from={"a": b}, name="c")
    d = rt.add.node(args_from={"a": a, "b": e}, name="d")
    flow = rt.app.workflow("cascade", [a, b, c, d, e]).start()
    assert flow.task("a").cancel() and flow.task("e").cancel()
    assert flow.status() is WorkflowStatus.FAILED
    assert {n: r["status"] for n, r in steps(db, flow.id).items()} == {
        "a": "CANCELLED",
        "b": "SKIPPED",
        "c": "SKIPPED",
        "d": "SKIPPED",
        "e": "CANCELLED",
    }

    answer = flow.task("a").retry()

    assert answer.retried and answer.workflow_status == "RUNNING"
    assert answer.reason.endswith("skipped step(s) waiting again: b, c")
    rows = steps(db, flow.id)
    assert {n: r["status"] for n, r in rows.items()} == {
        "a": "ENQUEUED",
        "b": "WAITING",
        "c": "WAITING",
        "d": "SKIPPED",
        "e": "CANCELLED",
    }
    assert [(rows[n]["waiting_on"], rows[n]["deps_failed"]) for n in ("b", "c")] == [(1, 0), (1, 0)]
    wf = wf_row(db, flow.id)
    assert (wf["status"], wf["steps_done"], wf["steps_failed"]) == ("RUNNING", 2, 1)

    # Retrying e too: d waits again for both.
    assert flow.task("e").retry().reason.endswith("skipped step(s) waiting again: d")
    rows = steps(db, flow.id)
    assert (rows["d"]["status"], rows["d"]["waiting_on"], rows["d"]["deps_failed"]) == ("WAITING", 2, 0)
    wf = wf_row(db, flow.id)
    assert (wf["status"], wf["steps_done"], wf["steps_failed"]) == ("RUNNING", 0, 0)


def test_refused_when_a_dependent_already_ran_with_the_outcome(
    db: Conn, rt: ModuleType, workers: WorkerFactory
) -> None:
    gate, tok = token(), token()
    risky = rt.gated.node(kwargs={"gate": gate}, name="risky")
    cleanup = rt.report.node(
        kwargs={"token": tok}, args_from={"upstream": risky}, run_anyway=True, name="cleanup"
    )
    flow = rt.app.workflow("cleanup", [risky, cleanup]).start()
    worker(workers)
    assert flow.get(timeout=WAIT).err.code == "WORKFLOW_FAILED"
    before = snapshot(db)

    answer = flow.task("risky").retry()

    assert (answer.retried, answer.status, answer.workflow_status) == (False, TaskStatus.FAILED, "FAILED")
    assert answer.reason == (
        "not retried: step 'cleanup' of its workflow started after step 'risky' ended, with its "
        "outcome; that run cannot be taken back (start a new workflow instead)"
    )
    assert snapshot(db) == before
    assert runs(db, tok) == 1


def test_a_join_any_dependent_that_started_first_stays_as_it_is(
    db: Conn, rt: ModuleType, workers: WorkerFactory
) -> None:
    gate = token()
    fast = rt.number.node(args=(4,), name="fast")
    slow = rt.gated.with_options(queue="other").node(kwargs={"gate": gate}, name="slow")
    first = rt.add.node(args_from={"a": fast, "b": slow}, join="any", name="first")
    flow = rt.app.workflow("first-answer", [fast, slow, first], output="first").start()
    worker(workers, queues="default")
    wait_until(lambda: steps(db, flow.id)["first"]["status"] == "COMPLETED", timeout=WAIT, message="first")
    worker(workers, queues="other")  # now slow runs, and fails
    assert flow.get(timeout=WAIT).err.code == "WORKFLOW_FAILED"
    ran = steps(db, flow.id)["first"]
    open_gate(db, gate)

    answer = flow.task("slow").retry()

    assert answer.retried and answer.workflow_status == "RUNNING"
    assert flow.get(timeout=WAIT).ok == 4  # first's value, from its only run
    after = steps(db, flow.id)
    assert after["first"]["finished_at"] == ran["finished_at"] and after["first"]["attempts"] == 1
    assert after["slow"]["status"] == "COMPLETED"
    assert wf_row(db, flow.id)["status"] == "COMPLETED"


def test_refused_in_a_cancelled_workflow(db: Conn, rt: ModuleType) -> None:
    step = rt.gated.with_options(queue="other").node(kwargs={"gate": "g"}, name="only")
    flow = rt.app.workflow("cancelled", [step]).start()
    assert flow.cancel()
    task = flow.task("only")
    assert task.status() is TaskStatus.CANCELLED
    before = snapshot(db)

    answer = task.retry()

    assert (answer.retried, answer.status, answer.workflow_status) == (
        False,
        TaskStatus.CANCELLED,
        "CANCELLED",
    )
    assert answer.reason.startswith(f"not retried: its workflow {flow.id} (cancelled) was cancelled")
    assert snapshot(db) == before
    bulk = rt.app.retry_tasks(RetryFilter(statuses=("CANCELLED",)))
    assert (bulk.matched, bulk.retried, bulk.skipped) == (1, 0, 1) and bulk.skips == [answer]


def test_refused_when_the_workflow_is_gone(db: Conn, rt: ModuleType) -> None:
    step = rt.gated.with_options(queue="other").node(kwargs={"gate": "g"}, name="only")
    flow = rt.app.workflow("gone", [step]).start()
    task = flow.task("only")
    assert task.cancel()
    db.execute("DELETE FROM tether_workflows WHERE id = %s", (flow.id,))  # as pruning would

    answer = task.retry()

    assert not answer.retried and answer.status is TaskStatus.CANCELLED
    assert answer.reason == f"not retried: its workflow {flow.id} no longer exists (pruned by retention?)"


def test_a_step_whose_outcome_the_workflow_has_not_taken_is_retried_alone(
    db: Conn, rt: ModuleType, workers: WorkerFactory
) -> None:
    """The task ended by someone who does not advance workflows (here: by hand), so the
    step is still ENQUEUED: only the task goes back to PENDING."""
    gate = token()
    only = rt.gated.with_options(queue="other").node(kwargs={"gate": gate, "value": 3}, name="only")
    flow = rt.app.workflow("unsettled", [only]).start()
    task = flow.task("only")
    db.execute(
        "UPDATE tether_tasks SET status = 'FAILED', failed_at = now(), error_code = 'BY_HAND',"
        " updated_at = now() WHERE id = %s",
        (task.id,),
    )
    open_gate(db, gate)

    answer = task.retry()

    assert answer.retried and answer.workflow_status == "RUNNING"
    assert answer.reason.endswith(f"(its workflow {flow.id} had not taken the outcome yet)")
    assert steps(db, flow.id)["only"]["status"] == "ENQUEUED"
    worker(workers, queues="other")
    assert flow.get(timeout=WAIT).ok == 3


def test_bulk_retry_takes_workflow_steps_through_their_workflow(db: Conn, rt: ModuleType) -> None:
    flows = []
    for i in range(3):
        step = rt.gated.with_options(queue="other").node(kwargs={"gate": "g"}, name="s")
        after = rt.add.node(args_from={"a": step}, name="after")
        flows.append(rt.app.workflow(f"bulk-{i}", [step, after]).start())
    for flow in flows:
        assert flow.task("s").cancel()
    plain = cancelled(rt.gated.with_options(queue="other"), token())

    done = rt.app.retry_tasks(RetryFilter(statuses=("CANCELLED",)))

    assert (done.matched, done.retried, done.skipped) == (4, 4, 0)
    assert plain.status() is TaskStatus.PENDING
    for flow in flows:
        assert flow.status() is WorkflowStatus.RUNNING
        assert {n: r["status"] for n, r in steps(db, flow.id).items()} == {
            "s": "ENQUEUED",
            "after": "WAITING",
        }


# -- the command -----------------------------------------------------------------------------------


@pytest.fixture
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables wide enough that no cell is cut (the command prints through tether.cli.common.console)."""
    monkeypatch.setattr(tether.cli.common, "console", Console(width=200))


def invoke(database_url: str, *args: str) -> Result:
    return CliRunner().invoke(tether.cli.cli, ["retry", *args, "--database-url", database_url])


def test_cli_retry_by_id(database_url: str, db: Conn, rt: ModuleType) -> None:
    handle = cancelled(rt.gated.with_options(queue="other"), token())
    pending = rt.gated.with_options(queue="other").send(token())

    ok = invoke(database_url, str(handle.id))
    assert ok.exit_code == 0, ok.output
    assert ok.stdout == f"task {handle.id}: retried: PENDING as a new attempt\n1 of 1 task(s) retried\n"
    assert handle.status() is TaskStatus.PENDING

    missing = uuid.uuid4()
    refused = invoke(database_url, str(pending.id), str(missing), "--json")
    assert refused.exit_code == 1, refused.output
    answer = json.loads(refused.stdout)
    assert (answer["retried"], answer["not_retried"]) == (0, 2)
    assert answer["tasks"][0] == {
        "task_id": str(pending.id),
        "retried": False,
        "status": "PENDING",
        "reason": "not retried: it is PENDING (only FAILED, CANCELLED and EXPIRED tasks can be retried)",
        "workflow_id": None,
        "workflow_status": None,
    }
    assert answer["tasks"][1]["status"] is None and str(missing) in answer["tasks"][1]["reason"]

    text = invoke(database_url, str(pending.id))
    assert text.exit_code == 1 and "not retried: it is PENDING" in text.stdout
    assert "0 of 1 task(s) retried" in text.stdout

    bad = tether_command(database_url, "retry", "nope")
    assert bad.returncode == 1 and "error: task id 'nope' is not a UUID" in bad.stderr


def test_cli_bulk_retry(database_url: str, db: Conn, rt: ModuleType, wide_console: None) -> None:
    handles = [cancelled(rt.gated.with_options(queue="other"), token()) for _ in range(3)]
    cancelled(rt.fail, "X")  # another name and queue
    before = snapshot(db)

    dry = invoke(database_url, "--status", "cancelled", "--queue", "other", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.startswith("dry run: 3 task(s) match; nothing was changed\n")
    assert all(str(h.id) in dry.stdout for h in handles)
    dry_json = invoke(database_url, "--status", "CANCELLED", "--name", "retry.gated", "--dry-run", "--json")
    assert dry_json.exit_code == 0, dry_json.output
    shown = json.loads(dry_json.stdout)
    assert (shown["matched"], shown["retried"], shown["skipped"], shown["dry_run"]) == (3, 0, 0, True)
    assert [s["id"] for s in shown["sample"]] == sorted(str(h.id) for h in handles)
    assert shown["sample"][0]["status"] == "CANCELLED" and shown["sample"][0]["queue"] == "other"
    assert snapshot(db) == before

    # Off a terminal, a bulk retry needs --yes.
    unasked = invoke(database_url, "--status", "CANCELLED", "--queue", "other")
    assert unasked.exit_code == 2 and "needs --yes" in unasked.output
    assert snapshot(db) == before

    done = invoke(
        database_url, "--status", "CANCELLED", "--queue", "other", "--since", "1h", "--yes", "--json"
    )
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    assert (result["matched"], result["retried"], result["skipped"], result["dry_run"]) == (3, 3, 0, False)
    assert all(h.status() is TaskStatus.PENDING for h in handles)
    text = invoke(database_url, "--status", "CANCELLED", "-y")
    assert text.exit_code == 0 and text.stdout == "1 task(s) matched, 1 retried, 0 skipped\n"


def on_a_terminal(database_url: str, answer: bytes, *args: str) -> tuple[int, str]:
    """The real command with a pseudo-terminal as its stdin and output; ``answer`` is typed
    at its [y/N] prompt. Returns its exit status and everything it printed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether", "--log-level", "warning", *args, "--database-url", database_url],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=REPO,
    )
    os.close(slave)
    out, typed, deadline = b"", False, time.monotonic() + 60
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                proc.kill()
                raise AssertionError(f"no prompt within 60 s; printed so far: {out!r}")
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the command has exited and closed the terminal
                break
            if not data:
                break
            out += data
            if not typed and b"[y/N]" in out:
                os.write(master, answer)
                typed = True
        return proc.wait(30), out.decode(errors="replace")
    finally:
        os.close(master)


def test_cli_bulk_retry_asks_on_a_terminal(database_url: str, db: Conn, rt: ModuleType) -> None:
    handles = [cancelled(rt.gated.with_options(queue="other"), token()) for _ in range(2)]

    code, printed = on_a_terminal(database_url, b"n\n", "retry", "--status", "CANCELLED")

    assert code == 1, printed
    assert "dry run: 2 task(s) match" in printed and "Retry these 2 task(s)? [y/N]" in printed
    assert "Aborted!" in printed
    assert all(h.status() is TaskStatus.CANCELLED for h in handles)

    code, printed = on_a_terminal(database_url, b"y\n", "retry", "--status", "CANCELLED")

    assert code == 0, printed
    assert "2 task(s) matched, 2 retried, 0 skipped" in printed
    assert all(h.status() is TaskStatus.PENDING for h in handles)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give task ids, or filters"),
        (("--dry-run",), "give task ids, or filters"),
        ((str(uuid.uuid4()), "--status", "FAILED"), "not both"),
        ((str(uuid.uuid4()), "--dry-run"), "--dry-run and --yes are for a bulk retry"),
        (("--status", "COMPLETED"), "'COMPLETED' cannot be retried"),
        (("--status", "FAILED,RUNNING"), "'RUNNING' cannot be retried"),
        (("--since", "yesterday"), "neither a duration"),
        (("--since", "2026-01-01T00:00:00"), "has no UTC offset"),
        (("--since", "0h"), "no time ago"),
        (("--since", "1h", "--until", "2h", "--dry-run"), "must be before filter.until"),
        (("--queue", "", "--dry-run"), "Invalid value for '--queue': queue must be a queue name"),
    ],
)
def test_cli_usage_errors(database_url: str, db: Conn, args: tuple[str, ...], message: str) -> None:
    result = invoke(database_url, *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
