"""``tether recover``: the reaper's task rules, then its workflow reconciliation, run once now.

The work is done by tether.recovering.recover (the dashboard's recover action calls it
too); this module picks the thresholds and prints.
"""

from __future__ import annotations

import click
from rich.table import Table

from tether.cli import common
from tether.recovering import recover as recover_now
from tether.workflow.recovery import ReconcileReport


@click.command()
@common.db_option
@common.json_option
@click.option("--dry-run", is_flag=True, help="Show what would be recovered; change nothing.")
@click.option(
    "--claimed-threshold-ms",
    type=click.IntRange(1),
    default=None,
    help="CLAIMED with no claimer heartbeat this long goes back to PENDING "
    "(default: claimed_stale_threshold_ms).",
)
@click.option(
    "--running-threshold-ms",
    type=click.IntRange(1),
    default=None,
    help="RUNNING with no runner heartbeat this long is retried or failed "
    "(default: running_stale_threshold_ms).",
)
@common.app_option
def recover(
    database_url: str | None,
    as_json: bool,
    dry_run: bool,
    claimed_threshold_ms: int | None,
    running_threshold_ms: int | None,
    app_path: str | None,
) -> None:
    """Recover stale tasks now, by the reaper's rules (manual recovery), then reconcile workflows."""
    rc = common.load_config(database_url, app_path).recovery
    report = recover_now(
        common.open_broker(database_url, app_path),
        rc,
        claimed_threshold_ms=claimed_threshold_ms,
        running_threshold_ms=running_threshold_ms,
        dry_run=dry_run,
    )
    if as_json:
        common.emit_json(report.as_json())
        return
    flows, rows = report.workflows, report.actions()
    common.console.print(
        common.table(
            f"Stale tasks ({'dry run: nothing changed' if dry_run else 'recovered'})",
            ["task", "name", "attempt", "worker", "silent", "action"],
            [[r.id, r.name, r.attempt, r.claimed_by_worker_id, f"{r.silent_s:.1f}s", a] for a, r in rows],
        )
    )
    common.console.print(report.tasks_summary())
    if flows.workflows:
        common.console.print(_report_table(flows))
    common.console.print(report.workflows_summary())


def _report_table(report: ReconcileReport) -> Table:
    title = (
        "Workflows with stuck steps (dry run: nothing changed)" if report.dry_run else "Workflows reconciled"
    )
    return common.table(
        title,
        ["workflow", "name", "stuck steps", "status"],
        [[w["id"], w["name"], w["stuck_steps"], common.status_text(w["status"])] for w in report.workflows],
    )
