"""``tether tasks`` (recent tasks, filtered) and ``tether task ID`` (one task in full)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import click
from rich.table import Table

from tether.broker import browse
from tether.broker.rows import TaskStepInfo
from tether.broker.tasks import get_heartbeats, get_task
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
@click.option(
    "--before",
    default=None,
    callback=lambda ctx, param, value: _task_id(ctx, param, value),
    help="Only tasks older than this task id (where the previous list stopped).",
)
def tasks(
    database_url: str | None,
    as_json: bool,
    status_: str | None,
    queue: str | None,
    name: str | None,
    limit: int,
    before: uuid.UUID | None,
) -> None:
    """Recent tasks, newest first, filtered by status, queue or name.

    One call reads at most 20,000 tasks (2,000 of a FAILED, CANCELLED, EXPIRED, CLAIMED or
    RUNNING list): when a filter matches few of them, it says how far back it searched and
    the --before that goes on from there.
    """
    where = browse.TaskFilter(
        statuses=(TaskStatus(status_.upper()),) if status_ else (), queue=queue, name=name
    )
    page = common.open_broker(database_url).run(
        lambda conn: browse.browse_tasks(conn, where, before=before, limit=limit)
    )
    rows = page.tasks
    # A PENDING task after a sleep or a wait says so in its status (docs/durable-steps.md).
    from tether.broker.suspensions import suspension_states

    pending = [str(r.id) for r in rows if r.status == "PENDING"]
    states = common.open_broker(database_url).run(lambda c: suspension_states(c, pending)) if pending else {}
    if as_json:
        common.emit_json(rows)
    else:
        common.console.print(
            common.table(
                "Tasks",
                ["id", "name", "queue", "status", "attempt", "error", "sent", "finished"],
                [
                    [
                        r.id,
                        r.name,
                        r.queue,
                        f"{r.status}: {states[str(r.id)].short()}" if str(r.id) in states else r.status,
                        r.attempt,
                        r.error_code,
                        common.ts(r.sent_at),
                        common.ts(r.finished_at),
                    ]
                    for r in rows
                ],
            )
        )
    if page.searched_to is not None:
        # On stderr: the JSON on stdout stays the list it always was.
        click.echo(
            f"searched back to tasks made at {common.ts(page.searched_to)} (one call reads at most "
            f"{page.scan:,} tasks); older ones are not searched yet: add --before {page.next}",
            err=True,
        )


def _task_id(ctx: click.Context, param: click.Parameter, value: str | None) -> uuid.UUID | None:
    if value is None:
        return None
    try:
        return parse_task_id(value, what="--before")
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


@click.command()
@click.argument("task_id")
@common.db_option
@common.json_option
def task(task_id: str, database_url: str | None, as_json: bool) -> None:
    """One task with its attempts, its recorded steps and its latest heartbeats."""
    broker = common.open_broker(database_url)
    tid = parse_task_id(task_id)
    info = broker.run(lambda conn: get_task(conn, tid))
    if info is None:
        raise click.ClickException(f"no task with id {tid}")
    attempts = info.attempts
    beats = broker.run(lambda conn: get_heartbeats(conn, tid, limit=10))
    # The row as stored: its result as the JSON it is kept as, and its current sleep or wait
    # (info.suspension; docs/durable-steps.md#durable-sleep) as "suspension".
    stored = info.as_stored()
    state = info.suspension
    if as_json:
        common.emit_json({**stored, "attempts": attempts, "steps": info.steps, "heartbeats": beats})
        return
    fields = Table(title=f"Task {tid}", title_justify="left", show_header=False)
    for key in TASK_FIELDS:
        value = stored[key]
        fields.add_row(key, "" if value is None else str(value))
    common.console.print(fields)
    if state is not None:  # a sleep or a wait: what it waits for (docs/durable-steps.md)
        common.console.print(f"Suspended: {state.describe()}", highlight=False)
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
                    "SUSPENDED" if a.suspended else a.outcome,
                    "yes" if a.will_retry else "",
                    a.error_code,
                ]
                for a in attempts
            ],
        )
    )
    if info.steps:  # a task that checkpoints nothing keeps the page it always had
        common.console.print(steps_table(info.steps))
    common.console.print(
        common.table(
            "Latest heartbeats",
            ["role", "sender", "host", "pid", "sent"],
            [[b.role, b.sender_id, b.hostname, b.pid, common.ts(b.sent_at)] for b in beats],
        )
    )


def steps_table(steps: Sequence[TaskStepInfo]) -> Table:
    """The task's checkpointed steps (docs/durable-steps.md#seeing-the-steps): which call of a
    name each is (#0 the first), the attempt that ran it, when it was recorded, and the bytes
    of its result's JSON."""
    return common.table(
        "Steps",
        ["step", "#", "attempt", "recorded", "bytes"],
        [[s.name, s.occurrence, s.attempt, common.ts(s.written_at), f"{s.size:,}"] for s in steps],
    )
