"""``tether tasks`` (recent tasks, filtered) and ``tether task ID`` (one task in full)."""

from __future__ import annotations

import dataclasses

import click
from rich.table import Table

from tether.broker.tasks import get_attempts, get_heartbeats, get_task, list_tasks
from tether.cli import common
from tether.ids import parse_task_id
from tether.result import TaskStatus

# The rows of `tether task ID`, in this order.
TASK_FIELDS = (
    "name",
    "queue",
    "priority",
    "status",
    "attempt",
    "retry_count",
    "max_retries",
    "error_code",
    "claimed_by_worker_id",
    "good_until",
    "unique_key",
    "sent_at",
    "enqueued_at",
    "claimed_at",
    "started_at",
    "completed_at",
    "failed_at",
    "cancelled_at",
    "cancel_requested_at",
    "cancel_requested_by",
    "expired_at",
    "next_retry_at",
    "args",
    "kwargs",
    "result",
    "progress",
    "progress_at",
    "schedule_name",
    "schedule_slot",
)


@click.command()
@common.db_option
@common.json_option
@click.option("--status", "status_", type=click.Choice([s.value for s in TaskStatus], case_sensitive=False))
@click.option("--queue", default=None, callback=common.queue_checked)
@click.option("--name", default=None, callback=common.task_name_checked)
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
def tasks(
    database_url: str | None,
    as_json: bool,
    status_: str | None,
    queue: str | None,
    name: str | None,
    limit: int,
) -> None:
    """Recent tasks, newest first, filtered by status, queue or name."""
    status = status_.upper() if status_ else None
    rows = common.open_broker(database_url).run(
        lambda conn: list_tasks(conn, status=status, queue=queue, name=name, limit=limit)
    )
    if as_json:
        common.emit_json(rows)
        return
    common.console.print(
        common.table(
            "Tasks",
            ["id", "name", "queue", "status", "attempt", "error", "sent", "finished"],
            [
                [
                    r.id,
                    r.name,
                    r.queue,
                    r.status,
                    r.attempt,
                    r.error_code,
                    common.ts(r.sent_at),
                    common.ts(r.finished_at),
                ]
                for r in rows
            ],
        )
    )


@click.command()
@click.argument("task_id")
@common.db_option
@common.json_option
def task(task_id: str, database_url: str | None, as_json: bool) -> None:
    """One task with its attempts."""
    broker = common.open_broker(database_url)
    tid = parse_task_id(task_id)
    row = broker.run(lambda conn: get_task(conn, tid))
    if row is None:
        raise click.ClickException(f"no task with id {tid}")
    attempts = broker.run(lambda conn: get_attempts(conn, tid))
    beats = broker.run(lambda conn: get_heartbeats(conn, tid, limit=10))
    if as_json:
        common.emit_json({**dataclasses.asdict(row), "attempts": attempts, "heartbeats": beats})
        return
    fields = Table(title=f"Task {tid}", title_justify="left", show_header=False)
    for key in TASK_FIELDS:
        value = getattr(row, key)
        fields.add_row(key, "" if value is None else str(value))
    common.console.print(fields)
    common.console.print(
        common.table(
            "Attempts",
            ["#", "worker", "started", "finished", "outcome", "retry", "error"],
            [
                [
                    a.attempt,
                    a.worker_id,
                    common.ts(a.started_at),
                    common.ts(a.finished_at),
                    a.outcome,
                    "yes" if a.will_retry else "",
                    a.error_code,
                ]
                for a in attempts
            ],
        )
    )
    common.console.print(
        common.table(
            "Latest heartbeats",
            ["role", "sender", "host", "pid", "sent"],
            [[b.role, b.sender_id, b.hostname, b.pid, common.ts(b.sent_at)] for b in beats],
        )
    )
