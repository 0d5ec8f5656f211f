"""``tether dashboard``: serve the web page until Ctrl-C or SIGTERM (docs/dashboard.md)."""

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
@click.option(
    "--token",
    envvar="TETHER_DASHBOARD_TOKEN",
    show_envvar=True,
    default=None,
    help="Enables the actions (cancel, retry, pause, resume) for whoever sends it. Prefer the "
    "environment variable or --token-file: a command line is visible to every user of the machine.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Read the token from the first line of this file.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="Also answer requests whose Host header names NAME (a reverse proxy's public name); "
    "repeatable. Always answered: localhost, 127.0.0.1, [::1] and the --host address. Beyond "
    "loopback without this option, any Host is answered (the token guards every read).",
)
@common.log_format_option
def dashboard(
    database_url: str | None,
    app_path: str | None,
    host: str,
    port: int,
    token: str | None,
    token_file: str | None,
    allowed_hosts: tuple[str, ...],
    log_format: str | None,
) -> None:
    """A web page of tasks, workflows, queues and workers; with a token, it can act on them."""
    from tether.web.auth import READ_ONLY_NOTE, TokenError, is_loopback, read_token
    from tether.web.dashboard import DashboardServer
    from tether.web.hosts import HostNameError, allowed_host

    try:
        secret = read_token(token, token_file)
        for name in allowed_hosts:
            allowed_host(name)  # checked before anything is opened
    except (TokenError, HostNameError) as exc:
        raise click.ClickException(str(exc)) from None
    if secret is None and not is_loopback(host):
        raise click.ClickException(
            f"refusing to listen on {host!r} without a token: anyone who can reach the port could read "
            "every task's arguments and errors. Set TETHER_DASHBOARD_TOKEN (or --token-file), or "
            "listen on 127.0.0.1 and reach it through an SSH tunnel"
        )
    config = common.load_config(database_url, app_path)
    common.apply_log_format(log_format, config)
    broker = common.open_broker(database_url, app_path)
    _ = broker.url  # connects and checks the schema now: an unreachable database fails here, named
    try:
        server = DashboardServer(
            (host, port),
            broker,
            config.recovery,
            token=secret,
            private_reads=not is_loopback(host),  # beyond loopback, the token guards reads too
            queues=config.queues,
            allowed_hosts=allowed_hosts,
        )
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (systemd, docker stop) ends it as Ctrl-C does

    # Before the first line is printed: whoever reads it may stop the dashboard at once.
    signal.signal(signal.SIGTERM, stop)
    try:
        click.echo(f"tether dashboard on {server.url} (Ctrl-C to stop)")
        if secret is None:
            click.echo(READ_ONLY_NOTE)
        elif server.access.private_reads:
            click.echo(
                "actions enabled; beyond loopback, reading needs the token too: the page asks for it once"
            )
        else:
            click.echo("actions enabled: the page asks for the token once")
        sys.stdout.flush()
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
