"""The ``tether`` command. click for parsing (typed options, good --help), rich for tables.

Each group of commands is a module of this package that knows only tether.cli.common;
this module makes the ``tether`` group, adds their commands to it, and runs it (``main``,
the console script).
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import cast

import click

from tether.app import Tether
from tether.cli import common
from tether.config import AppConfig, LogFormat, LoggingConfig
from tether.errors import TetherError
from tether.log_setup import setup_logging
from tether.worker.heap import resume_collection

# Each command's module is imported when that command runs (or for --help): `tether worker`
# starts without importing the other commands and what they use (rich, the dashboard).
COMMANDS = {
    "worker": "tether.cli.workers:worker",
    "migrate": "tether.cli.migrate:migrate",
    "status": "tether.cli.status:status",
    "health": "tether.cli.health:health",
    "dashboard": "tether.cli.dashboard:dashboard",
    "workers": "tether.cli.workers:workers",
    "tasks": "tether.cli.tasks:tasks",
    "task": "tether.cli.tasks:task",
    "cancel": "tether.cli.cancel:cancel",
    "recover": "tether.cli.recovery:recover",
    "demo": "tether.cli.demo:demo",
    "workflows": "tether.cli.workflows:workflows",
    "workflow": "tether.cli.workflows:workflow",
    "schedules": "tether.cli.schedules:schedules",
    "queues": "tether.cli.queues:queues",
    "queue": "tether.cli.queues:queue",
    "retry": "tether.cli.retry:retry",
    "send-event": "tether.cli.events:send_event",
}


class LazyGroup(click.Group):
    """A group whose commands (COMMANDS) are imported by name when asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands or cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        module, attribute = COMMANDS[cmd_name].split(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command) and command.name == cmd_name, COMMANDS[cmd_name]
        self.add_command(command)
        return command


@click.group(cls=LazyGroup)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@common.log_format_option
def cli(log_level: str, log_format: str | None) -> None:
    """tether: durable background tasks on PostgreSQL."""
    # The command's module is imported by now: end the entry point's pause (tether.__main__).
    resume_collection()
    # TETHER_LOG_FORMAT is read (and checked) here; a worker's app config may still set it.
    setup_logging(log_level.upper(), cast(LogFormat, log_format) if log_format else LoggingConfig().format)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except (TetherError, ValueError) as exc:
        # User-caused errors (bad app path, task id, option, config): the message, not a traceback.
        # ValueError covers pydantic's ValidationError, whose text names the field.
        logging.getLogger("tether.cli").debug("command failed", exc_info=exc)
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


# AppConfig and Tether were exported from tether.cli before it became a package.
__all__ = ["AppConfig", "Tether", "cli", "main"]
