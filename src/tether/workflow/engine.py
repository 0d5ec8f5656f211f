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

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from tether.broker import workflows
from tether.broker.types import AsyncConn, Conn
from tether.broker.workflows import ChangedStep, DependentUpdate, NewStep, NewWorkflow
from tether.result import StepStatus, WorkflowStatus

log = logging.getLogger("tether.workflow")


@dataclass
class Advanced:
    """What one advance did to one workflow (for logs and tests)."""

    settled: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    enqueued: int = 0
    status: WorkflowStatus | None = None  # the workflow's status afterwards (None: nothing to do)


def start(conn: Conn, workflow: NewWorkflow, steps: list[NewStep]) -> None:
    """Write the workflow and its steps, and enqueue the steps that wait for nothing."""
    with conn.transaction():
        write_start(conn, workflow, steps)


def write_start(conn: Conn, workflow: NewWorkflow, steps: list[NewStep]) -> None:
    """start's statements, in the caller's transaction (the caller makes them all or none)."""
    workflows.insert_workflow(conn, workflow)
    workflows.insert_workflow_steps(conn, workflow.id, steps)
    _enqueue_all_ready(conn, workflow.id, workflow.name)


async def write_start_async(conn: AsyncConn, workflow: NewWorkflow, steps: list[NewStep]) -> None:
    """write_start on the caller's async connection, in the caller's async transaction.

    A first step refused because another task holds its unique key is written FAILED
    (UNIQUE_KEY_HELD) as on the sync path, but settling it in its workflow (on_error) is
    left to the reaper's reconciliation, which does it within one check interval of the
    commit: the settling rules exist once, on the sync side.
    """
    await workflows.insert_workflow_async(conn, workflow)
    await workflows.insert_workflow_steps_async(conn, workflow.id, steps)
    ready = await workflows.ready_steps_async(conn, workflow.id)
    if ready:
        enqueued = await workflows.enqueue_steps_async(conn, workflow.id, ready)
        if enqueued.refused:
            log.info(
                "workflow %s (%s): first steps %s refused, their unique keys held; the reaper "
                "settles them after your commit",
                workflow.id,
                workflow.name,
                enqueued.refused,
            )


def advance(conn: Conn, workflow_id: uuid.UUID | str, task_ids: Sequence[uuid.UUID | str]) -> Advanced:
    """Settle the steps whose tasks (of ``task_ids``) have ended and move the workflow on.

    Idempotent: a step already settled is left alone, so the worker and the
    reaper may both call this for the same task.
    """
    done = Advanced()
    with conn.transaction():
        wf = workflows.lock_workflow(conn, workflow_id)
        if wf is None:
            log.warning(
                "workflow %s is gone (pruned?); its step tasks %s stay as they are",
                workflow_id,
                task_ids,
                extra={"task_ids": [str(t) for t in task_ids], "task_count": len(task_ids)},
            )
            return done
        workflows.plan_as_lookups(conn)
        _settle(conn, workflow_id, wf.name, wf.status, [str(t) for t in task_ids], done)
    return done


def _settle(
    conn: Conn,
    workflow_id: uuid.UUID | str,
    name: str,
    was: WorkflowStatus,
    task_ids: list[str],
    done: Advanced,
) -> None:
    """Settle steps whose tasks ended, count them, enqueue what became ready; the workflow is locked.

    Steps refused at enqueue (their unique key was held: their task is FAILED already) are
    settled the same way, in the same transaction, until nothing more moves.
    """
    while task_ids:
        settled = workflows.settle_steps(conn, workflow_id, task_ids)
        if not settled:
            return
        skipped_before = len(done.skipped)
        done.settled += [s.node for s in settled]
        failed = sum(1 for s in settled if s.status is not StepStatus.COMPLETED)
        ready = _propagate(conn, workflow_id, settled, done)
        status = _account(conn, workflow_id, len(settled) + len(done.skipped) - skipped_before, failed)
        done.status = status
        task_ids = []
        if status is WorkflowStatus.RUNNING and ready:
            enqueued = workflows.enqueue_steps(conn, workflow_id, ready)
            done.enqueued += enqueued.count
            task_ids = enqueued.refused
        if status is WorkflowStatus.PAUSED and failed and was is WorkflowStatus.RUNNING:
            log.warning(
                "workflow %s (%s) paused: a step failed and on_error='pause'; resume() or cancel() it",
                workflow_id,
                name,
            )
        if status in (WorkflowStatus.COMPLETED, WorkflowStatus.FAILED) and was is not status:
            log.info("workflow %s (%s) finished %s", workflow_id, name, status)
        was = status


def _propagate(
    conn: Conn, workflow_id: uuid.UUID | str, finished: list[ChangedStep], done: Advanced
) -> list[str]:
    """Count finished steps down in their dependents; skips cascade. Returns the task ids made READY.

    Reads and writes only the dependents' rows (by task id), so the cost
    follows the finished steps' out-degree, never the workflow's width.
    """
    ready: list[str] = []
    while finished:
        ended: dict[str, int] = {}
        completed: dict[str, int] = {}
        for moved in finished:
            for dependent in map(str, moved.dependents):
                ended[dependent] = ended.get(dependent, 0) + 1
                completed[dependent] = completed.get(dependent, 0) + (moved.status is StepStatus.COMPLETED)
        if not ended:
            break
        waiting = workflows.waiting_dependents(conn, workflow_id, list(ended))
        if not waiting:
            break
        updates: dict[str, DependentUpdate] = {}
        for step in waiting:
            task_id = str(step.task_id)
            left = step.waiting_on - ended[task_id]
            ok = step.deps_ok + completed[task_id]
            bad = step.deps_failed + ended[task_id] - completed[task_id]
            status = _next_status(step.join_mode, step.run_anyway, left, ok, bad)
            updates[task_id] = DependentUpdate(waiting_on=left, deps_ok=ok, deps_failed=bad, status=status)
        changed = workflows.update_dependents(conn, workflow_id, updates)
        ready += [str(s.task_id) for s in changed if s.status is StepStatus.READY]
        finished = [s for s in changed if s.status is StepStatus.SKIPPED]
        done.skipped += [s.node for s in finished]
    return ready


def _next_status(join: str, run_anyway: bool, waiting_on: int, deps_ok: int, deps_failed: int) -> StepStatus:
    """A dependent's status once some of its dependencies have ended."""
    if join == "all":
        if deps_failed and not run_anyway:
            return StepStatus.SKIPPED  # at once: it can no longer run, whatever the others do
        return StepStatus.READY if waiting_on == 0 else StepStatus.WAITING
    if deps_ok:
        return StepStatus.READY  # join="any": the first dependency that completes
    if waiting_on == 0:
        return StepStatus.READY if run_anyway else StepStatus.SKIPPED
    return StepStatus.WAITING


def _account(conn: Conn, workflow_id: uuid.UUID | str, done: int, failed: int) -> WorkflowStatus:
    status = workflows.account_steps(conn, workflow_id, done=done, failed=failed)
    assert status is not None, "the workflow row is locked by this transaction"
    return status


def cancel(conn: Conn, workflow_id: uuid.UUID | str) -> bool:
    """Cancel an open workflow: steps not started end CANCELLED; running ones finish. True if it was open."""
    with conn.transaction():
        wf = workflows.lock_workflow(conn, workflow_id)
        if wf is None or not workflows.cancel_workflow(conn, workflow_id):
            return False
        unstarted = workflows.cancel_unstarted_steps(conn, workflow_id)
        settled = _cancel_step_tasks(conn, workflow_id)
        _account(conn, workflow_id, unstarted + settled, 0)
    log.info(
        "workflow %s (%s) cancelled: %d step(s) had not started",
        workflow_id,
        wf.name,
        unstarted + settled,
    )
    return True


def cancel_leftovers(conn: Conn, workflow_id: uuid.UUID | str) -> int:
    """Cancel step tasks of a CANCELLED workflow that are waiting to run again (a retry
    scheduled after the cancel). Returns how many steps that settled."""
    with conn.transaction():
        wf = workflows.lock_workflow(conn, workflow_id)
        if wf is None or wf.status is not WorkflowStatus.CANCELLED:
            return 0
        settled = _cancel_step_tasks(conn, workflow_id)
        _account(conn, workflow_id, settled, 0)
        return settled


def _cancel_step_tasks(conn: Conn, workflow_id: uuid.UUID | str) -> int:
    """Cancel the not-started tasks of ENQUEUED steps and settle those steps CANCELLED."""
    cancelled = workflows.cancel_step_tasks(conn, workflow_id)
    if not cancelled:
        return 0
    return len(workflows.settle_steps(conn, workflow_id, cancelled))


def resume(conn: Conn, workflow_id: uuid.UUID | str) -> bool:
    """Resume a PAUSED workflow: its READY steps are enqueued. True if it was paused."""
    with conn.transaction():
        wf = workflows.lock_workflow(conn, workflow_id)
        if wf is None or not workflows.resume_workflow(conn, workflow_id):
            return False
        _enqueue_all_ready(conn, workflow_id, wf.name)
        # Every step may have finished while it was paused.
        _account(conn, workflow_id, 0, 0)
    return True


def pause(conn: Conn, workflow_id: uuid.UUID | str) -> bool:
    """Hold a RUNNING workflow: steps that become ready wait until resume(). True if it was running."""
    with conn.transaction():
        if workflows.lock_workflow(conn, workflow_id) is None:
            return False
        return workflows.pause_workflow(conn, workflow_id)


def finalize(conn: Conn, workflow_id: uuid.UUID | str) -> WorkflowStatus | None:
    """Finish a workflow whose steps have all ended, or enqueue READY steps left behind."""
    with conn.transaction():
        wf = workflows.lock_workflow(conn, workflow_id)
        if wf is None:
            return None
        status = _account(conn, workflow_id, 0, 0)
        if status is WorkflowStatus.RUNNING:
            return _enqueue_all_ready(conn, workflow_id, wf.name) or status
        return status


def _enqueue_all_ready(conn: Conn, workflow_id: uuid.UUID | str, name: str) -> WorkflowStatus | None:
    """Turn every READY step into a task; settle those refused (key held) at once.

    Returns the workflow's status when refusals moved it, else None.
    """
    ready = workflows.ready_steps(conn, workflow_id)
    if not ready:
        return None
    enqueued = workflows.enqueue_steps(conn, workflow_id, ready)
    if not enqueued.refused:
        return None
    done = Advanced()
    _settle(conn, workflow_id, name, WorkflowStatus.RUNNING, enqueued.refused, done)
    return done.status
