"""The ``tether`` command. click for parsing (typed options, good --help), rich for tables."""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tether.app import Tether
from tether.broker import PostgresBroker
from tether.config import AppConfig, PostgresConfig, WorkerConfig
from tether.errors import TetherError
from tether.ids import parse_task_id
from tether.result import TaskStatus

console = Console()


def _config(database_url: str | None, app_path: str | None = None) -> AppConfig:
    """The app's config when --app is given (its thresholds and queues), else TETHER_* and defaults."""
    if app_path:
        from tether.worker.app_loader import load_app

        config = load_app(app_path).config
    else:
        config = AppConfig()
    if database_url:
        config = config.model_copy(update={"broker": PostgresConfig(database_url=database_url)})
    return config


def _broker(database_url: str | None, app_path: str | None = None) -> PostgresBroker:
    config = _config(database_url, app_path)
    broker = PostgresBroker(config.broker, auto_migrate=config.auto_migrate)
    # Close the pool before the interpreter tears threads down (else psycopg_pool warns).
    click.get_current_context().call_on_close(broker.close)
    return broker


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, default=str, indent=2))


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        # Values are text, not markup (names and error codes are the user's); renderables pass through.
        table.add_row(*(v if isinstance(v, Text) else escape("" if v is None else str(v)) for v in row))
    return table


_db_option = click.option(
    "--database-url",
    envvar="TETHER_DATABASE_URL",
    default=None,
    help="PostgreSQL URL (default: TETHER_DATABASE_URL, else the embedded server).",
)
_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
_app_option = click.option(
    "--app",
    "app_path",
    default=None,
    help="module:app whose RecoveryConfig (thresholds, intervals) to use; default: TETHER_* and defaults.",
)


@click.group()
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
def cli(log_level: str) -> None:
    """tether: durable background tasks on PostgreSQL."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@cli.command()
@click.argument("app_path")
@click.option("--processes", "-p", type=int, default=None, help="Child processes running tasks.")
@click.option("--queues", "-q", default=None, help="Comma-separated queues (default: all declared).")
@click.option("--prefetch", type=int, default=None, help="Claimed tasks held beyond running ones.")
@click.option("--grace-period", type=float, default=None, help="Seconds running tasks get on SIGTERM.")
@click.option("--poll-interval-ms", type=int, default=None, help="Fallback poll when no NOTIFY arrives.")
def worker(
    app_path: str,
    processes: int | None,
    queues: str | None,
    prefetch: int | None,
    grace_period: float | None,
    poll_interval_ms: int | None,
) -> None:
    """Run a worker for APP_PATH (module:app)."""
    from tether.worker.app_loader import load_app
    from tether.worker.main import run_worker

    app = load_app(app_path)
    overrides: dict[str, Any] = {
        "processes": processes,
        "queues": queues,
        "prefetch": prefetch,
        "grace_period_s": grace_period,
        "poll_interval_ms": poll_interval_ms,
    }
    base = app.config.worker.model_dump()
    base.update({k: v for k, v in overrides.items() if v is not None})
    run_worker(app, app_path, WorkerConfig(**base))


@cli.command()
@_db_option
def migrate(database_url: str | None) -> None:
    """Apply pending schema migrations (under an advisory lock)."""
    from tether.db.connection import connect, resolve_database_url
    from tether.db.migrate import current_version, latest_version
    from tether.db.migrate import migrate as run_migrate

    cfg = PostgresConfig(database_url=database_url) if database_url else PostgresConfig()
    url = resolve_database_url(cfg)
    with connect(url, cfg) as conn:
        before = current_version(conn)
        applied = run_migrate(conn)
    if applied:
        console.print(f"schema migrated from version {before} to {applied[-1]}")
    else:
        console.print(f"schema is up to date (version {latest_version()})")


@cli.command()
@_db_option
@_json_option
@_app_option
def status(database_url: str | None, as_json: bool, app_path: str | None) -> None:
    """Counts per queue and status, workers with heartbeat age, stale tasks."""
    rc = _config(database_url, app_path).recovery
    snapshot = _broker(database_url, app_path).status_snapshot(rc.running_stale_threshold_ms)
    counts, workers, stale = snapshot["counts"], snapshot["workers"], snapshot["stale_tasks"]
    if as_json:
        _emit_json({"counts": counts, "workers": workers, "stale_tasks": stale})
        return
    statuses = [s.value for s in TaskStatus]
    per_queue: dict[str, dict[str, int]] = {}
    for row in counts:
        per_queue.setdefault(row["queue"], {})[row["status"]] = row["n"]
    console.print(
        _table(
            "Tasks",
            ["queue", *statuses],
            [[q, *(c.get(s, 0) for s in statuses)] for q, c in sorted(per_queue.items())],
        )
    )
    console.print(_workers_table(workers))
    console.print(
        _table(
            f"Stale tasks (RUNNING, no runner heartbeat for over "
            f"{snapshot['running_stale_threshold_s']:.0f}s)",
            ["task", "name", "worker", "host", "worker status", "silent"],
            [
                [
                    r["id"],
                    r["name"],
                    r["worker_id"],
                    r["worker_hostname"],
                    r["worker_status"],
                    f"{r['silent_s']:.0f}s",
                ]
                for r in stale
            ],
        )
    )


@cli.command()
@_db_option
@_app_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65_535), default=8080, show_default=True, help="0: any free port."
)
def dashboard(database_url: str | None, app_path: str | None, host: str, port: int) -> None:
    """A read-only web page of queues, workers, stale tasks and recent failures."""
    from tether.web.dashboard import DashboardServer

    config = _config(database_url, app_path)
    broker = _broker(database_url, app_path)
    _ = broker.url  # connects and checks the schema now: an unreachable database fails here, named
    try:
        server = DashboardServer((host, port), broker, config.recovery)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    click.echo(f"tether dashboard on {server.url} (Ctrl-C to stop)", err=False)
    sys.stdout.flush()

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (systemd, docker stop) ends it as Ctrl-C does

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _workers_table(workers: list[dict[str, Any]]) -> Table:
    return _table(
        "Workers",
        ["id", "status", "queues", "procs", "claimed", "running", "heartbeat age"],
        [
            [
                w["id"],
                w["status"],
                ",".join(w["queues"]),
                w["processes"],
                w["claimed"],
                w["running"],
                f"{float(w['heartbeat_age_s']):.1f}s",
            ]
            for w in workers
        ],
    )


@cli.command()
@_db_option
@_json_option
@click.option("--all", "show_all", is_flag=True, help="Include stopped and inactive workers.")
def workers(database_url: str | None, as_json: bool, show_all: bool) -> None:
    """Workers with their heartbeat age."""
    rows = _broker(database_url).fetchall("list_workers", {"all": show_all, "limit": 500})
    if as_json:
        _emit_json(rows)
    else:
        console.print(_workers_table(rows))


@cli.command()
@_db_option
@_json_option
@click.option("--status", "status_", type=click.Choice([s.value for s in TaskStatus], case_sensitive=False))
@click.option("--queue", default=None)
@click.option("--name", default=None)
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
    rows = _broker(database_url).fetchall(
        "list_tasks",
        {
            "status": status_.upper() if status_ else None,
            "queue": queue,
            "name": name,
            "limit": limit,
        },
    )
    if as_json:
        _emit_json(rows)
        return
    console.print(
        _table(
            "Tasks",
            ["id", "name", "queue", "status", "attempt", "error", "sent", "finished"],
            [
                [
                    r["id"],
                    r["name"],
                    r["queue"],
                    r["status"],
                    r["attempt"],
                    r["error_code"],
                    _ts(r["sent_at"]),
                    _ts(r["finished_at"]),
                ]
                for r in rows
            ],
        )
    )


@cli.command()
@click.argument("task_id")
@_db_option
@_json_option
def task(task_id: str, database_url: str | None, as_json: bool) -> None:
    """One task with its attempts."""
    broker = _broker(database_url)
    tid = parse_task_id(task_id)
    row = broker.fetchone("get_task", {"id": tid})
    if row is None:
        raise click.ClickException(f"no task with id {tid}")
    attempts = broker.fetchall("get_attempts", {"id": tid})
    beats = broker.fetchall("get_heartbeats", {"id": tid, "limit": 10})
    if as_json:
        _emit_json({**row, "attempts": attempts, "heartbeats": beats})
        return
    fields = Table(title=f"Task {tid}", title_justify="left", show_header=False)
    for key in (
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
        "sent_at",
        "enqueued_at",
        "claimed_at",
        "started_at",
        "completed_at",
        "failed_at",
        "cancelled_at",
        "expired_at",
        "next_retry_at",
        "args",
        "kwargs",
        "result",
        "progress",
        "progress_at",
    ):
        fields.add_row(key, "" if row[key] is None else str(row[key]))
    console.print(fields)
    console.print(
        _table(
            "Attempts",
            ["#", "worker", "started", "finished", "outcome", "retry", "error"],
            [
                [
                    a["attempt"],
                    a["worker_id"],
                    _ts(a["started_at"]),
                    _ts(a["finished_at"]),
                    a["outcome"],
                    "yes" if a["will_retry"] else "",
                    a["error_code"],
                ]
                for a in attempts
            ],
        )
    )
    console.print(
        _table(
            "Latest heartbeats",
            ["role", "sender", "host", "pid", "sent"],
            [[b["role"], b["sender_id"], b["hostname"], b["pid"], _ts(b["sent_at"])] for b in beats],
        )
    )


@cli.command()
@_db_option
@_json_option
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
@_app_option
def recover(
    database_url: str | None,
    as_json: bool,
    dry_run: bool,
    claimed_threshold_ms: int | None,
    running_threshold_ms: int | None,
    app_path: str | None,
) -> None:
    """Recover stale tasks now, by the reaper's rules (manual recovery), then reconcile workflows."""
    from tether.broker.recovery import apply_task_rules
    from tether.cli_workflows import report_json, report_summary, report_table
    from tether.workflow.recovery import reconcile_and_report

    rc = _config(database_url, app_path).recovery
    broker = _broker(database_url, app_path)
    beat_ms = min(rc.claimer_heartbeat_interval_ms, rc.runner_heartbeat_interval_ms)
    with broker.connection() as conn:
        done = apply_task_rules(
            conn,
            claimed_threshold_ms=claimed_threshold_ms or rc.claimed_stale_threshold_ms,
            running_threshold_ms=running_threshold_ms or rc.running_stale_threshold_ms,
            worker_threshold_ms=3 * beat_ms,
            dry_run=dry_run,
        )
        # Then the reaper's workflow reconciliation, which also settles the steps of tasks failed above.
        flows = reconcile_and_report(conn, dry_run=dry_run)
    rows = (
        [("requeued (CLAIMED -> PENDING)", r) for r in done.requeued]
        + [("retry scheduled (WORKER_CRASHED)", r) for r in done.retried]
        + [("FAILED (WORKER_CRASHED)", r) for r in done.failed]
    )
    if as_json:
        _emit_json(
            {
                "dry_run": dry_run,
                "expired": done.expired,
                "tasks": [{"action": a, **r} for a, r in rows],
                "workers_deactivated": done.deactivated,
                "workflows": report_json(flows),
            }
        )
        return
    verb = "would be" if dry_run else "were"
    console.print(
        _table(
            f"Stale tasks ({'dry run: nothing changed' if dry_run else 'recovered'})",
            ["task", "name", "attempt", "worker", "silent", "action"],
            [
                [r["id"], r["name"], r["attempt"], r["claimed_by_worker_id"], f"{r['silent_s']:.1f}s", a]
                for a, r in rows
            ],
        )
    )
    console.print(
        f"{len(rows)} stale task(s) {verb} recovered, {done.expired} expired task(s) {verb} marked "
        f"EXPIRED, {len(done.deactivated)} silent worker(s) {verb} marked inactive"
    )
    if flows.workflows:
        console.print(report_table(flows))
    console.print(report_summary(flows))


@cli.command()
@click.option("--tasks", "count", type=click.IntRange(1, 100_000), default=200, show_default=True)
@click.option("--processes", type=click.IntRange(1, 64), default=2, show_default=True)
def demo(count: int, processes: int) -> None:
    """The main job on the embedded database: two workers, a batch of tasks, then one
    worker killed mid-task and its tasks' recovery shown as it happens."""
    from tether.demo import run_demo

    sys.exit(run_demo(console, count=count, processes=processes))


def _ts(value: Any) -> str:
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def main() -> None:
    try:
        cli(standalone_mode=True)
    except (TetherError, ValueError) as exc:
        # User-caused errors (bad app path, task id, option, config): the message, not a traceback.
        # ValueError covers pydantic's ValidationError, whose text names the field.
        logging.getLogger("tether.cli").debug("command failed", exc_info=exc)
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


__all__ = ["AppConfig", "Tether", "cli", "main"]


def _register_workflow_commands() -> None:
    """The workflow commands live in tether.cli_workflows, which adds them to `cli` on import.

    Imported from a function so that type checkers read this module first (that one uses
    this one's options and helpers).
    """
    from tether import cli_workflows  # noqa: F401


_register_workflow_commands()
