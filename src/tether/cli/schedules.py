"""``tether schedules``: list periodic tasks; ``tether schedules pause|resume NAME``."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import click

from tether.broker.answers import CHANGED
from tether.broker.schedules import ScheduleInfo, list_schedules
from tether.cli import common
from tether.periodic import set_paused


@click.group(invoke_without_command=True)
@common.db_option
@common.json_option
@click.pass_context
def schedules(ctx: click.Context, database_url: str | None, as_json: bool) -> None:
    """Each schedule: task, expression, time zone, next slot, last slot and its task's status."""
    if ctx.invoked_subcommand is not None:
        return
    rows = common.open_broker(database_url).run(list_schedules)
    if as_json:
        common.emit_json(rows)
        return
    common.console.print(
        common.table(
            "Schedules",
            [
                "name",
                "task",
                "cron",
                "time zone",
                "next slot",
                "last slot",
                "last task",
                "state",
                "sent",
                "skipped",
            ],
            [
                [
                    s.name,
                    s.task_name,
                    s.cron,
                    s.timezone,
                    _local(s, s.next_slot),
                    _local(s, s.last_slot),
                    s.last_task_status or "",
                    _state(s),
                    s.slots_sent,
                    s.slots_skipped,
                ]
                for s in rows
            ],
        )
    )


def _state(s: ScheduleInfo) -> str:
    if s.removed_at is not None:
        return f"removed {common.ts(s.removed_at)}"
    return "paused" if s.paused else "active"


def _local(s: ScheduleInfo, slot: datetime | None) -> str:
    """A slot in the schedule's own time zone, as its expression reads it."""
    if slot is None:
        return ""
    return slot.astimezone(ZoneInfo(s.timezone)).strftime("%Y-%m-%d %H:%M:%S %Z")


@schedules.command()
@click.argument("name")
@common.db_option
def pause(name: str, database_url: str | None) -> None:
    """Stop sending NAME's slots until resumed."""
    changed = common.open_broker(database_url).run_request(
        lambda conn: set_paused(conn, name, paused=True), CHANGED
    )
    click.echo(f"schedule {name} paused" if changed else f"schedule {name} was already paused")


@schedules.command()
@click.argument("name")
@common.db_option
def resume(name: str, database_url: str | None) -> None:
    """Send NAME's slots again, from the first slot after now (missed ones are not sent)."""
    changed = common.open_broker(database_url).run_request(
        lambda conn: set_paused(conn, name, paused=False), CHANGED
    )
    click.echo(f"schedule {name} resumed" if changed else f"schedule {name} was not paused")
