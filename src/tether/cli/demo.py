"""``tether demo``: the command; the demo itself (its app and steps) is tether.demo."""

from __future__ import annotations

import sys

import click

from tether.cli import common


@click.command()
@click.option("--tasks", "count", type=click.IntRange(1, 100_000), default=200, show_default=True)
@click.option("--processes", type=click.IntRange(1, 64), default=2, show_default=True)
def demo(count: int, processes: int) -> None:
    """The main job on the embedded database: two workers, a batch of tasks, then one
    worker killed mid-task and its tasks' recovery shown as it happens."""
    from tether.demo import run_demo

    sys.exit(run_demo(common.console, count=count, processes=processes))
