"""``tether health``: is the queue healthy? Each check against its threshold, exit code 0 ok,
1 warning, 2 critical (docs/health.md).

The work is done by tether.health.check_health (the dashboard and metrics call it too); this
module reads the thresholds from the options and prints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from rich.text import Text

from tether.cli import common
from tether.errors import DatabaseUnreachableError
from tether.health import (
    HealthCheck,
    HealthReport,
    HealthStatus,
    HealthThresholds,
    ThresholdError,
    check_health,
    human_size,
    worst,
)

COLOURS = {HealthStatus.OK: "green", HealthStatus.WARNING: "yellow", HealthStatus.CRITICAL: "red"}

_defaults = HealthThresholds()
# Each threshold's option: --<field name with dashes>; its type and its help.
_SECONDS = click.FloatRange(min=0, min_open=True)
_COUNT = click.IntRange(min=1)
THRESHOLD_OPTIONS: dict[str, tuple[Any, str]] = {  # (click type, help)
    "transaction_warning_s": (_SECONDS, "oldest open transaction, seconds"),
    "transaction_critical_s": (_SECONDS, "oldest open transaction, seconds"),
    "horizon_warning_xids": (_COUNT, "MVCC horizon's age, in transactions"),
    "horizon_critical_xids": (_COUNT, "MVCC horizon's age, in transactions"),
    "dead_tuples_warning": (_COUNT, "dead rows in one tether table"),
    "dead_tuples_critical": (_COUNT, "dead rows in one tether table"),
    "table_size_warning_mb": (_SECONDS, "one tether table with its indexes, MB [default: none]"),
    "table_size_critical_mb": (_SECONDS, "one tether table with its indexes, MB [default: none]"),
    "heartbeat_warning_s": (_SECONDS, "an active worker's heartbeat age [default: 2 heartbeat intervals]"),
    "heartbeat_critical_s": (
        _SECONDS,
        "an active worker's heartbeat age [default: running_stale_threshold_ms]",
    ),
    "lag_warning_s": (_SECONDS, "how long a queue's oldest due PENDING task has been due, seconds"),
    "lag_critical_s": (_SECONDS, "how long a queue's oldest due PENDING task has been due, seconds"),
}


def option_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _threshold_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for name, (kind, what) in reversed(THRESHOLD_OPTIONS.items()):
        level = "warning" if "_warning" in name else "critical"
        default = getattr(_defaults, name)
        shown = "" if default is None or name.startswith("heartbeat") else f" [default: {default:g}]"
        command = click.option(
            option_name(name), name, type=kind, default=None, help=f"{level.capitalize()} at: {what}{shown}."
        )(command)
    return command


@click.command()
@common.db_option
@common.json_option
@common.app_option
@_threshold_options
def health(database_url: str | None, as_json: bool, app_path: str | None, **given: Any) -> None:
    """Check the queue's health: long transactions and the MVCC horizon, dead rows and sizes of
    tether's tables, workers' heartbeats and listeners, queue lag. Exit code 0 ok, 1 warning,
    2 critical."""
    recovery = common.load_config(database_url, app_path).recovery
    try:
        thresholds = HealthThresholds.for_recovery(recovery, **given)
    except ThresholdError as exc:
        reason = exc.reason
        for name in THRESHOLD_OPTIONS:
            reason = reason.replace(name, option_name(name))
        raise click.BadParameter(reason, param_hint=f"'{option_name(exc.field_name)}'") from None
    try:
        report = check_health(common.open_broker(database_url, app_path), thresholds)
    except DatabaseUnreachableError as exc:
        # The check could not run: as bad as it gets for a monitor.
        click.echo(f"error: {exc}", err=True)
        raise click.exceptions.Exit(HealthStatus.CRITICAL.exit_code) from None
    if as_json:
        common.emit_json(report.as_json())
    else:
        _print(report)
    raise click.exceptions.Exit(report.exit_code)


def _print(report: HealthReport) -> None:
    others = [c for c in report.checks if c.check not in ("dead_tuples", "table_size")]
    common.console.print(
        common.table(
            "Checks",
            ["status", "check", "subject", "value", "warning / critical", "detail"],
            [[_status(c.status), c.check, c.subject, _value(c), _limits(c), c.detail] for c in others],
        )
    )
    per_table: dict[str, list[HealthCheck]] = {}
    for c in report.checks:
        if c.check in ("dead_tuples", "table_size"):
            per_table.setdefault(c.subject, []).append(c)
    t = report.thresholds
    common.console.print(
        common.table(
            f"Tables (dead rows: warning at {t.dead_tuples_warning}, critical at {t.dead_tuples_critical})",
            ["status", "table", "live rows", "dead rows", "dead", "last vacuum", "table", "indexes"],
            [
                [
                    _status(worst([c.status for c in per_table.get(s.table_name, [])])),
                    s.table_name,
                    s.live_rows,
                    s.dead_rows,
                    f"{s.dead_fraction:.0%}",
                    common.ts(s.last_vacuum_at) or "never",
                    human_size(s.table_bytes),
                    human_size(s.index_bytes),
                ]
                for s in report.tables
            ],
        )
    )
    problems = report.problems()
    for c in problems:
        line = _status(c.status)
        line.append(f" {c.check} {c.subject}: {_value(c)} (warning at {_number(c.warning)}, ", style="")
        line.append(f"critical at {_number(c.critical)}): {c.detail}", style="")
        common.console.print(line)
    summary = Text(f"health: {report.status.upper()}", style=COLOURS[report.status])
    if problems:
        summary.append(
            f" ({sum(c.status is HealthStatus.CRITICAL for c in problems)} critical, "
            f"{sum(c.status is HealthStatus.WARNING for c in problems)} warning)"
        )
    common.console.print(summary)


def _status(status: HealthStatus) -> Text:
    return Text(status.upper(), style=COLOURS[status])


def _value(check: HealthCheck) -> str:
    if check.value is None:
        return "-"
    return f"{_number(check.value)} {check.unit}".strip()


def _limits(check: HealthCheck) -> str:
    if check.warning is None and check.critical is None:
        return "-"
    return f"{_number(check.warning)} / {_number(check.critical)}"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


__all__ = ["THRESHOLD_OPTIONS", "health", "option_name"]
