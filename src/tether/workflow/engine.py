"""The workflow engine: what happens when a step's task ends, and the operations on a workflow.

Every function takes a sync connection in autocommit mode and runs one
transaction that starts by locking the workflow's row, so the steps of one
workflow move one transaction at a time (see broker/sql/workflows.sql for the
locking rule). A step's task outcome is committed first, by whoever ended the
task (the child that ran it, the worker's main process, the reaper); the
workflow advances in the next transaction. A process that dies between the two
leaves a step ENQUEUED with an ended task: the reaper's reconciliation (and
``recover_stuck_workflows``) runs this same ``advance`` for it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from tether.broker.queries import q

log = logging.getLogger("tether.workflow")

Row = dict[str, Any]
Conn = psycopg.Connection[Row]


@dataclass
class Advanced:
    """What one advance did to one workflow (for logs and tests)."""

    settled: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    enqueued: int = 0
    status: str | None = None  # the workflow's status afterwards (None: nothing to do)


def start(conn: Conn, workflow: Row, steps: list[Row]) -> None:
    """Write the workflow and its steps, and enqueue the steps that wait for nothing."""
    with conn.transaction():
        conn.execute(q("insert_workflow"), workflow)
        conn.execute(q("insert_workflow_steps"), {"workflow_id": workflow["id"], "steps": _json(steps)})
        _enqueue_all_ready(conn, workflow["id"])


def advance(conn: Conn, workflow_id: uuid.UUID | str, task_ids: Sequence[uuid.UUID | str]) -> Advanced:
    """Settle the steps whose tasks (of ``task_ids``) have ended and move the workflow on.

    Idempotent: a step already settled is left alone, so the worker and the
    reaper may both call this for the same task.
    """
    done = Advanced()
    with conn.transaction():
        wf = conn.execute(q("lock_workflow"), {"id": workflow_id}).fetchone()
        if wf is None:
            log.warning(
                "workflow %s is gone (pruned?); its step tasks %s stay as they are", workflow_id, task_ids
            )
            return done
        conn.execute(q("plan_as_lookups"))
        settled = conn.execute(
            q("settle_steps"), {"workflow_id": workflow_id, "task_ids": [str(t) for t in task_ids]}
        ).fetchall()
        if not settled:
            return done
        done.settled = [r["node"] for r in settled]
        failed = sum(1 for r in settled if r["status"] != "COMPLETED")
        ready = _propagate(conn, workflow_id, settled, done)
        status = _account(conn, workflow_id, len(settled) + len(done.skipped), failed)
        done.status = status
        if status == "RUNNING" and ready:
            done.enqueued = _enqueue(conn, workflow_id, ready)
        if status == "PAUSED" and failed and wf["status"] == "RUNNING":
            log.warning(
                "workflow %s (%s) paused: a step failed and on_error='pause'; resume() or cancel() it",
                workflow_id,
                wf["name"],
            )
        if status in ("COMPLETED", "FAILED") and wf["status"] != status:
            log.info("workflow %s (%s) finished %s", workflow_id, wf["name"], status)
    return done


def _propagate(conn: Conn, workflow_id: uuid.UUID | str, finished: list[Row], done: Advanced) -> list[str]:
    """Count finished steps down in their dependents; skips cascade. Returns the task ids made READY.

    Reads and writes only the dependents' rows (by task id), so the cost
    follows the finished steps' out-degree, never the workflow's width.
    """
    ready: list[str] = []
    while finished:
        ended: dict[str, int] = {}
        completed: dict[str, int] = {}
        for row in finished:
            for dependent in map(str, row["dependents"]):
                ended[dependent] = ended.get(dependent, 0) + 1
                completed[dependent] = completed.get(dependent, 0) + (row["status"] == "COMPLETED")
        if not ended:
            break
        key = {"workflow_id": workflow_id, "task_ids": list(ended)}
        waiting = conn.execute(q("waiting_dependents"), key).fetchall()
        if not waiting:
            break
        changes: dict[str, dict[str, Any]] = {}
        for step in waiting:
            task_id = str(step["task_id"])
            left = step["waiting_on"] - ended[task_id]
            ok = step["deps_ok"] + completed[task_id]
            bad = step["deps_failed"] + ended[task_id] - completed[task_id]
            changes[task_id] = {
                "waiting_on": left,
                "deps_ok": ok,
                "deps_failed": bad,
                "status": _next_status(step["join_mode"], step["run_anyway"], left, ok, bad),
            }
        changed = conn.execute(
            q("update_dependents"),
            {"workflow_id": workflow_id, "task_ids": list(changes), "changes": json.dumps(changes)},
        ).fetchall()
        ready += [str(r["task_id"]) for r in changed if r["status"] == "READY"]
        finished = [r for r in changed if r["status"] == "SKIPPED"]
        done.skipped += [r["node"] for r in finished]
    return ready


def _next_status(join: str, run_anyway: bool, waiting_on: int, deps_ok: int, deps_failed: int) -> str:
    """A dependent's status once some of its dependencies have ended."""
    if join == "all":
        if deps_failed and not run_anyway:
            return "SKIPPED"  # at once: it can no longer run, whatever the others do
        return "READY" if waiting_on == 0 else "WAITING"
    if deps_ok:
        return "READY"  # join="any": the first dependency that completes
    if waiting_on == 0:
        return "READY" if run_anyway else "SKIPPED"
    return "WAITING"


def _account(conn: Conn, workflow_id: uuid.UUID | str, done: int, failed: int) -> str:
    row = conn.execute(
        q("account_steps"), {"workflow_id": workflow_id, "done": done, "failed": failed}
    ).fetchone()
    assert row is not None, "the workflow row is locked by this transaction"
    return str(row["status"])


def cancel(conn: Conn, workflow_id: uuid.UUID | str) -> bool:
    """Cancel an open workflow: steps not started end CANCELLED; running ones finish. True if it was open."""
    with conn.transaction():
        wf = conn.execute(q("lock_workflow"), {"id": workflow_id}).fetchone()
        if wf is None or not conn.execute(q("cancel_workflow"), {"id": workflow_id}).fetchall():
            return False
        unstarted = conn.execute(q("cancel_unstarted_steps"), {"id": workflow_id}).fetchall()
        settled = _cancel_step_tasks(conn, workflow_id)
        _account(conn, workflow_id, len(unstarted) + settled, 0)
    log.info(
        "workflow %s (%s) cancelled: %d step(s) had not started",
        workflow_id,
        wf["name"],
        len(unstarted) + settled,
    )
    return True


def cancel_leftovers(conn: Conn, workflow_id: uuid.UUID | str) -> int:
    """Cancel step tasks of a CANCELLED workflow that are waiting to run again (a retry
    scheduled after the cancel). Returns how many steps that settled."""
    with conn.transaction():
        wf = conn.execute(q("lock_workflow"), {"id": workflow_id}).fetchone()
        if wf is None or wf["status"] != "CANCELLED":
            return 0
        settled = _cancel_step_tasks(conn, workflow_id)
        _account(conn, workflow_id, settled, 0)
        return settled


def _cancel_step_tasks(conn: Conn, workflow_id: uuid.UUID | str) -> int:
    """Cancel the not-started tasks of ENQUEUED steps and settle those steps CANCELLED."""
    cancelled = conn.execute(q("cancel_step_tasks"), {"id": workflow_id}).fetchall()
    if not cancelled:
        return 0
    settled = conn.execute(
        q("settle_steps"), {"workflow_id": workflow_id, "task_ids": [str(r["id"]) for r in cancelled]}
    ).fetchall()
    return len(settled)


def resume(conn: Conn, workflow_id: uuid.UUID | str) -> bool:
    """Resume a PAUSED workflow: its READY steps are enqueued. True if it was paused."""
    with conn.transaction():
        if conn.execute(q("lock_workflow"), {"id": workflow_id}).fetchone() is None:
            return False
        if not conn.execute(q("resume_workflow"), {"id": workflow_id}).fetchall():
            return False
        _enqueue_all_ready(conn, workflow_id)
        # Every step may have finished while it was paused.
        _account(conn, workflow_id, 0, 0)
    return True


def pause(conn: Conn, workflow_id: uuid.UUID | str) -> bool:
    """Hold a RUNNING workflow: steps that become ready wait until resume(). True if it was running."""
    with conn.transaction():
        if conn.execute(q("lock_workflow"), {"id": workflow_id}).fetchone() is None:
            return False
        return bool(conn.execute(q("pause_workflow"), {"id": workflow_id}).fetchall())


def finalize(conn: Conn, workflow_id: uuid.UUID | str) -> str | None:
    """Finish a workflow whose steps have all ended, or enqueue READY steps left behind."""
    with conn.transaction():
        if conn.execute(q("lock_workflow"), {"id": workflow_id}).fetchone() is None:
            return None
        status = _account(conn, workflow_id, 0, 0)
        if status == "RUNNING":
            _enqueue_all_ready(conn, workflow_id)
        return status


def _enqueue_all_ready(conn: Conn, workflow_id: uuid.UUID | str) -> int:
    ready = [str(r["task_id"]) for r in conn.execute(q("ready_steps"), {"workflow_id": workflow_id})]
    return _enqueue(conn, workflow_id, ready)


def _enqueue(conn: Conn, workflow_id: uuid.UUID | str, task_ids: list[str]) -> int:
    """Turn these READY steps (by task id) into tasks; how many were enqueued."""
    if not task_ids:
        return 0
    row = conn.execute(q("enqueue_steps"), {"workflow_id": workflow_id, "task_ids": task_ids}).fetchone()
    return int(row["enqueued"]) if row else 0


def _json(steps: Iterable[Row]) -> str:
    return json.dumps(list(steps), separators=(",", ":"))
