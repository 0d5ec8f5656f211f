"""Checkpointed steps (docs/durable-steps.md) with real workers: a later attempt of a task gets
the results of the steps an earlier attempt completed, and their code does not run again.

The kills and the zombie attempt are in tests/chaos/test_step_kills.py.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import attempt_rows, load_app_module, task_row
from tests.chaos.conftest import ensure_chaos_ledger, runs, token
from tests.conftest import WorkerFactory, wait_until

APP = "tests.apps.steps:app"
SYNC_ONLY = ("--processes", "1", "--async-processes", "0")
ASYNC_ONLY = ("--processes", "0", "--async-processes", "1")
WAIT = 30

Conn = psycopg.Connection[Any]


@pytest.fixture
def steps(database_url: str, db: Conn) -> ModuleType:
    ensure_chaos_ledger(db)
    db.execute("TRUNCATE tether_chaos_ledger")
    return load_app_module("steps", database_url)


def stored(db: Conn, task_id: Any) -> list[tuple[str, int, Any, int]]:
    """The task's steps as stored: (name, occurrence, result, attempt), in the order recorded."""
    rows = db.execute(
        "SELECT name, occurrence, result, attempt FROM tether_task_steps WHERE task_id = %s"
        " ORDER BY written_at, name, occurrence",
        (task_id,),
    ).fetchall()
    return [(r["name"], r["occurrence"], r["result"], r["attempt"]) for r in rows]


def done(db: Conn, task_id: Any) -> dict[str, Any]:
    return wait_until(
        lambda: (row := task_row(db, task_id))["status"] in ("COMPLETED", "FAILED", "CANCELLED") and row,
        timeout=WAIT,
        message=f"task {task_id} to end",
    )


def test_a_retry_gets_the_steps_back_and_runs_only_what_is_new(
    steps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    """Steps of one name in a loop map by their order; a step that raised does not count."""
    workers.start(APP, *SYNC_ONLY)
    tok = token()
    handle = steps.loop_steps.send(tok, 3)
    row = done(db, handle.id)
    assert row["status"] == "COMPLETED", row
    # The flaky step raised once (in the first attempt), then stored its result; the retry
    # got every step back: its own function never ran, so its counter stayed at 0.
    assert row["result"] == {"ok": {"items": [0, 1, 4], "flaky": "steady", "tries": 0}}
    assert [a["outcome"] for a in attempt_rows(db, handle.id)] == ["FAILED", "COMPLETED"]
    first = attempt_rows(db, handle.id)[0]["attempt"]
    assert stored(db, handle.id) == [
        ("item", 0, 0, first),
        ("item", 1, 1, first),
        ("item", 2, 4, first),
        ("flaky", 0, "steady", first),
    ]
    assert [runs(db, f"{tok}:item{i}") for i in range(3)] == [1, 1, 1]
    assert runs(db, f"{tok}:flaky") == 2  # raised, then ran again in place: both in attempt 1


def test_bad_steps_are_refused_with_errors_that_name_the_argument(
    steps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    workers.start(APP, *SYNC_ONLY)
    handle = steps.bad_steps.send()
    row = done(db, handle.id)
    assert row["status"] == "COMPLETED", row
    errors = row["result"]["ok"]
    limit = "at most 200 characters"
    assert errors[0] == f"StepError: step: name must be a non-empty string of {limit}, got ''"
    assert errors[1] == f"StepError: step: name must be a non-empty string of {limit}, got 42"
    assert errors[2] == (
        f"StepError: step: name must be a non-empty string of {limit}, got a string of 201 characters"
    )
    assert errors[3] == (
        "StepError: step: name 'tether.sleep' starts with 'tether.', reserved for tether's own steps"
    )
    assert errors[4] == "StepError: step: name 'two\\nlines' contains control characters"
    assert errors[5] == "StepError: step 'not-callable': fn must be callable, got str"
    assert errors[6].startswith("StepError: step 'async-fn': fn is an async function; in an async def task")
    assert errors[7].startswith("SerializationError: cannot serialise the result of step 'not-json'")
    assert errors[8] == (
        "StepError: step 'too-big': its result is 1048578 bytes of JSON, over the limit of 1048576 bytes "
        "(STEP_RESULT_MAX_BYTES); store large data elsewhere and return its key"
    )
    assert len(errors) == 9
    assert stored(db, handle.id) == []  # nothing refused was stored


def test_async_steps_in_the_async_executor(steps: ModuleType, db: Conn, workers: WorkerFactory) -> None:
    worker = workers.start(APP, *ASYNC_ONLY)
    tok = token()
    handle = steps.async_steps.send(tok)
    refused = steps.async_step_refused.send()
    row = done(db, handle.id)
    assert row["status"] == "COMPLETED", row
    # The plain function's dict comes back as stored (jsonb's key order) in both attempts.
    assert row["result"] == {"ok": {"one": 1, "plain": {"a": 1, "b": 2}, "fan": ["a", "b"], "last": 300}}
    attempts = attempt_rows(db, handle.id)
    assert [(a["outcome"], a["worker_id"]) for a in attempts] == [
        ("FAILED", worker.worker_id),
        ("COMPLETED", worker.worker_id),
    ]
    first, second = (a["attempt"] for a in attempts)
    assert stored(db, handle.id)[-1] == ("last", 0, 300, second)
    assert sorted(stored(db, handle.id)[:-1]) == [
        ("fan", 0, "a", first),  # two steps of one name at once: numbered in call order
        ("fan", 1, "b", first),
        ("one", 0, 1, first),
        ("plain", 0, {"a": 1, "b": 2}, first),
    ]
    assert [runs(db, f"{tok}:{s}") for s in ("one", "fan-a", "fan-b", "last")] == [1, 1, 1, 1]
    row = done(db, refused.id)
    assert row["result"]["ok"].startswith(
        "StepError: step 'blocking': step() was called inside a running event loop"
    ), row


def test_a_sync_task_with_steps_in_an_async_child(
    steps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    """A sync task runs in a thread of the async child: its steps wait for the child's step writer."""
    workers.start(APP, *ASYNC_ONLY)
    tok = token()
    handle = steps.three_steps.send(tok)
    row = done(db, handle.id)
    assert row["status"] == "COMPLETED" and row["result"]["ok"]["total"] == 321, row
    assert [s[:3] for s in stored(db, handle.id)] == [("one", 0, 1), ("two", 0, 20), ("three", 0, 300)]


def test_an_async_task_with_steps_in_a_sync_child(
    steps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    workers.start(APP, *SYNC_ONLY)
    tok = token()
    handle = steps.async_steps.send(tok)
    row = done(db, handle.id)
    assert row["status"] == "COMPLETED", row
    assert row["result"]["ok"]["fan"] == ["a", "b"] and row["result"]["ok"]["last"] == 300
    assert [runs(db, f"{tok}:{s}") for s in ("one", "fan-a", "fan-b", "last")] == [1, 1, 1, 1]


def test_steps_inside_a_workflow_node(steps: ModuleType, db: Conn, workers: WorkerFactory) -> None:
    workers.start(APP, *SYNC_ONLY)
    tok = token()
    first = steps.node_with_steps.node(args=(5, tok), name="first")
    second = steps.node_with_steps.node(
        args_from={"value": first}, kwargs={"token": tok + "b"}, name="second"
    )
    handle = steps.app.workflow("with-steps", [first, second]).start()
    result = handle.get(timeout=WAIT)
    assert result.is_ok and result.ok == (5 * 2 + 1) * 2 + 1, result
    ids = db.execute(
        "SELECT node_name, task_id FROM tether_workflow_tasks WHERE workflow_id = %s", (handle.id,)
    ).fetchall()
    for r in ids:
        ((name, occurrence, _, _),) = stored(db, r["task_id"])
        assert (name, occurrence) == ("double", 0)


def test_steps_go_with_their_task(steps: ModuleType, db: Conn, workers: WorkerFactory) -> None:
    workers.start(APP, *SYNC_ONLY)
    handle = steps.three_steps.send(token())
    assert done(db, handle.id)["status"] == "COMPLETED"
    assert len(stored(db, handle.id)) == 3
    db.execute("DELETE FROM tether_tasks WHERE id = %s", (handle.id,))  # as retention does
    assert stored(db, handle.id) == []
