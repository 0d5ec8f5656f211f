"""Reconciliation and retention of workflows, without workers: the mismatch is made by hand.

A step's task ends in one transaction and its workflow advances in the next; a process that
dies in between (or an operator who ends a task by SQL) leaves the step ENQUEUED with an
ended task. Here the first step of each workflow goes to queue `other`, which no worker
serves, and its task row is ended by an UPDATE, the way a dead process or an operator would
leave it. ``tether.recover_stuck_workflows`` must then settle the step from the task (with a
result synthesised when the task has none), move the workflow on, and do nothing the second
time. Retention (``tether.broker.recovery.prune``) must delete finished workflows with their
steps and step tasks, and nothing of a workflow that is still open.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psycopg
import pytest

import tether
from tests.apps.support import ensure_ledger, load_app_module, task_row
from tests.apps.support import find_workflow as workflow_row
from tests.apps.support import workflow_steps as steps
from tether.broker import recovery
from tether.config import RecoveryConfig
from tether.errors import WorkflowNotFoundError

Conn = psycopg.Connection[Any]

# The column each terminal status stamps on tether_tasks.
STAMP = {
    "COMPLETED": "completed_at",
    "FAILED": "failed_at",
    "CANCELLED": "cancelled_at",
    "EXPIRED": "expired_at",
}


@pytest.fixture
def flows(database_url: str, db: Conn) -> Iterator[ModuleType]:
    ensure_ledger(db)
    yield load_app_module("flows", database_url)


def end_task(
    conn: Conn, task_id: Any, status: str, result: Any = None, error_code: str | None = None
) -> None:
    """End a task by SQL, as an operator (or a process that died before advancing) leaves it."""
    row = conn.execute(
        f"UPDATE tether_tasks SET status = %s, result = %s::jsonb, error_code = %s,"
        f" {STAMP[status]} = now(), updated_at = now() WHERE id = %s RETURNING id",
        (status, None if result is None else json.dumps(result), error_code, task_id),
    ).fetchone()
    assert row is not None, f"no task {task_id}"


def recover(flows: ModuleType) -> tuple[int, list[str]]:
    done = tether.recover_stuck_workflows(flows.app)
    return done.steps, done.finished


def parked_first_step(flows: ModuleType, name: str) -> Any:
    """first (queue `other`, nobody serves it) -> then (value fed in) -> then2; report runs anyway."""
    first = flows.number.with_options(queue="other").node(args=(7,), name="first")
    then = flows.add.node(kwargs={"b": 1}, args_from={"a": first}, name="then")
    then2 = flows.add.node(kwargs={"b": 10}, args_from={"a": then}, name="then2")
    report = flows.report.node(args_from={"upstream": first}, run_anyway=True, name="report")
    handle = flows.app.workflow(name, [first, then, then2, report], output="then2").start()
    return handle


def started_steps(db: Conn, handle: Any) -> dict[str, dict[str, Any]]:
    """As started: only `first` has a task, parked on `other`."""
    rows = steps(db, handle.id)
    assert {n: (r["status"], r["task_status"]) for n, r in rows.items()} == {
        "first": ("ENQUEUED", "PENDING"),
        "then": ("WAITING", None),
        "then2": ("WAITING", None),
        "report": ("WAITING", None),
    }
    assert rows["first"]["task_queue"] == "other"
    return rows


# -- each way a task can end -----------------------------------------------------------------


def test_a_completed_task_settles_its_step_and_feeds_its_value_on(flows: ModuleType, db: Conn) -> None:
    handle = parked_first_step(flows, "reconcile-completed")
    first_task = started_steps(db, handle)["first"]["task_id"]

    end_task(db, first_task, "COMPLETED", {"ok": 7})
    # The mismatch the reaper looks for: the task has ended, its step has not.
    assert steps(db, handle.id)["first"]["status"] == "ENQUEUED"

    assert recover(flows) == (1, [])

    rows = steps(db, handle.id)
    assert rows["first"]["status"] == "COMPLETED"
    assert rows["first"]["result"] == {"ok": 7}
    assert rows["first"]["finished_at"] is not None
    # Dependents enqueued as tasks, with the value fed in next to their own arguments.
    assert (rows["then"]["status"], rows["then"]["task_status"]) == ("ENQUEUED", "PENDING")
    assert rows["then"]["task_kwargs"] == {"b": 1, "a": 7}
    assert rows["then"]["task_queue"] == "default"
    assert (rows["report"]["status"], rows["report"]["task_status"]) == ("ENQUEUED", "PENDING")
    assert rows["report"]["task_kwargs"] == {"upstream": {"ok": 7}}  # TaskResult-typed: the whole result
    then_task = task_row(db, rows["then"]["task_id"])
    assert then_task["workflow_id"] == handle.id
    assert rows["then2"]["status"] == "WAITING"
    wf = workflow_row(db, handle.id)
    assert wf is not None
    assert (wf["status"], wf["steps_done"], wf["steps_failed"]) == ("RUNNING", 1, 0)

    # Idempotent: nothing is stuck any more; the step keeps its first settlement.
    assert recover(flows) == (0, [])
    again = steps(db, handle.id)
    assert again["first"]["finished_at"] == rows["first"]["finished_at"]
    assert again["then"]["enqueued_at"] == rows["then"]["enqueued_at"]
    assert workflow_row(db, handle.id) == wf

    # The rest of the chain ends the same way, down to the workflow's result.
    end_task(db, rows["then"]["task_id"], "COMPLETED", {"ok": 8})
    end_task(db, rows["report"]["task_id"], "COMPLETED", {"ok": "ok 7"})
    assert recover(flows) == (2, [])
    rows = steps(db, handle.id)
    assert rows["then2"]["task_kwargs"] == {"b": 10, "a": 8}
    end_task(db, rows["then2"]["task_id"], "COMPLETED", {"ok": 18})
    assert recover(flows) == (1, [])
    assert handle.status() is tether.WorkflowStatus.COMPLETED
    assert handle.get(timeout=5).ok == 18
    wf = workflow_row(db, handle.id)
    assert wf is not None and (wf["steps_done"], wf["steps_failed"]) == (4, 0)
    assert wf["finished_at"] is not None
    assert recover(flows) == (0, [])


def test_a_step_settled_completed_carries_no_error_code(flows: ModuleType, db: Conn) -> None:
    """Like its task, a COMPLETED step has no error code (StepInfo.error_code shows it)."""
    only = flows.number.with_options(queue="other").node(args=(1,), name="only")
    handle = flows.app.workflow("reconcile-no-error-code", [only]).start()
    task_id = steps(db, handle.id)["only"]["task_id"]
    end_task(db, task_id, "COMPLETED", {"ok": 1})
    assert task_row(db, task_id)["error_code"] is None

    assert recover(flows) == (1, [])

    row = steps(db, handle.id)["only"]
    assert (row["status"], row["result"]) == ("COMPLETED", {"ok": 1})
    assert row["error_code"] is None, f"a COMPLETED step carries error_code {row['error_code']!r}"
    (info,) = handle.info().steps
    assert info.error_code is None


@pytest.mark.parametrize(
    ("task_status", "step_status", "code"),
    [
        ("COMPLETED", "FAILED", "RESULT_NOT_AVAILABLE"),
        ("FAILED", "FAILED", "WORKER_CRASHED"),
        ("CANCELLED", "CANCELLED", "TASK_CANCELLED"),
        ("EXPIRED", "FAILED", "TASK_EXPIRED"),
    ],
)
def test_a_task_that_ended_without_a_result_gets_one_synthesised(
    flows: ModuleType, db: Conn, task_status: str, step_status: str, code: str
) -> None:
    handle = parked_first_step(flows, f"reconcile-{task_status.lower()}")
    first_task = started_steps(db, handle)["first"]["task_id"]

    end_task(db, first_task, task_status)  # no result, no error code: nothing to copy
    assert recover(flows) == (1, [])

    rows = steps(db, handle.id)
    first = rows["first"]
    assert (first["status"], first["error_code"]) == (step_status, code)
    assert first["result"] == {
        "err": {
            "code": code,
            "message": f"the step's task ended {task_status} without a stored result",
            "data": None,
        }
    }
    # Dependents that needed its value are skipped, down the chain, and never become tasks.
    for name in ("then", "then2"):
        assert (rows[name]["status"], rows[name]["task_status"]) == ("SKIPPED", None), rows[name]
        assert rows[name]["error_code"] == "DEPENDENCY_FAILED"
    # run_anyway with a TaskResult parameter: enqueued, given the synthesised error.
    assert (rows["report"]["status"], rows["report"]["task_status"]) == ("ENQUEUED", "PENDING")
    assert rows["report"]["task_kwargs"] == {"upstream": first["result"]}
    wf = workflow_row(db, handle.id)
    assert wf is not None
    assert (wf["status"], wf["steps_done"], wf["steps_failed"]) == ("RUNNING", 3, 1)

    assert recover(flows) == (0, [])
    assert steps(db, handle.id) == rows
    assert workflow_row(db, handle.id) == wf

    # The last step ends: the workflow fails, naming the step and the synthesised code.
    end_task(db, rows["report"]["task_id"], "COMPLETED", {"ok": f"err {code}"})
    assert recover(flows) == (1, [])
    assert handle.status() is tether.WorkflowStatus.FAILED
    err = handle.get(timeout=5).err
    assert err is not None and err.code == tether.ErrorCode.WORKFLOW_FAILED
    assert err.data["failed_steps"] == {
        "first": {"code": code, "message": f"the step's task ended {task_status} without a stored result"}
    }
    wf = workflow_row(db, handle.id)
    assert wf is not None and (wf["steps_done"], wf["steps_failed"]) == (4, 1)
    assert recover(flows) == (0, [])


@pytest.mark.parametrize("task_status", ["FAILED", "CANCELLED"])
def test_a_stored_error_is_kept_not_synthesised(flows: ModuleType, db: Conn, task_status: str) -> None:
    only = flows.number.with_options(queue="other").node(args=(1,), name="only")
    handle = flows.app.workflow(f"stored-{task_status.lower()}", [only]).start()
    (row,) = steps(db, handle.id).values()
    stored = {"err": {"code": "BROKEN", "message": "ended by hand", "data": {"why": "test"}}}

    end_task(db, row["task_id"], task_status, stored, "BROKEN")
    assert recover(flows) == (1, [])

    (row,) = steps(db, handle.id).values()
    assert (row["status"], row["error_code"], row["result"]) == (task_status, "BROKEN", stored)
    assert handle.status() is tether.WorkflowStatus.FAILED
    assert recover(flows) == (0, [])


def test_a_stuck_step_of_a_paused_workflow_settles_but_starts_nothing(flows: ModuleType, db: Conn) -> None:
    first = flows.number.with_options(queue="other").node(args=(2,), name="first")
    then = flows.add.node(kwargs={"b": 3}, args_from={"a": first}, name="then")
    handle = flows.app.workflow("reconcile-paused", [first, then]).start()
    assert handle.pause() is True
    end_task(db, steps(db, handle.id)["first"]["task_id"], "COMPLETED", {"ok": 2})

    assert recover(flows) == (1, [])
    rows = steps(db, handle.id)
    assert rows["first"]["status"] == "COMPLETED"
    assert (rows["then"]["status"], rows["then"]["task_status"]) == ("READY", None)  # held
    assert handle.status() is tether.WorkflowStatus.PAUSED
    assert recover(flows) == (0, [])

    assert handle.resume() is True
    rows = steps(db, handle.id)
    assert (rows["then"]["status"], rows["then"]["task_kwargs"]) == ("ENQUEUED", {"b": 3, "a": 2})


def test_many_stuck_workflows_are_settled_in_batches(flows: ModuleType, db: Conn) -> None:
    handles = []
    for i in range(3):
        a = flows.number.with_options(queue="other").node(args=(i,), name="a")
        b = flows.number.with_options(queue="other").node(args=(i,), name="b")
        c = flows.add.node(args_from={"a": a, "b": b}, name="c")
        handles.append(flows.app.workflow(f"batch-{i}", [a, b, c]).start())
    for i, h in enumerate(handles):
        rows = steps(db, h.id)
        end_task(db, rows["a"]["task_id"], "COMPLETED", {"ok": i})
        end_task(db, rows["b"]["task_id"], "COMPLETED", {"ok": 10 * i})

    # One step per pass: recover goes on until nothing is left.
    done = tether.recover_stuck_workflows(flows.app, limit=1)
    assert (done.steps, done.finished) == (6, [])
    for i, h in enumerate(handles):
        rows = steps(db, h.id)
        assert (rows["a"]["status"], rows["b"]["status"]) == ("COMPLETED", "COMPLETED")
        assert (rows["c"]["status"], rows["c"]["task_kwargs"]) == ("ENQUEUED", {"a": i, "b": 10 * i})
        wf = workflow_row(db, h.id)
        assert wf is not None and (wf["status"], wf["steps_done"]) == ("RUNNING", 2)
    assert recover(flows) == (0, [])

    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="limit must be a positive int"):
            tether.recover_stuck_workflows(flows.app, limit=bad)  # type: ignore[arg-type]


def test_an_open_workflow_whose_steps_all_ended_is_finished(flows: ModuleType, db: Conn) -> None:
    """The safety net: counters say every step is done (changed by hand), the status does not."""
    only = flows.number.with_options(queue="other").node(args=(1,), name="only")
    handle = flows.app.workflow("reconcile-counters", [only]).start()
    step = steps(db, handle.id)["only"]
    end_task(db, step["task_id"], "COMPLETED", {"ok": 1})
    # An operator settles the step and counts it, but leaves the workflow RUNNING.
    db.execute(
        "UPDATE tether_workflow_tasks SET status = 'COMPLETED', result = '{\"ok\": 1}', finished_at = now()"
        " WHERE task_id = %s",
        (step["task_id"],),
    )
    db.execute("UPDATE tether_workflows SET steps_done = steps_total WHERE id = %s", (handle.id,))

    assert recover(flows) == (0, [str(handle.id)])
    assert handle.status() is tether.WorkflowStatus.COMPLETED
    assert handle.get(timeout=5).ok == 1
    assert recover(flows) == (0, [])


# -- retention -------------------------------------------------------------------------------

RETAIN_HOURS = 1
OLD = "now() - interval '2 hours'"


def one_step_workflow(flows: ModuleType, db: Conn, name: str, end_as: str | None) -> tuple[Any, Any]:
    """A workflow of one step on `other`; ended (and reconciled) when end_as is given."""
    only = flows.number.with_options(queue="other").node(args=(1,), name="only")
    handle = flows.app.workflow(name, [only]).start()
    task_id = steps(db, handle.id)["only"]["task_id"]
    if end_as is not None:
        end_task(db, task_id, end_as, {"ok": 1} if end_as == "COMPLETED" else None)
        recover(flows)
    return handle, task_id


def backdate(db: Conn, workflow_id: Any) -> None:
    db.execute(
        f"UPDATE tether_workflows SET created_at = {OLD}, updated_at = {OLD},"
        f" finished_at = CASE WHEN finished_at IS NOT NULL THEN {OLD} END WHERE id = %s",
        (workflow_id,),
    )
    db.execute(
        f"UPDATE tether_tasks SET updated_at = {OLD}, sent_at = {OLD}, enqueued_at = {OLD}"
        " WHERE workflow_id = %s",
        (workflow_id,),
    )


def exists(db: Conn, table: str, column: str, value: Any) -> bool:
    row = db.execute(f"SELECT count(*) AS n FROM {table} WHERE {column} = %s", (value,)).fetchone()
    assert row is not None
    return bool(row["n"])


def test_retention_prunes_finished_workflows_with_their_steps_and_tasks(flows: ModuleType, db: Conn) -> None:
    # Finished long ago: pruned, with its steps and its steps' tasks (and their attempts).
    old_done, old_done_task = one_step_workflow(flows, db, "old-completed", "COMPLETED")
    old_failed, old_failed_task = one_step_workflow(flows, db, "old-failed", "FAILED")
    old_cancelled, old_cancelled_task = one_step_workflow(flows, db, "old-cancelled", None)
    assert old_cancelled.cancel() is True
    db.execute(
        "INSERT INTO tether_task_attempts (task_id, attempt, outcome) VALUES (%s, 1, 'COMPLETED')",
        (old_done_task,),
    )
    # Finished just now: kept.
    new_done, new_done_task = one_step_workflow(flows, db, "new-completed", "COMPLETED")
    # Open for long, its first step's task ended long ago: kept whole, however old.
    first = flows.number.with_options(queue="other").node(args=(1,), name="first")
    then = flows.number.with_options(queue="other").node(args=(2,), after=[first], name="then")
    open_wf = flows.app.workflow("old-open", [first, then]).start()
    open_first = steps(db, open_wf.id)["first"]["task_id"]
    end_task(db, open_first, "COMPLETED", {"ok": 1})
    assert recover(flows) == (1, [])
    open_then = steps(db, open_wf.id)["then"]["task_id"]
    end_task(db, open_then, "FAILED", None)  # ended, but stuck: the workflow is still RUNNING
    # Plain tasks: an old finished one is pruned, an old pending one and a new finished one kept.
    old_plain = flows.number.with_options(queue="other").send(1).id
    old_pending = flows.number.with_options(queue="other").send(2).id
    new_plain = flows.number.with_options(queue="other").send(3).id
    end_task(db, old_plain, "COMPLETED", {"ok": 1})
    end_task(db, new_plain, "COMPLETED", {"ok": 3})
    db.execute(f"UPDATE tether_tasks SET updated_at = {OLD} WHERE id = ANY(%s)", ([old_plain, old_pending],))
    for h in (old_done, old_failed, old_cancelled, open_wf):
        backdate(db, h.id)
    assert [h.status() for h in (old_done, old_failed, old_cancelled, new_done, open_wf)] == [
        tether.WorkflowStatus.COMPLETED,
        tether.WorkflowStatus.FAILED,
        tether.WorkflowStatus.CANCELLED,
        tether.WorkflowStatus.COMPLETED,
        tether.WorkflowStatus.RUNNING,
    ]

    config = RecoveryConfig(
        terminal_record_retention_hours=RETAIN_HOURS,
        heartbeat_retention_hours=None,
        worker_state_retention_hours=None,
    )
    with db.transaction():
        pruned = recovery.prune(db, config)

    assert pruned == {"tasks": 1, "workflows": 3}, pruned
    for h, task_id in (
        (old_done, old_done_task),
        (old_failed, old_failed_task),
        (old_cancelled, old_cancelled_task),
    ):
        assert workflow_row(db, h.id) is None
        assert not exists(db, "tether_workflow_tasks", "workflow_id", h.id)
        assert not exists(db, "tether_tasks", "id", task_id)
    assert not exists(db, "tether_task_attempts", "task_id", old_done_task)
    with pytest.raises(WorkflowNotFoundError):
        old_done.status()
    # Kept: the recent workflow, the open one with its old ended step tasks, and the plain tasks
    # that are not both finished and old.
    assert workflow_row(db, new_done.id) is not None and exists(db, "tether_tasks", "id", new_done_task)
    assert len(steps(db, open_wf.id)) == 2
    assert exists(db, "tether_tasks", "id", open_first) and exists(db, "tether_tasks", "id", open_then)
    assert not exists(db, "tether_tasks", "id", old_plain)
    assert exists(db, "tether_tasks", "id", old_pending) and exists(db, "tether_tasks", "id", new_plain)

    # The open workflow can still be reconciled and finished after the pass.
    assert recover(flows) == (1, [])
    assert open_wf.status() is tether.WorkflowStatus.FAILED
    with db.transaction():
        assert recovery.prune(db, config) == {}  # finished just now: not old yet


def test_plain_task_pruning_never_deletes_a_workflow_s_task(flows: ModuleType, db: Conn) -> None:
    """Even a finished workflow's step tasks go only with their workflow, by its own age."""
    done, done_task = one_step_workflow(flows, db, "young-workflow-old-task", "COMPLETED")
    assert done.status() is tether.WorkflowStatus.COMPLETED
    db.execute(f"UPDATE tether_tasks SET updated_at = {OLD} WHERE id = %s", (done_task,))
    config = RecoveryConfig(
        terminal_record_retention_hours=RETAIN_HOURS,
        heartbeat_retention_hours=None,
        worker_state_retention_hours=None,
    )
    with db.transaction():
        assert recovery.prune(db, config) == {}
    assert exists(db, "tether_tasks", "id", done_task)
    assert workflow_row(db, done.id) is not None
    assert done.results()["only"].ok == 1  # type: ignore[union-attr]


def test_a_retry_scheduled_after_the_cancel_is_cancelled_too(flows: ModuleType, db: Conn) -> None:
    """A step running at the cancel finishes; if it then fails with a retry scheduled, that
    retry must not run in a cancelled workflow: reconciliation cancels it."""
    handle = parked_first_step(flows, "cancel-then-retry")
    first_task = started_steps(db, handle)["first"]["task_id"]
    db.execute("UPDATE tether_tasks SET status = 'RUNNING', started_at = now() WHERE id = %s", (first_task,))
    assert handle.cancel() is True
    assert steps(db, handle.id)["first"]["status"] == "ENQUEUED"  # running: left to finish
    # Its attempt fails and its policy schedules a retry: back to PENDING.
    db.execute("UPDATE tether_tasks SET status = 'PENDING', retry_count = 1 WHERE id = %s", (first_task,))

    assert recover(flows) == (1, [])

    assert task_row(db, first_task)["status"] == "CANCELLED"
    rows = steps(db, handle.id)
    assert rows["first"]["status"] == "CANCELLED"
    wf = workflow_row(db, handle.id)
    assert wf is not None and (wf["status"], wf["steps_done"]) == ("CANCELLED", 4)
    assert recover(flows) == (0, [])
