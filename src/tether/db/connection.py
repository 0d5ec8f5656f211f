"""Where the database is, and opening connections to it with errors that say which URL failed;
the worker's dedicated connections (DedicatedConnection) and the options of all its connections."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import psycopg
from psycopg.rows import dict_row

from tether.config import AppConfig, PostgresConfig, RecoveryConfig, mask_url
from tether.db import refusals
from tether.db.read_only import AsyncPrimaryCursor, PrimaryCursor, ServerReadOnlyError
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


def idle_in_transaction_ms(recovery: RecoveryConfig) -> int:
    """How long a worker's session may sit idle inside a transaction before the server ends it.

    A worker frozen in the middle of a transaction (SIGSTOP, a stuck host) would
    keep its locks: the reaper's advisory lock, or the rows of the tasks it was
    recording, which every other reaper then skips. The server ends such a
    session well before any stale threshold, so recovery elsewhere goes on.
    """
    return max(500, min(recovery.claimed_stale_threshold_ms, recovery.running_stale_threshold_ms) // 2)


def worker_session_options(config: AppConfig) -> dict[str, Any]:
    """Server-side limits for a worker's own connections (``idle_in_transaction_ms``).

    Sent as a startup option, which a pooler refuses (PgBouncer: "unsupported startup
    parameter: options"): behind one, its own setting does the job instead
    (PgBouncer's ``idle_transaction_timeout``, docs/pgbouncer.md).
    """
    if config.broker.pooler != "none":
        return dict(TCP_SETTINGS)
    idle_ms = idle_in_transaction_ms(config.recovery)
    return {**TCP_SETTINGS, "options": f"-c idle_in_transaction_session_timeout={idle_ms}"}


def statement_options(config: PostgresConfig) -> dict[str, Any]:
    """What every connection tether opens needs for the statements it runs.

    psycopg prepares a statement by itself once a connection has run it 5 times. Through a
    transaction pooler each transaction may land on another server session: one that lacks
    the statement ("prepared statement "_pg3_0" does not exist") or already has another of
    that name ("... already exists"). There, no statement is prepared (prepare_threshold None).
    """
    return {} if config.prepares_statements else {"prepare_threshold": None}


def listen_url(config: PostgresConfig, url: str) -> str | None:
    """Where LISTEN connections go: ``listen_url`` if set, else ``url`` unless that is a
    transaction pooler (a LISTEN there lands on a server session other clients' transactions
    share, and its notifications never reach us). None: nothing listens, everything polls."""
    if config.listen_url is not None:
        return config.listen_url
    return None if config.pooler == "transaction" else url


def worker_connection_options(config: AppConfig, role: str) -> dict[str, Any]:
    """The options of every connection a worker opens, main process and children alike.

    ``role`` names the connection's job in pg_stat_activity: ``tether-<role>``.
    """
    return {
        "autocommit": True,
        "row_factory": dict_row,
        "application_name": f"tether-{role}",
        "connect_timeout": max(1, round(config.broker.connect_timeout_s)),
        **statement_options(config.broker),
        **worker_session_options(config),
    }


class DedicatedConnection:
    """A connection of a worker's own for one job: the reaper, the scheduler, a recorder.

    Opened on first use, opened again on the next use after it was lost (``close()``,
    or the server or the network dropped it), closed at the end. It is the only way
    those jobs get a connection, so what every such connection needs is decided here,
    in ``worker_connection_options``: its role in pg_stat_activity (``tether-<role>``),
    autocommit, dict rows, the TCP and session limits. Not thread-safe: one user at a
    time (the recorder holds a lock around it; a service uses it from one round at a time).
    """

    def __init__(self, url: str, config: AppConfig, role: str) -> None:
        self.url = url
        self.config = config
        self.role = role
        self._conn: psycopg.Connection[dict[str, Any]] | None = None

    def get(self) -> psycopg.Connection[dict[str, Any]]:
        """The open connection; a new one if there is none or it was lost."""
        if self._conn is None or self._conn.closed:
            try:
                self._conn = psycopg.connect(
                    self.url,
                    cursor_factory=PrimaryCursor,
                    **worker_connection_options(self.config, self.role),
                )
            except psycopg.OperationalError as exc:
                refusals.connect_failed(exc, self.role)
                raise
            refusals.connected()
        return self._conn

    def close(self) -> None:
        """Let the connection go (the next ``get()`` opens another); closing a broken one saves nothing."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error, OSError):
                conn.close()

    def __enter__(self) -> psycopg.Connection[dict[str, Any]]:
        return self.get()

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncDedicatedConnection:
    """DedicatedConnection for the jobs on the worker's event loop: the heartbeat, the work listener.

    ``tcp``: TCP settings that replace TCP_SETTINGS' (the listener's are tighter)."""

    def __init__(self, url: str, config: AppConfig, role: str, tcp: dict[str, int] | None = None) -> None:
        self.url = url
        self.config = config
        self.role = role
        self.tcp = tcp or {}
        self._conn: psycopg.AsyncConnection[dict[str, Any]] | None = None

    async def get(self) -> psycopg.AsyncConnection[dict[str, Any]]:
        """The open connection; a new one if there is none or it was lost."""
        if self._conn is None or self._conn.closed:
            try:
                self._conn = await psycopg.AsyncConnection.connect(
                    self.url,
                    cursor_factory=AsyncPrimaryCursor,
                    **{**worker_connection_options(self.config, self.role), **self.tcp},
                )
            except psycopg.OperationalError as exc:
                refusals.connect_failed(exc, self.role)
                raise
            refusals.connected()
        return self._conn

    async def close(self) -> None:
        """Let the connection go (the next ``get()`` opens another); closing a broken one saves nothing."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error, OSError):
                await conn.close()


def connect_kwargs(config: PostgresConfig) -> dict[str, Any]:
    return {
        "connect_timeout": max(1, round(config.connect_timeout_s)),
        "application_name": config.application_name,
        **statement_options(config),
        **TCP_SETTINGS,
    }


def unreachable(url: str, exc: BaseException) -> DatabaseUnreachableError:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, ServerReadOnlyError):
        return DatabaseUnreachableError(
            f"cannot write to PostgreSQL at {mask_url(url)}: {reason}. Nothing was written; "
            "try again once a primary answers (a multi-host URL with "
            "target_session_attrs=read-write finds it: docs/high-availability.md)."
        )
    return DatabaseUnreachableError(
        f"cannot connect to PostgreSQL at {mask_url(url)}: {reason}. "
        "Check TETHER_DATABASE_URL (or PostgresConfig.database_url) and that the server is up."
    )


def connect(url: str, config: PostgresConfig, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    """A plain sync connection (dict rows). Raises DatabaseUnreachableError naming the masked URL."""
    try:
        return psycopg.connect(
            url,
            autocommit=autocommit,
            row_factory=dict_row,
            cursor_factory=PrimaryCursor,
            **connect_kwargs(config),
        )
    except psycopg.OperationalError as exc:
        raise unreachable(url, exc) from exc


async def connect_async(
    url: str, config: PostgresConfig, *, autocommit: bool = True
) -> psycopg.AsyncConnection[Any]:
    try:
        return await psycopg.AsyncConnection.connect(
            url,
            autocommit=autocommit,
            row_factory=dict_row,
            cursor_factory=AsyncPrimaryCursor,
            **connect_kwargs(config),
        )
    except psycopg.OperationalError as exc:
        raise unreachable(url, exc) from exc
