"""Where the database is, and opening connections to it with errors that say which URL failed."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from psycopg.rows import dict_row

from tether.config import AppConfig, PostgresConfig, RecoveryConfig, mask_url
from tether.errors import DatabaseUnreachableError

log = logging.getLogger("tether.db")


def resolve_database_url(config: PostgresConfig) -> str:
    """The configured URL (config or TETHER_DATABASE_URL), else the shared embedded server's."""
    if config.database_url:
        return config.database_url
    from tether.db.embedded import ensure_shared_server

    return ensure_shared_server()


# A network that silently drops packets must fail a write in bounded time (so a
# worker can fence itself off before the reaper declares it dead), not after the
# kernel's default retransmission timeout of many minutes. Ignored on Unix sockets.
TCP_SETTINGS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


def worker_session_options(recovery: RecoveryConfig) -> dict[str, Any]:
    """Server-side limits for a worker's own connections.

    A worker frozen in the middle of a transaction (SIGSTOP, a stuck host) would
    keep its locks: the reaper's advisory lock, or the rows of the tasks it was
    recording, which every other reaper then skips. The server ends such a
    session well before any stale threshold, so recovery elsewhere goes on.
    """
    idle_ms = max(500, min(recovery.claimed_stale_threshold_ms, recovery.running_stale_threshold_ms) // 2)
    return {**TCP_SETTINGS, "options": f"-c idle_in_transaction_session_timeout={idle_ms}"}


def worker_connection_options(config: AppConfig, role: str) -> dict[str, Any]:
    """The options of every connection a worker opens, main process and children alike.

    ``role`` names the connection's job in pg_stat_activity: ``tether-<role>``.
    """
    return {
        "autocommit": True,
        "row_factory": dict_row,
        "application_name": f"tether-{role}",
        "connect_timeout": max(1, round(config.broker.connect_timeout_s)),
        **worker_session_options(config.recovery),
    }


def connect_worker(url: str, config: AppConfig, role: str) -> psycopg.Connection[dict[str, Any]]:
    """A worker's dedicated sync connection (see worker_connection_options)."""
    return psycopg.connect(url, **worker_connection_options(config, role))


async def connect_worker_async(
    url: str, config: AppConfig, role: str
) -> psycopg.AsyncConnection[dict[str, Any]]:
    """A worker's dedicated async connection (see worker_connection_options)."""
    return await psycopg.AsyncConnection.connect(url, **worker_connection_options(config, role))


def connect_kwargs(config: PostgresConfig) -> dict[str, Any]:
    return {
        "connect_timeout": max(1, round(config.connect_timeout_s)),
        "application_name": config.application_name,
        **TCP_SETTINGS,
    }


def unreachable(url: str, exc: BaseException) -> DatabaseUnreachableError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return DatabaseUnreachableError(
        f"cannot connect to PostgreSQL at {mask_url(url)}: {reason}. "
        "Check TETHER_DATABASE_URL (or PostgresConfig.database_url) and that the server is up."
    )


def connect(url: str, config: PostgresConfig, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    """A plain sync connection (dict rows). Raises DatabaseUnreachableError naming the masked URL."""
    try:
        return psycopg.connect(url, autocommit=autocommit, row_factory=dict_row, **connect_kwargs(config))
    except psycopg.OperationalError as exc:
        raise unreachable(url, exc) from exc


async def connect_async(
    url: str, config: PostgresConfig, *, autocommit: bool = True
) -> psycopg.AsyncConnection[Any]:
    try:
        return await psycopg.AsyncConnection.connect(
            url, autocommit=autocommit, row_factory=dict_row, **connect_kwargs(config)
        )
    except psycopg.OperationalError as exc:
        raise unreachable(url, exc) from exc
