"""``tether dashboard``: serve the read-only web page until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import sys

import click

from tether.cli import common


@click.command()
@common.db_option
@common.app_option
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65_535), default=8080, show_default=True, help="0: any free port."
)
def dashboard(database_url: str | None, app_path: str | None, host: str, port: int) -> None:
    """A read-only web page of queues, workers, stale tasks and recent failures."""
    from tether.web.dashboard import DashboardServer

    config = common.load_config(database_url, app_path)
    broker = common.open_broker(database_url, app_path)
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
