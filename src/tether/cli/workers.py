"""``tether worker`` (run one) and ``tether workers`` (list them)."""

from __future__ import annotations

from typing import Any

import click

from tether.broker.workers import list_workers
from tether.cli import common
from tether.worker_options import worker_config


@click.command()
@click.argument("app_path", required=False)
@click.option(
    "--django",
    "django_settings",
    metavar="SETTINGS",
    default=None,
    help="Instead of APP_PATH: run a Django project's tasks (tether.contrib.django), e.g. mysite.settings.",
)
@click.option(
    "--django-backend",
    default="default",
    show_default=True,
    help="With --django: the TASKS alias whose TetherBackend to serve.",
)
@click.option(
    "--processes",
    "-p",
    type=int,
    default=None,
    help="Sync child processes (default: CPU count if the app has sync tasks).",
)
@click.option(
    "--async-processes",
    type=int,
    default=None,
    help="Async child processes, many async tasks at once each (default: 1 if the app has async tasks).",
)
@click.option(
    "--async-concurrency",
    type=int,
    default=None,
    help="Async tasks one async child runs at once (default 100).",
)
@click.option("--queues", "-q", default=None, help="Comma-separated queues (default: all declared).")
@click.option("--prefetch", type=int, default=None, help="Claimed tasks held beyond running ones.")
@click.option("--grace-period", type=float, default=None, help="Seconds running tasks get on SIGTERM.")
@click.option(
    "--cancel-grace",
    type=float,
    default=None,
    help="Seconds a task may go on after its cancel (or an async task after its time limit) "
    "before its process is killed (default 5).",
)
@click.option("--poll-interval-ms", type=int, default=None, help="Fallback poll when no NOTIFY arrives.")
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (default: off; docs/monitoring.md).",
)
@click.option(
    "--metrics-host", default=None, help="Address the metrics endpoint listens on (default 0.0.0.0)."
)
@common.log_format_option
def worker(
    app_path: str | None,
    django_settings: str | None,
    django_backend: str,
    processes: int | None,
    async_processes: int | None,
    async_concurrency: int | None,
    queues: str | None,
    prefetch: int | None,
    grace_period: float | None,
    cancel_grace: float | None,
    poll_interval_ms: int | None,
    metrics_port: int | None,
    metrics_host: str | None,
    log_format: str | None,
) -> None:
    """Run a worker for APP_PATH (module:app), or for a Django project with --django SETTINGS."""
    if (app_path is None) == (django_settings is None):
        raise click.UsageError("give either APP_PATH (module:app) or --django SETTINGS (a settings module)")
    from tether.worker.heap import pause_collection, resume_collection

    # No collection while the app and the worker's modules are imported (tether.worker.heap).
    pause_collection()
    try:
        from tether.worker.app_loader import load_app
        from tether.worker.schema_check import begin_schema_check

        if django_settings is not None:
            # Imported only here: Django is an optional extra (tether[django]).
            from tether.contrib.django.worker import cli_worker_app

            app, app_path = cli_worker_app(django_settings, django_backend)
        else:
            assert app_path is not None
            app = load_app(app_path)
        # The first round trip goes on while the worker's modules are imported (schema_check.py).
        schema_checked = begin_schema_check(app)
        from tether.worker.main import run_worker
    finally:
        resume_collection()
    schema_checked()
    # Its children log in the same format (the supervisor hands them LogSetup.current()).
    common.apply_log_format(log_format, app.config)
    overrides: dict[str, Any] = {
        "processes": processes,
        "async_processes": async_processes,
        "async_concurrency": async_concurrency,
        "queues": queues,
        "prefetch": prefetch,
        "grace_period_s": grace_period,
        "cancel_grace_s": cancel_grace,
        "poll_interval_ms": poll_interval_ms,
        "metrics_port": metrics_port,
        "metrics_host": metrics_host,
    }
    run_worker(app, app_path, worker_config(app, overrides))


@click.command()
@common.db_option
@common.json_option
@click.option("--all", "show_all", is_flag=True, help="Include stopped and inactive workers.")
def workers(database_url: str | None, as_json: bool, show_all: bool) -> None:
    """Workers with their heartbeat age."""
    rows = common.open_broker(database_url).run(
        lambda conn: list_workers(conn, include_inactive=show_all, limit=500)
    )
    if as_json:
        common.emit_json(rows)
    else:
        common.console.print(common.workers_table(rows))
