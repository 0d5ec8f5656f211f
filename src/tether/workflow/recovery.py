"""Workflow recovery: steps whose task ended while the step did not, and workflows left open.

The reaper runs ``reconcile`` after its task rules in every tick, so a step
whose task it has just failed is settled (and its dependents enqueued) in the
same tick; ``recover_stuck_workflows`` runs the same pass on demand, and
``reconcile_and_report`` runs it for ``tether recover``, saying which workflows
it touched (or, in a dry run, would touch).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from tether.app_view import AppView
from tether.broker import workflows
from tether.broker.types import Conn
from tether.broker.workflows import WorkflowState
from tether.result import WorkflowStatus
from tether.workflow import engine

log = logging.getLogger("tether.workflow.recovery")

BATCH = 500


@dataclass
class WorkflowsRecovered:
    steps: int = 0  # steps settled from their ended task
    finished: list[str] = field(default_factory=list)  # workflows finished by the safety net

    @property
    def acted(self) -> bool:
        return bool(self.steps or self.finished)


def find_stuck(conn: Conn, limit: int = BATCH) -> dict[uuid.UUID, list[uuid.UUID]]:
    """Steps still ENQUEUED whose task has ended, by workflow."""
    found: dict[uuid.UUID, list[uuid.UUID]] = defaultdict(list)
    for step in workflows.stuck_steps(conn, limit):
        found[step.workflow_id].append(step.task_id)
    return dict(found)


def find_unfinished(conn: Conn, limit: int = BATCH) -> list[uuid.UUID]:
    """Open workflows whose steps have all ended, and CANCELLED ones with step tasks left to cancel."""
    return workflows.unfinished_workflows(conn, limit) + workflows.cancelled_leftovers(conn, limit)


def reconcile(
    conn: Conn, stuck: dict[uuid.UUID, list[uuid.UUID]], unfinished: list[uuid.UUID]
) -> WorkflowsRecovered:
    """Run the normal completion path for stuck steps, then finish what is left open.

    One transaction per workflow (each locks its workflow row first).
    """
    done = WorkflowsRecovered()
    for workflow_id, task_ids in stuck.items():
        advanced = engine.advance(conn, workflow_id, task_ids)
        if advanced.settled:
            done.steps += len(advanced.settled)
            log.warning(
                "workflow %s: settled %d step(s) whose task had ended without advancing the workflow "
                "(the process that ended it died, or the task was ended outside a worker); "
                "workflow now %s, %d dependent step(s) enqueued",
                workflow_id,
                len(advanced.settled),
                advanced.status,
                advanced.enqueued,
            )
    for workflow_id in unfinished:
        cancelled = engine.cancel_leftovers(conn, workflow_id)
        if cancelled:
            done.steps += cancelled
            log.warning(
                "workflow %s is cancelled: cancelled %d step task(s) that were to run again (a retry "
                "scheduled after the cancel)",
                workflow_id,
                cancelled,
            )
            continue
        status = engine.finalize(conn, workflow_id)
        if status in (WorkflowStatus.COMPLETED, WorkflowStatus.FAILED):
            done.finished.append(str(workflow_id))
            log.warning("workflow %s: all steps had ended; finished it %s", workflow_id, status)
    return done


def reconcile_all(conn: Conn, limit: int = BATCH) -> WorkflowsRecovered:
    """Reconcile as the reaper does each tick, batch after batch, until nothing is left."""
    total = WorkflowsRecovered()
    while True:
        stuck = find_stuck(conn, limit)
        unfinished = find_unfinished(conn, limit)
        done = reconcile(conn, stuck, unfinished)
        total.steps += done.steps
        total.finished += done.finished
        if not done.acted or sum(map(len, stuck.values())) + len(unfinished) < limit:
            return total


@dataclass
class ReconcileReport:
    """What ``reconcile_and_report`` did (or, in a dry run, would do), workflow by workflow."""

    dry_run: bool
    steps: int  # settled (or, in a dry run, found stuck)
    finished: list[str]  # workflows that ended (dry run: whose steps have all ended already)
    workflows: list[dict[str, Any]]  # id, name, stuck_steps, status (afterwards) of each one touched


def reconcile_and_report(conn: Conn, *, dry_run: bool, limit: int = BATCH) -> ReconcileReport:
    """reconcile_all, after reading up to ``limit`` stuck steps and unfinished workflows to
    report on (with their status before and after). A dry run only finds them."""
    stuck = find_stuck(conn, limit)
    unfinished = find_unfinished(conn, limit)
    ids = list(dict.fromkeys([*stuck, *unfinished]))
    before = _statuses(conn, ids)
    if dry_run:
        steps, after = sum(map(len, stuck.values())), before
        # (find_unfinished may also name CANCELLED ones with step tasks left to cancel.)
        finished = [str(w) for w in unfinished if w in before and _is_open(before[w])]
    else:
        done = reconcile_all(conn)
        steps, after = done.steps, _statuses(conn, ids)
        ended = {w for w, row in after.items() if not _is_open(row) and w in before and _is_open(before[w])}
        finished = list(dict.fromkeys([*(str(w) for w in ids if w in ended), *done.finished]))
    touched = [
        {
            "id": str(w),
            "name": after[w].name,
            "stuck_steps": len(stuck.get(w, ())),
            "status": after[w].status,
        }
        for w in ids
        if w in after
    ]
    return ReconcileReport(dry_run, steps, finished, touched)


def _is_open(state: WorkflowState) -> bool:
    return not state.status.is_terminal


def _statuses(conn: Conn, ids: list[uuid.UUID]) -> dict[uuid.UUID, WorkflowState]:
    if not ids:
        return {}
    return {s.id: s for s in workflows.workflow_statuses(conn, ids)}


def recover_stuck_workflows(app: AppView, limit: int = BATCH) -> WorkflowsRecovered:
    """Settle steps whose task ended without advancing its workflow, and finish what is done.

    The reaper does this every tick; call it by hand after an outage, or from a
    maintenance job when no worker runs. Safe to run at any time, anywhere:
    every step is settled at most once.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    return app.broker.run(lambda conn: reconcile_all(conn, limit))


async def recover_stuck_workflows_async(app: AppView, limit: int = BATCH) -> WorkflowsRecovered:
    return await asyncio.to_thread(recover_stuck_workflows, app, limit)
