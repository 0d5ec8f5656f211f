"""The ``tether`` command. click for parsing (typed options, good --help), rich for tables.

Each group of commands is a module of this package that knows only tether.cli.common;
this module makes the ``tether`` group, adds their commands to it, and runs it (``main``,
the console script).
"""

from __future__ import annotations

import logging
import sys
from typing import cast

import click

from tether.app import Tether
from tether.cli import (
    cancel,
    common,
    dashboard,
    demo,
    health,
    migrate,
    queues,
    recovery,
    retry,
    schedules,
    status,
    tasks,
    workers,
    workflows,
)
from tether.config import AppConfig, LogFormat, LoggingConfig
from tether.errors import TetherError
from tether.log_setup import setup_logging


@click.group()
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@common.log_format_option
def cli(log_level: str, log_format: str | None) -> None:
    """tether: durable background tasks on PostgreSQL."""
    # TETHER_LOG_FORMAT is read (and checked) here; a worker's app config may still set it.
    setup_logging(log_level.upper(), cast(LogFormat, log_format) if log_format else LoggingConfig().format)


for command in (
    workers.worker,
    migrate.migrate,
    status.status,
    health.health,
    dashboard.dashboard,
    workers.workers,
    tasks.tasks,
    tasks.task,
    cancel.cancel,
    recovery.recover,
    demo.demo,
    workflows.workflows,
    workflows.workflow,
    schedules.schedules,
    queues.queues,
    queues.queue,
    retry.retry,
):
    cli.add_command(command)


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
