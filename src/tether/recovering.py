"""Manual recovery as an operator runs it (docs/workers.md#manual-recovery): every task rule of
the reaper once (broker.manual_recovery.recover, the function behind the seed API too), then
its workflow reconciliation, or a dry run of both.

``tether recover`` and the dashboard's recover action call ``recover`` here and answer with
the same report (``RecoveryReport.as_json`` is the document of ``tether recover --json``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tether.broker import PostgresBroker, manual_recovery
from tether.broker.manual_recovery import Rules
from tether.broker.recovery import CrashedTask, Recovered, RequeuedTask
from tether.config import RecoveryConfig
from tether.result import TaskStatus
from tether.workflow.recovery import ReconcileReport, reconcile_and_report


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What a manual recovery did (or, in a dry run, would do): its tasks and its workflows."""

    dry_run: bool
    tasks: Recovered
    workflows: ReconcileReport

    def actions(self) -> list[tuple[str, RequeuedTask | CrashedTask]]:
        """Each stale task with what became of it, in words: requeued, then retried, then ended."""
        requeued: list[tuple[str, RequeuedTask | CrashedTask]] = [
            ("requeued (CLAIMED -> PENDING)", r) for r in self.tasks.requeued
        ]
        retried = [("retry scheduled (WORKER_CRASHED)", r) for r in self.tasks.retried]
        ended = [
            (
                "CANCELLED (cancel requested)"
                if r.settled is TaskStatus.CANCELLED
                else "FAILED (WORKER_CRASHED)",
                r,
            )
            for r in self.tasks.failed
        ]
        return requeued + retried + ended

    @property
    def changed(self) -> bool:
        """Whether it changed anything (never, in a dry run)."""
        flows = self.workflows
        return not self.dry_run and (self.tasks.acted or bool(flows.steps or flows.finished))

    def tasks_summary(self) -> str:
        """What it did to tasks and workers, in one sentence."""
        verb = "would be" if self.dry_run else "were"
        return (
            f"{len(self.actions())} stale task(s) {verb} recovered, {self.tasks.expired} expired task(s) "
            f"{verb} marked EXPIRED, {len(self.tasks.deactivated)} silent worker(s) {verb} marked inactive"
        )

    def workflows_summary(self) -> str:
        """What it did to workflows, in one sentence."""
        flows = self.workflows
        if self.dry_run:
            with_stuck = sum(1 for w in flows.workflows if w["stuck_steps"])
            line = f"{flows.steps} stuck workflow step(s) in {with_stuck} workflow(s) would be settled"
            if flows.finished:
                line += f", {len(flows.finished)} workflow(s) whose steps have all ended would be finished"
            return line
        return (
            f"{flows.steps} stuck workflow step(s) were settled, "
            f"{len(flows.finished)} workflow(s) were finished"
        )

    def as_json(self) -> dict[str, Any]:
        """The report as ``tether recover --json`` prints it (values JSON writes as text:
        UUIDs, datetimes)."""
        return {
            "dry_run": self.dry_run,
            "expired": self.tasks.expired,
            "tasks": [{"action": a, **dataclasses.asdict(r)} for a, r in self.actions()],
            "workers_deactivated": self.tasks.deactivated,
            "workflows": {
                "steps_settled": self.workflows.steps,
                "finished": self.workflows.finished,
                "workflows": self.workflows.workflows,
            },
        }


def recover(
    broker: PostgresBroker,
    config: RecoveryConfig,
    *,
    claimed_threshold_ms: int | None = None,
    running_threshold_ms: int | None = None,
    dry_run: bool = False,
) -> RecoveryReport:
    """Every task rule of the reaper at ``config``'s thresholds (or the ones given), then the
    workflow reconciliation, which also settles the steps of the tasks just failed. A dry run
    changes nothing and reports what would be done."""
    rules = Rules.every_rule(
        config, claimed_threshold_ms=claimed_threshold_ms, running_threshold_ms=running_threshold_ms
    )
    with broker.connection() as conn:
        done = manual_recovery.recover(conn, rules, dry_run=dry_run)
        flows = reconcile_and_report(conn, dry_run=dry_run)
    return RecoveryReport(dry_run, done, flows)
