"""Reopening a workflow for a step retried by hand (docs/workflows.md#retrying-a-step).

A step that ended FAILED or CANCELLED goes back to ENQUEUED (its task is retried in the
same transaction), the steps that were SKIPPED only because of it (directly, or through
other skipped steps) wait again, their dependents count their dependencies again, and
the workflow's counters take them all back; a FAILED workflow is RUNNING again.

What cannot be taken back is refused: a dependent that *started* (has a task) after the
step ended has already used the step's outcome (``run_anyway=True``, or ``join="any"``
through another dependency). A dependent that started *before* the step ended (a
``join="any"`` step started by another dependency) did not wait for it, and stays as it is.

``plan`` only reads; ``apply`` writes. Both run in the caller's transaction, which holds
the workflow's row lock (workflows.sql's locking rule), so nothing moves in between.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tether.broker import retries
from tether.broker.retries import StepChange, StepToReopen
from tether.broker.types import Conn
from tether.result import StepStatus, WorkflowStatus
from tether.workflow import engine

_NOT_OK = frozenset({StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.CANCELLED})


@dataclass
class Plan:
    """What reopening a workflow for a retried step writes."""

    changes: dict[str, StepChange] = field(default_factory=dict)  # by task id
    done: int = 0  # steps no longer finished
    failed: int = 0  # of which had counted as failed (the retried step)
    unskipped: list[str] = field(default_factory=list)  # node names of skipped steps waiting again

    @property
    def settled(self) -> bool:
        """False: the step had not settled yet (its task ended, the workflow had not moved)."""
        return bool(self.changes)


@dataclass(frozen=True)
class Refusal:
    reason: str


def plan(conn: Conn, workflow_id: uuid.UUID, step: StepToReopen) -> Plan | Refusal:
    """How to reopen the workflow for ``step``, or why it cannot be done."""
    if step.status is StepStatus.ENQUEUED:
        # Its task ended but the workflow has not taken the outcome yet (the advance that
        # follows the outcome, or the reaper's reconciliation, will find the task PENDING
        # again and leave the step alone): only the task is retried.
        return Plan()
    if step.status not in (StepStatus.FAILED, StepStatus.CANCELLED):
        return Refusal(f"its step {step.node_name!r} is {step.status}")
    found = Plan(done=1, failed=1)
    found.changes[str(step.task_id)] = _counted(
        step, StepStatus.ENQUEUED, step.waiting_on, step.deps_ok, step.deps_failed, reopen=True
    )
    # statuses as planned, over the stored ones
    now: dict[int, StepStatus] = {step.node: StepStatus.ENQUEUED}
    stored: dict[int, StepStatus] = {}
    frontier = [step]
    while frontier:
        ids = {str(d) for r in frontier for d in r.dependents}
        if not ids:
            break
        dependents = {str(s.task_id): s for s in retries.steps(conn, workflow_id, sorted(ids))}
        nodes = {n for s in dependents.values() for n in s.depends_on if n not in now and n not in stored}
        if nodes:
            stored.update(retries.step_statuses(conn, workflow_id, sorted(nodes)))
        after: list[StepToReopen] = []
        for reopened in frontier:
            for dep_id in map(str, reopened.dependents):
                dep = dependents[dep_id]
                if dep.enqueued_at is not None:
                    # It has a task: it started before this step ended (it did not wait for
                    # it), or after, having used its outcome.
                    if reopened.finished_at is not None and dep.enqueued_at < reopened.finished_at:
                        continue
                    return Refusal(
                        f"step {dep.node_name!r} of its workflow started after step "
                        f"{reopened.node_name!r} ended, with its outcome; that run cannot be taken "
                        "back (start a new workflow instead)"
                    )
                if dep.status not in (StepStatus.WAITING, StepStatus.READY, StepStatus.SKIPPED):
                    return Refusal(f"step {dep.node_name!r} of its workflow is {dep.status}")
                waiting, ok, bad = _count(dep, now, stored)
                status = engine._next_status(dep.join_mode, dep.run_anyway, waiting, ok, bad)
                change = found.changes.get(dep_id)
                if dep.status is StepStatus.SKIPPED and change is None:
                    if status is StepStatus.SKIPPED:
                        continue  # another of its dependencies did not complete either
                    found.changes[dep_id] = _counted(dep, status, waiting, ok, bad, reopen=True)
                    found.done += 1
                    found.unskipped.append(dep.node_name)
                    now[dep.node] = status
                    after.append(dep)
                else:
                    # A waiting (or held READY) step, or one reopened already: counted again.
                    # One failure fewer can never skip it.
                    if status is StepStatus.SKIPPED:
                        return Refusal(f"step {dep.node_name!r} of its workflow has inconsistent counters")
                    found.changes[dep_id] = _counted(
                        dep, status, waiting, ok, bad, reopen=dep.status is StepStatus.SKIPPED
                    )
                    now[dep.node] = status
        frontier = after
    return found


def apply(conn: Conn, workflow_id: uuid.UUID, found: Plan) -> WorkflowStatus | None:
    """Write the plan; the workflow's status afterwards (None: nothing to write)."""
    if not found.settled:
        return None
    written = retries.reopen_steps(conn, workflow_id, found.changes)
    if written != len(found.changes):
        # Impossible under the workflow's lock; raising rolls the whole retry back.
        raise RuntimeError(
            f"workflow {workflow_id}: {len(found.changes) - written} step(s) changed while locked"
        )
    return retries.reopen_workflow(conn, workflow_id, done=found.done, failed=found.failed)


def _count(
    step: StepToReopen, now: dict[int, StepStatus], stored: dict[int, StepStatus]
) -> tuple[int, int, int]:
    """(waiting_on, deps_ok, deps_failed) from its dependencies' statuses, as planned."""
    waiting = ok = bad = 0
    for node in step.depends_on:
        status = now.get(node) or stored.get(node, StepStatus.WAITING)
        if status is StepStatus.COMPLETED:
            ok += 1
        elif status in _NOT_OK:
            bad += 1
        else:
            waiting += 1
    assert waiting + ok + bad == len(step.depends_on)
    return waiting, ok, bad


def _counted(
    step: StepToReopen, status: StepStatus, waiting: int, ok: int, bad: int, *, reopen: bool
) -> StepChange:
    return StepChange(
        was=step.status, status=status, waiting_on=waiting, deps_ok=ok, deps_failed=bad, reopen=reopen
    )
