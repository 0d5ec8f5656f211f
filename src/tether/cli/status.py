"""``tether status``: counts per queue and status, workers, and RUNNING tasks gone silent."""

from __future__ import annotations

import click

from tether.broker.status import status_snapshot
from tether.cli import common
from tether.result import TaskStatus


@click.command()
@common.db_option
@common.json_option
@common.app_option
@common.exact_option
def status(database_url: str | None, as_json: bool, app_path: str | None, exact: bool) -> None:
    """Counts per queue and status, workers with heartbeat age, stale tasks."""
    rc = common.load_config(database_url, app_path).recovery
    snapshot = status_snapshot(
        common.open_broker(database_url, app_path), rc.running_stale_threshold_ms, exact=exact
    )
    counts, workers, stale = snapshot.counts, snapshot.workers, snapshot.stale_tasks
    if as_json:
        common.emit_json({"counts": counts, "workers": workers, "stale_tasks": stale})
        return
    statuses = [s.value for s in TaskStatus]
    per_queue: dict[str, dict[str, str]] = {}
    for count in counts:
        per_queue.setdefault(count.queue, {})[count.status] = common.count_text(count.n, count.estimated)
    common.console.print(
        common.table(
            "Tasks",
            ["queue", *statuses],
            [[q, *(c.get(s, "0") for s in statuses)] for q, c in sorted(per_queue.items())],
        )
    )
    if any(count.estimated for count in counts):
        common.console.print(common.ESTIMATE_NOTE, markup=False, highlight=False)
    common.console.print(common.workers_table(workers))
    common.console.print(
        common.table(
            f"Stale tasks (RUNNING, no runner heartbeat for over {snapshot.running_stale_threshold_s:.0f}s)",
            ["task", "name", "worker", "host", "worker status", "silent"],
            [
                [r.id, r.name, r.worker_id, r.worker_hostname, r.worker_status, f"{r.silent_s:.0f}s"]
                for r in stale
            ],
        )
    )
