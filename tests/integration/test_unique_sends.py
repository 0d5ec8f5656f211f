"""Unique sends (docs/tasks.md#unique-sends) on a real database, with real workers and producers.

A unique send creates a task only when no task of the same name holds its key: one that is
PENDING, CLAIMED or RUNNING, or (with unique_for) one sent within the window whatever its
status. Every test checks rows: tasks with the key, the key row, and what handles say.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import uuid
from datetime import UTC, datetime, timedelta
from multiprocessing.synchronize import Barrier
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import runs, task_row
from tests.conftest import WorkerFactory, wait_until
from tether import AppConfig, PostgresConfig, TaskResult, Tether
from tether.errors import InvalidOptionError

APP = "tests.apps.basic:app"
FAST_REAPER = {"TETHER_CHECK_INTERVAL_MS": "1000"}
Conn = psycopg.Connection[Any]


def keyed(db: Conn, name: str, key: str) -> list[dict[str, Any]]:
    """Every task of ``name`` sent with ``key``, oldest first."""
    rows = db.execute(
        "SELECT * FROM tether_tasks WHERE name = %s AND unique_key = %s ORDER BY id", (name, key)
    ).fetchall()
    return [dict(r) for r in rows]


def key_row(db: Conn, name: str, key: str) -> dict[str, Any] | None:
    row = db.execute(
        "SELECT * FROM tether_unique_keys WHERE task_name = %s AND unique_key = %s", (name, key)
    ).fetchone()
    return None if row is None else dict(row)


def task_count(db: Conn) -> int:
    row = db.execute("SELECT count(*) AS n FROM tether_tasks").fetchone()
    assert row is not None
    return int(row["n"])


def wait_status(db: Conn, task_id: Any, wanted: set[str], timeout: float = 30) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        row = task_row(db, task_id)
        return row if row["status"] in wanted else None

    found: dict[str, Any] = wait_until(reached, timeout=timeout, message=f"task {task_id} in {wanted}")
    return found


def token() -> str:
    return uuid.uuid4().hex


# -- the basics: which states hold a key ----------------------------------------------------


def test_a_second_send_returns_the_first_task_while_it_is_pending(db: Conn, basic: ModuleType) -> None:
    record = basic.app.tasks["record"]
    first = record.with_options(unique_key="invoice-42", queue="low").send("a")
    second = record.with_options(unique_key="invoice-42", queue="low").send("b")
    assert first.deduplicated is False and second.deduplicated is True
    assert second.id == first.id and second == first
    (row,) = keyed(db, "record", "invoice-42")
    assert row["id"] == first.id and row["status"] == "PENDING" and row["args"] == ["a"]
    assert first.info().unique_key == "invoice-42"
    key = key_row(db, "record", "invoice-42")
    assert key is not None and key["task_id"] == first.id and key["active"] is True
    # The key is per task name: another task may use the same key.
    other = basic.app.tasks["sleep"].with_options(unique_key="invoice-42", queue="low").send(0)
    assert other.deduplicated is False and other.id != first.id
    # A plain send is never deduplicated; a handle built by id does not know.
    assert record.with_options(queue="low").send("c").deduplicated is False
    assert basic.app.handle(first.id).deduplicated is None
    assert task_count(db) == 3


def test_the_key_is_free_again_once_its_task_ends(
    db: Conn, basic: ModuleType, workers: WorkerFactory
) -> None:
    record = basic.app.tasks["record"].with_options(unique_key="k-end")
    first = record.send(tok := token())
    workers.start(APP, "--queues", "default")
    assert first.get(timeout=30).ok == tok
    key = key_row(db, "record", "k-end")
    assert key is not None and key["task_id"] == first.id and key["active"] is False
    again = record.send(tok2 := token())
    assert again.deduplicated is False and again.id != first.id
    assert again.get(timeout=30).ok == tok2
    assert [r["id"] for r in keyed(db, "record", "k-end")] == [first.id, again.id]
    assert runs(db, tok) == 1 and runs(db, tok2) == 1


def test_cancelled_and_failed_tasks_free_their_key(
    db: Conn, basic: ModuleType, workers: WorkerFactory
) -> None:
    record = basic.app.tasks["record"].with_options(unique_key="k-cancel", queue="low")
    first = record.send("x")
    assert first.cancel()
    second = record.send("y")
    assert second.deduplicated is False and second.id != first.id
    fail = basic.app.tasks["fail"].with_options(unique_key="k-fail")
    failed = fail.send("NOPE")
    workers.start(APP, "--queues", "default")
    assert failed.get(timeout=30).err.code == "NOPE"
    again = fail.send("NOPE")
    assert again.deduplicated is False and again.id != failed.id
    assert [r["status"] for r in keyed(db, "record", "k-cancel")] == ["CANCELLED", "PENDING"]


def test_send_async_deduplicates(db: Conn, basic: ModuleType) -> None:
    record = basic.app.tasks["record"].with_options(unique_key="k-async", queue="low")

    async def sends() -> list[Any]:
        return list(await asyncio.gather(*(record.send_async(str(i)) for i in range(20))))

    handles = asyncio.run(sends())
    (row,) = keyed(db, "record", "k-async")
    assert {h.id for h in handles} == {row["id"]}
    assert sorted(h.deduplicated for h in handles) == [False] + [True] * 19


# -- many producers at once ------------------------------------------------------------------

PRODUCERS, SENDS_EACH = 16, 100


def _producer(url: str, key: str, sends: int, barrier: Barrier, out: Any) -> None:
    """One producer process with its own app: wait for the others, then send ``key`` ``sends`` times."""
    app = Tether(AppConfig(queues=["default", "low"], broker=PostgresConfig(database_url=url)))

    @app.task("record")
    def record(token: str) -> TaskResult[str, Any]:
        return TaskResult(ok=token)

    task = record.with_options(unique_key=key, queue="low")
    task.send("warm-up-never-written-twice")  # the pool and the schema check, before the race
    barrier.wait(timeout=120)
    seen = [task.send(str(os.getpid())) for _ in range(sends)]
    out.put((os.getpid(), [(str(h.id), h.deduplicated) for h in seen]))
    app.close()


def _race(database_url: str, key: str) -> list[tuple[str, bool]]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PRODUCERS)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_producer, args=(database_url, key, SENDS_EACH, barrier, out))
        for _ in range(PRODUCERS)
    ]
    results: list[tuple[str, bool]] = []
    try:
        for p in procs:
            p.start()
        for _ in procs:
            _, seen = out.get(timeout=180)
            results += seen
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, f"producer {p.pid} exited with {p.exitcode}"
    except queue.Empty:
        raise AssertionError("a producer sent nothing back within 180 s") from None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # by its pid
                p.join()
    return results


def test_16_producer_processes_sending_one_key_create_one_task(
    db: Conn, basic: ModuleType, database_url: str
) -> None:
    key = f"race-{token()}"
    results = _race(database_url, key)
    (row,) = keyed(db, "record", key)
    assert task_count(db) == 1
    # The warm-up sends raced too: one of them created the task, every later send found it.
    assert len(results) == PRODUCERS * SENDS_EACH
    assert {task_id for task_id, _ in results} == {str(row["id"])}
    assert all(dedup for _, dedup in results)
    # Freed (cancelled), the key is raced for again: the takeover is decided on the key row too.
    assert basic.app.handle(row["id"]).cancel()
    results = _race(database_url, key)
    rows = keyed(db, "record", key)
    assert [r["status"] for r in rows] == ["CANCELLED", "PENDING"] and task_count(db) == 2
    assert {task_id for task_id, _ in results} == {str(rows[1]["id"])}
    key_now = key_row(db, "record", key)
    assert key_now is not None and key_now["task_id"] == rows[1]["id"] and key_now["active"]


# -- send_many ---------------------------------------------------------------------------------


def test_send_many_with_repeated_and_held_keys(db: Conn, basic: ModuleType) -> None:
    task = basic.app.tasks["record"]
    record = task.with_options(queue="low")
    held = task.with_options(unique_key="m-held", queue="low").send("held")
    handles = record.send_many(
        [("a",), ("b",), ("a2",), ("c",), ("held2",), ("b2",)],
        unique_keys=["m-a", "m-b", "m-a", "m-c", "m-held", "m-b"],
    )
    assert len(handles) == 6
    by_key = {k: keyed(db, "record", k) for k in ("m-a", "m-b", "m-c", "m-held")}
    assert all(len(rows) == 1 for rows in by_key.values()), by_key
    assert task_count(db) == 4
    ids = [h.id for h in handles]
    assert ids == [by_key[k][0]["id"] for k in ["m-a", "m-b", "m-a", "m-c", "m-held", "m-b"]]
    assert ids[4] == held.id
    # The first item of a key created its task; repeats in the call and held keys did not.
    assert [h.deduplicated for h in handles] == [False, False, True, False, True, True]
    assert [by_key[k][0]["args"] for k in ("m-a", "m-b", "m-c")] == [["a"], ["b"], ["c"]]
    # The same batch again: every key is held now, nothing is created.
    again = record.send_many([("a",), ("b",)], unique_keys=["m-a", "m-b"])
    assert [h.id for h in again] == ids[:2] and all(h.deduplicated for h in again)
    # One bound key for the whole batch: one task, a handle per item.
    one = task.with_options(unique_key="m-one", queue="low").send_many([("x",), ("y",), ("z",)])
    (row,) = keyed(db, "record", "m-one")
    assert [h.id for h in one] == [row["id"]] * 3 and [h.deduplicated for h in one] == [False, True, True]
    assert task_count(db) == 5


def test_send_many_async_with_keys(db: Conn, basic: ModuleType) -> None:
    record = basic.app.tasks["record"].with_options(queue="low")
    handles = asyncio.run(record.send_many_async([("a",), ("b",), ("c",)], unique_keys=["x", "y", "x"]))
    assert [h.deduplicated for h in handles] == [False, False, True]
    assert handles[0].id == handles[2].id and task_count(db) == 2


def test_bad_unique_input_changes_nothing(db: Conn, basic: ModuleType) -> None:
    record = basic.app.tasks["record"].with_options(queue="low")
    with pytest.raises(InvalidOptionError, match=r"unique_keys\[1\] must not be empty"):
        record.send_many([("a",), ("b",)], unique_keys=["ok", ""])
    with pytest.raises(InvalidOptionError, match="one key per item"):
        record.send_many([("a",), ("b",)], unique_keys=["ok"])
    with pytest.raises(InvalidOptionError, match="unique_for without unique_keys"):
        record.send_many([("a",)], unique_for=10)
    with pytest.raises(InvalidOptionError, match="unique_key must be a str"):
        basic.app.tasks["record"].with_options(unique_key=42)
    assert task_count(db) == 0
    assert db.execute("SELECT count(*) AS n FROM tether_unique_keys").fetchone() == {"n": 0}


# -- retries and recovery ----------------------------------------------------------------------


def test_a_retrying_task_keeps_its_key(db: Conn, basic: ModuleType, workers: WorkerFactory) -> None:
    retry_later = basic.app.tasks["retry_later"].with_options(unique_key="k-retry")
    first = retry_later.send(tok := token())
    workers.start(APP, "--queues", "default")
    # It fails TRANSIENT, and its one retry waits a minute: PENDING again, after one run.
    row = wait_until(
        lambda: (r := task_row(db, first.id))["retry_count"] == 1 and r["status"] == "PENDING" and r,
        message="the task to be PENDING for its retry",
    )
    assert row["error_code"] == "TRANSIENT" and runs(db, tok) == 1
    again = retry_later.send(token())
    assert again.deduplicated is True and again.id == first.id
    assert len(keyed(db, "retry_later", "k-retry")) == 1
    key = key_row(db, "retry_later", "k-retry")
    assert key is not None and key["active"] is True
    # Cancelled while it waits for the retry: the key is free.
    assert first.cancel()
    third = retry_later.send(token())
    assert third.deduplicated is False and third.id != first.id


def test_expiry_frees_the_key_and_options_are_the_first_send_s(
    db: Conn, basic: ModuleType, workers: WorkerFactory
) -> None:
    record = basic.app.tasks["record"]
    deadline = datetime.now(UTC) + timedelta(hours=1)
    delayed = record.with_options(unique_key="k-delayed", priority=7, good_until=deadline).schedule(
        timedelta(minutes=10), "later"
    )
    dup = record.with_options(unique_key="k-delayed", priority=-5).send("now")
    assert dup.deduplicated is True and dup.id == delayed.id
    (row,) = keyed(db, "record", "k-delayed")
    assert row["priority"] == 7 and row["good_until"] == deadline and row["args"] == ["later"]
    assert row["run_at"] - row["sent_at"] == timedelta(minutes=10)
    # good_until already passed: the reaper expires it, and that frees its key.
    stale = record.with_options(unique_key="k-expire", queue="low").send(
        "x", good_until=datetime.now(UTC) - timedelta(seconds=1)
    )
    workers.start(APP, "--queues", "default", env=FAST_REAPER)
    wait_status(db, stale.id, {"EXPIRED"})
    fresh = record.with_options(unique_key="k-expire", queue="low").send("y")
    assert fresh.deduplicated is False and fresh.id != stale.id
    # The delayed one is still waiting and still holds its key.
    assert task_row(db, delayed.id)["status"] == "PENDING"
    assert record.with_options(unique_key="k-delayed").send("again").id == delayed.id


# -- the window --------------------------------------------------------------------------------


@pytest.mark.timing
def test_the_window_counts_ended_tasks_sent_within_it(
    db: Conn, basic: ModuleType, workers: WorkerFactory
) -> None:
    window = 5.0
    record = basic.app.tasks["record"].with_options(unique_key="k-window", unique_for=window)
    # The worker first: the window runs from the send, and a worker's start on a loaded
    # machine can take seconds of it.
    workers.start(APP, "--queues", "default")
    first = record.send(token())
    assert first.get(timeout=30).is_ok
    # COMPLETED, but sent less than the window ago: still deduplicated.
    within = record.send(token())
    assert within.deduplicated is True and within.id == first.id
    # Without the window the same key is free (the task ended).
    # (Asked on another task name, so the windowed key above is left alone.)
    sent_at = task_row(db, first.id)["sent_at"]

    def window_passed() -> bool:
        row = db.execute("SELECT now() AS now").fetchone()
        return row is not None and row["now"] > sent_at + timedelta(seconds=window)

    wait_until(window_passed, timeout=10, message="the window to pass (database time)")
    after = record.send(tok := token())
    assert after.deduplicated is False and after.id != first.id
    assert after.get(timeout=30).ok == tok
    assert len(keyed(db, "record", "k-window")) == 2
    # A send without the window does not look at when the ended task was sent.
    plain = basic.app.tasks["record"].with_options(unique_key="k-window").send(token())
    assert plain.deduplicated is False


def test_a_live_task_holds_its_key_past_the_window(db: Conn, basic: ModuleType) -> None:
    record = basic.app.tasks["record"].with_options(unique_key="k-live", unique_for=0.5, queue="low")
    first = record.send("a")
    sent_at = task_row(db, first.id)["sent_at"]
    wait_until(
        lambda: (
            (r := db.execute("SELECT now() AS now").fetchone()) is not None
            and r["now"] > sent_at + timedelta(seconds=0.5)
        ),
        message="the window to pass",
    )
    assert record.send("b").id == first.id


# -- workflows -----------------------------------------------------------------------------------


def step_rows(db: Conn, workflow_id: Any) -> dict[str, dict[str, Any]]:
    rows = db.execute(
        "SELECT * FROM tether_workflow_tasks WHERE workflow_id = %s ORDER BY node", (workflow_id,)
    ).fetchall()
    return {r["node_name"]: dict(r) for r in rows}


def test_a_workflow_step_holds_its_key_and_a_second_workflow_s_step_is_refused(
    db: Conn, basic: ModuleType, database_url: str, workers: WorkerFactory
) -> None:
    from tests.apps.support import load_app_module

    flows = load_app_module("flows", database_url)
    number, add = flows.app.tasks["wf.number"], flows.app.tasks["wf.add"]
    key = f"wf-{token()}"

    def definition() -> Any:
        first = number.with_options(unique_key=key, unique_for=3600).node(args=(20,), name="first")
        second = add.node(kwargs={"b": 1}, args_from={"a": first}, name="second")
        return flows.app.workflow("keyed", [first, second])

    wf = definition().start()
    steps = step_rows(db, wf.id)
    assert steps["first"]["unique_key"] == key and steps["first"]["unique_for"] == timedelta(hours=1)
    step_task = steps["first"]["task_id"]
    (row,) = keyed(db, "wf.number", key)
    assert row["id"] == step_task and row["status"] == "PENDING" and row["workflow_id"] == wf.id
    # A plain send with the step's key meets the step's task.
    dup = number.with_options(unique_key=key).send(99)
    assert dup.deduplicated is True and dup.id == step_task

    # The same workflow again while the key is held: its keyed step is refused at once (no
    # code runs), its dependent is skipped, and the workflow fails; nothing else is created.
    again = definition().start()
    assert again.status().value == "FAILED"
    steps2 = step_rows(db, again.id)
    assert steps2["first"]["status"] == "FAILED" and steps2["first"]["error_code"] == "UNIQUE_KEY_HELD"
    assert steps2["first"]["result"]["err"]["data"] == {"task_id": str(step_task)}
    assert steps2["second"]["status"] == "SKIPPED"
    refused = task_row(db, steps2["first"]["task_id"])
    assert refused["status"] == "FAILED" and refused["error_code"] == "UNIQUE_KEY_HELD"
    assert db.execute(
        "SELECT count(*) AS n FROM tether_task_attempts WHERE task_id = %s", (refused["id"],)
    ).fetchone() == {"n": 0}
    key_now = key_row(db, "wf.number", key)
    assert key_now is not None and key_now["task_id"] == step_task and key_now["active"]

    # Run the first workflow: it completes, and its ended step still holds the key for the
    # window (unique_for=1 h) but a send without a window finds it free.
    workers.start("tests.apps.flows:app")
    assert wf.get(timeout=30).ok == 21
    assert number.with_options(unique_key=key, unique_for=3600).send(1).id == step_task
    assert number.with_options(unique_key=key).send(1).deduplicated is False
