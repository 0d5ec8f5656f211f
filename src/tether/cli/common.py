"""What every ``tether`` command shares: its common options, the database it talks to,
and how it prints (rich tables, JSON for scripts, one colour per status).

Commands reach these through the module (``common.console``, ``common.open_broker``)
rather than importing the names, so one replacement here (a wider console, a broker
that tests close) applies to every command.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import logging
import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import click

from tether.broker import PostgresBroker
from tether.broker.workers import WorkerSummary
from tether.config import LOG_FORMATS, AppConfig, LogFormat, PostgresConfig
from tether.errors import InvalidOptionError
from tether.log_setup import setup_logging
from tether.names import MAX_BY_LENGTH, check_by, check_queue_name, check_task_name
from tether.result import StepStatus, TaskStatus, WorkflowStatus

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console: Console


def __getattr__(name: str) -> Any:
    """``console``, made on first use: rich is imported only by a command that prints with it
    (``tether worker`` does not, and starts sooner without it)."""
    if name == "console":
        from rich.console import Console

        made = globals()["console"] = Console()
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


db_option = click.option(
    "--database-url",
    envvar="TETHER_DATABASE_URL",
    default=None,
    help="PostgreSQL URL (default: TETHER_DATABASE_URL, else the embedded server).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
log_format_option = click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS, case_sensitive=False),
    default=None,
    help="How log lines are written: human, or json (one JSON object per line) "
    "[default: TETHER_LOG_FORMAT, else human].",
)
app_option = click.option(
    "--app",
    "app_path",
    default=None,
    help="module:app whose RecoveryConfig (thresholds, intervals) to use; default: TETHER_* and defaults.",
)

STYLES: dict[str, str] = {
    # Workflow, step and task statuses share one palette (a name two enums share, such as
    # RUNNING, is one key: StrEnum members are equal to their text).
    WorkflowStatus.RUNNING: "cyan",
    WorkflowStatus.PAUSED: "yellow",
    WorkflowStatus.COMPLETED: "green",
    WorkflowStatus.FAILED: "red",
    WorkflowStatus.CANCELLED: "magenta",
    TaskStatus.EXPIRED: "magenta",
    StepStatus.SKIPPED: "yellow",
    StepStatus.WAITING: "dim",
    StepStatus.READY: "cyan",
    StepStatus.ENQUEUED: "blue",
    TaskStatus.PENDING: "dim",
    TaskStatus.CLAIMED: "cyan",
}


def load_config(database_url: str | None, app_path: str | None = None) -> AppConfig:
    """The app's config when --app is given (its thresholds and queues), else TETHER_* and defaults."""
    if app_path:
        from tether.worker.app_loader import load_app

        config = load_app(app_path).config
    else:
        config = AppConfig()
    if database_url:
        config = config.model_copy(update={"broker": PostgresConfig(database_url=database_url)})
    return config


def apply_log_format(given: str | None, config: AppConfig) -> None:
    """Log in the format a long-running command was asked for: its own --log-format, else the
    tether group's, else the app's ``config.logging.format`` (TETHER_LOG_FORMAT by default)."""
    group = click.get_current_context().find_root().params.get("log_format")
    chosen = cast(LogFormat, given or group or config.logging.format)
    setup_logging(logging.getLogger().getEffectiveLevel(), chosen)


def open_broker(database_url: str | None, app_path: str | None = None) -> PostgresBroker:
    config = load_config(database_url, app_path)
    broker = PostgresBroker(config.broker, auto_migrate=config.auto_migrate)
    # Close the pool before the interpreter tears threads down (else psycopg_pool warns).
    click.get_current_context().call_on_close(broker.close)
    return broker


def emit_json(data: Any) -> None:
    """``data`` as indented JSON: a broker row as its fields (dataclasses.asdict), the rest by str()."""
    click.echo(json.dumps(data, default=_plain, indent=2))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


#: `--exact` of the commands that count tasks per queue and status (counts.py says why not by default).
exact_option = click.option(
    "--exact",
    is_flag=True,
    help="Count every task, even on a large table (seconds at millions of rows) instead of "
    "estimating the finished ones from a sample.",
)

#: Under a table with estimated counts (those shown with ESTIMATED before them).
ESTIMATED = "~"
ESTIMATE_NOTE = (
    f"{ESTIMATED} estimated from a sample of the task table (finished tasks, and more than 1,000 "
    "waiting in a queue); --exact counts every row"
)


def count_text(n: int, estimated: bool) -> str:
    """A count as the tables show it: ``~12,000`` when it is an estimate."""
    return f"{ESTIMATED}{n:,}" if estimated else str(n)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    shown = Table(title=title, title_justify="left")
    for col in columns:
        shown.add_column(col)
    for row in rows:
        # Values are text, not markup (names and error codes are the user's); renderables pass through.
        shown.add_row(*(v if isinstance(v, Text) else escape("" if v is None else str(v)) for v in row))
    return shown


def status_text(value: str) -> Text:
    """A workflow, step or task status in its colour."""
    from rich.text import Text

    return Text(value, style=STYLES.get(value, ""))


def ts(value: Any) -> str:
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def workers_table(workers: list[WorkerSummary]) -> Table:
    """Workers with their heartbeat age (tether status and tether workers)."""
    return table(
        "Workers",
        ["id", "status", "queues", "procs", "async procs", "claimed", "running", "heartbeat age"],
        [
            [
                w.id,
                w.status,
                ",".join(w.queues),
                w.processes,
                f"{w.async_processes} x {w.async_concurrency}" if w.async_processes else "0",
                w.claimed,
                w.running,
                f"{w.heartbeat_age_s:.1f}s",
            ]
            for w in workers
        ],
    )


def who_asks() -> str:
    """The ``by`` of an operator's action from the command line: ``cli:<user>@<host>``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name and no passwd entry (some containers)
        user = "unknown"
    return f"cli:{user}@{socket.gethostname()}"[:MAX_BY_LENGTH]


Callback = Callable[[click.Context, click.Parameter, Any], Any]


def checked(check: Callable[[Any, str], Any], what: str | None = None) -> Callback:
    """A click callback that checks an option's value with one of tether.names' checks (the
    API's rule; ``what``: the name the message gives it, by default the option's); a refusal
    is a usage error (exit code 2) naming the option, before anything is read or written.
    None (not given) passes."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        try:
            return check(value, what or param.name or "value")
        except InvalidOptionError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None

    return callback


by_checked = checked(check_by)
queue_checked = checked(check_queue_name)
task_name_checked = checked(check_task_name)
