"""``tether retry ID [ID...]`` and ``tether retry --status ... [filters]``: run FAILED, CANCELLED
or EXPIRED tasks again (tether.retrying does the work; docs/cli.md#tether-retry)."""

from __future__ import annotations

import dataclasses
import re
import sys
from datetime import datetime, timedelta
from typing import Any

import click
from rich.console import Console

from tether.broker import PostgresBroker
from tether.broker.retries import RETRYABLE
from tether.cli import common
from tether.errors import InvalidOptionError, TaskNotFoundError
from tether.ids import parse_task_id
from tether.result import TaskStatus
from tether.retrying import BulkRetry, RetryFilter, retry_task, retry_tasks

_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$", re.IGNORECASE)
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def _ago_or_time(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> datetime | timedelta | None:
    """``30m``, ``1h``, ``2d`` (that long ago: s, m, h, d, w) or an ISO time with its offset.

    A callback rather than a click.ParamType subclass: ParamType is generic only from click 8.4.
    """
    if value is None:
        return None
    found = _AGO.match(value)
    if found:
        ago = timedelta(**{_UNITS[found.group(2).lower()]: float(found.group(1))})
        if ago <= timedelta(0):
            raise click.BadParameter(f"{value!r} is no time ago: give more than 0", ctx, param)
        return ago
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither a duration (30m, 1h, 2d, 1w) nor an ISO time such as "
            "2026-11-21T13:00:00+00:00",
            ctx,
            param,
        ) from None
    if when.tzinfo is None:
        raise click.BadParameter(f"{value!r} has no UTC offset: add one, e.g. {value}+00:00", ctx, param)
    return when


def _statuses(given: tuple[str, ...]) -> tuple[str, ...]:
    found: list[str] = []
    for item in given:
        for part in item.split(","):
            status = part.strip().upper()
            if status not in RETRYABLE:
                raise click.BadParameter(
                    f"{part.strip()!r} cannot be retried: give FAILED, CANCELLED or EXPIRED",
                    param_hint="'--status'",
                )
            found.append(status)
    return tuple(dict.fromkeys(found))


@click.command()
@click.argument("task_ids", nargs=-1)
@click.option(
    "--status",
    "statuses",
    multiple=True,
    help="FAILED, CANCELLED or EXPIRED; repeat it or separate with commas (default: FAILED).",
)
@click.option("--queue", default=None, callback=common.queue_checked, help="Only tasks of this queue.")
@click.option("--name", default=None, callback=common.task_name_checked, help="Only tasks of this task name.")
@click.option("--error-code", default=None, help="Only tasks that ended with this error code.")
@click.option(
    "--since",
    metavar="AGO|TIME",
    callback=_ago_or_time,
    help="Ended at or after: 30m, 1h, 2d, 1w ago, or an ISO time with offset.",
)
@click.option(
    "--until",
    metavar="AGO|TIME",
    callback=_ago_or_time,
    help="Ended before: 30m, 1h, 2d, 1w ago, or an ISO time with offset.",
)
@click.option("--dry-run", is_flag=True, help="Count what matches and show a sample; change nothing.")
@click.option(
    "--from-scratch",
    is_flag=True,
    help="Delete the tasks' recorded steps with the retry: every step runs again "
    "(default: the new attempt resumes after the last recorded step).",
)
@click.option("--yes", "-y", is_flag=True, help="Do not ask before a bulk retry (needed off a terminal).")
@click.option("--sample", type=click.IntRange(0, 1000), default=10, show_default=True, help="Rows shown.")
@click.option(
    "--by",
    default=None,
    callback=common.by_checked,
    help="Who asks, for the log (default: cli:<user>@<host>).",
)
@common.db_option
@common.json_option
def retry(
    task_ids: tuple[str, ...],
    statuses: tuple[str, ...],
    queue: str | None,
    name: str | None,
    error_code: str | None,
    since: datetime | timedelta | None,
    until: datetime | timedelta | None,
    dry_run: bool,
    from_scratch: bool,
    yes: bool,
    sample: int,
    by: str | None,
    database_url: str | None,
    as_json: bool,
) -> None:
    """Run FAILED, CANCELLED or EXPIRED tasks again: by id, or in bulk by filter.

    Each becomes PENDING as a new attempt, with its retry policy's whole budget again;
    its earlier attempts stay in its history. It keeps its recorded steps, and the new
    attempt resumes after the last one; --from-scratch deletes them first. A bulk retry
    asks first on a terminal; elsewhere it needs --yes.
    """
    filtered = bool(statuses) or any(v is not None for v in (queue, name, error_code, since, until))
    if task_ids and filtered:
        raise click.UsageError("give task ids or filters (--status, --queue, ...), not both")
    if not task_ids and not filtered:
        raise click.UsageError(
            "give task ids, or filters for a bulk retry (--status, --queue, --name, --error-code, "
            "--since, --until)"
        )
    if task_ids and (dry_run or yes):
        raise click.UsageError("--dry-run and --yes are for a bulk retry (by filters)")
    who = by or common.who_asks()
    if task_ids:
        ids = [parse_task_id(t) for t in task_ids]  # every id checked before any is retried
        _by_ids(common.open_broker(database_url), ids, who, as_json, from_scratch)
        return
    wanted = RetryFilter(
        statuses=_statuses(statuses) if statuses else (TaskStatus.FAILED,),
        queue=queue,
        name=name,
        error_code=error_code,
        since=since,
        until=until,
    )
    broker = common.open_broker(database_url)
    try:
        if dry_run:
            _show_bulk(retry_tasks(broker, wanted, by=who, dry_run=True, sample_size=sample), as_json)
            return
        if not yes:
            _confirm(broker, wanted, who, sample, from_scratch)
        bulk = retry_tasks(broker, wanted, by=who, sample_size=sample, from_scratch=from_scratch)
        _show_bulk(bulk, as_json)
    except InvalidOptionError as exc:
        raise click.UsageError(str(exc)) from None


def _by_ids(broker: PostgresBroker, ids: list[Any], who: str, as_json: bool, from_scratch: bool) -> None:
    answers: list[dict[str, Any]] = []
    for task_id in ids:
        try:
            answers.append(dataclasses.asdict(retry_task(broker, task_id, by=who, from_scratch=from_scratch)))
        except TaskNotFoundError as exc:
            answers.append(
                {"task_id": task_id, "retried": False, "status": None, "reason": f"not retried: {exc}"}
            )
    retried = sum(1 for a in answers if a["retried"])
    if as_json:
        common.emit_json({"retried": retried, "not_retried": len(answers) - retried, "tasks": answers})
    else:
        for a in answers:
            click.echo(f"task {a['task_id']}: {a['reason']}")
        click.echo(f"{retried} of {len(answers)} task(s) retried")
    if retried < len(answers):
        sys.exit(1)


def _confirm(broker: PostgresBroker, wanted: RetryFilter, who: str, sample: int, from_scratch: bool) -> None:
    if not sys.stdin.isatty():
        raise click.UsageError(
            "a bulk retry off a terminal needs --yes (see what it would take with --dry-run)"
        )
    preview = retry_tasks(broker, wanted, by=who, dry_run=True, sample_size=sample)
    _show_bulk(preview, as_json=False, err=True)
    if preview.matched == 0:
        return  # nothing to ask about: the retry finds nothing either, and says so
    how = " from scratch (their recorded steps deleted)" if from_scratch else ""
    click.confirm(f"Retry these {preview.matched} task(s){how}?", abort=True, err=True)


def _show_bulk(done: BulkRetry, as_json: bool, *, err: bool = False) -> None:
    if as_json:
        common.emit_json(dataclasses.asdict(done))
        return
    console = Console(stderr=True) if err else common.console
    if done.dry_run:
        click.echo(f"dry run: {done.matched} task(s) match; nothing was changed", err=err)
        if done.sample:
            console.print(
                common.table(
                    f"First {len(done.sample)} of {done.matched}",
                    ["id", "name", "queue", "status", "error", "ended"],
                    [
                        [s.id, s.name, s.queue, s.status, s.error_code, common.ts(s.finished_at)]
                        for s in done.sample
                    ],
                )
            )
        return
    click.echo(f"{done.matched} task(s) matched, {done.retried} retried, {done.skipped} skipped")
    if done.skips:
        console.print(
            common.table(
                f"Skipped (first {len(done.skips)} of {done.skipped})",
                ["id", "reason"],
                [[s.task_id, s.reason] for s in done.skips],
            )
        )
