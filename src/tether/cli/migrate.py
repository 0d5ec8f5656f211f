"""``tether migrate``: apply pending schema migrations."""

from __future__ import annotations

import click

from tether.cli import common
from tether.config import PostgresConfig


@click.command()
@common.db_option
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
        common.console.print(f"schema migrated from version {before} to {applied[-1]}")
    else:
        common.console.print(f"schema is up to date (version {latest_version()})")
