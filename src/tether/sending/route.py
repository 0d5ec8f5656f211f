"""Where a send's statements run: on the app's pool, or on the connection the caller lent
with ``with_options(connection=...)``, inside the caller's transaction (docs/transactions.md);
from sync or from async code. Every kind of send runs through ``Route``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Protocol, TypeVar, cast

import psycopg

from tether import tracing
from tether.app_view import AppView
from tether.broker.loop_connections import Tried
from tether.broker.types import AsyncCallerConn, AsyncConn, CallerConn, Conn
from tether.caller_transaction import run_in, run_in_async
from tether.offload import in_thread

log = logging.getLogger("tether.sending")

W = TypeVar("W")
W_co = TypeVar("W_co", covariant=True)


class Plan(Protocol[W_co]):
    """A send checked and encoded, ready to write (one, one_unique, many and many_unique)."""

    @property
    def all_or_none(self) -> bool:
        """It may run several statements: on the pool they get a transaction of their own
        (on a lent connection, the caller's transaction already makes them all or none)."""
        ...

    @property
    def repeatable(self) -> bool:
        """Its insert may meet its own rows when run again after its connection broke (the
        task ids are the client's), and that is taken as done (PostgresBroker.run)."""
        ...

    def write(self, conn: Conn) -> W_co: ...

    def write_async(self, conn: AsyncConn) -> Awaitable[W_co]: ...


class Route:
    """The app's pool (``connection`` None) or the caller's connection."""

    __slots__ = ("app", "connection")

    def __init__(self, app: AppView, connection: CallerConn | AsyncCallerConn | None) -> None:
        self.app = app
        self.connection = connection

    def run(self, plan: Plan[W], call: str) -> W:
        """``plan`` written from sync code; ``call`` names the API in errors ("send()")."""
        if self.app.config.tracing:
            return tracing.traced_send(plan, lambda: self._run(plan, call))
        return self._run(plan, call)

    def _run(self, plan: Plan[W], call: str) -> W:
        if self.connection is not None:
            return run_in(self.app.broker, self.connection, call, plan.write)
        if plan.all_or_none:

            def whole(conn: Conn) -> W:
                with conn.transaction():
                    return plan.write(conn)

            return self.app.broker.run(whole, idempotent_insert=plan.repeatable)
        return self.app.broker.run(plan.write, idempotent_insert=plan.repeatable)

    async def run_async(self, plan: Plan[W], call: str) -> W:
        """``plan`` written from async code: on the caller's async connection if one was lent,
        else on the app's pool in a thread (offload.py says why not an async pool)."""
        lent = self.connection
        if lent is not None:
            if self.app.config.tracing:
                return await tracing.traced_send_async(
                    plan, lambda: run_in_async(self.app.broker, lent, call, plan.write_async)
                )
            return await run_in_async(self.app.broker, lent, call, plan.write_async)
        if getattr(plan, "on_loop_connection", False) and not self.app.config.tracing:
            # One statement, its own transaction: on the loop's own connection when it is free
            # (broker/loop_connections.py), without the hand-off to a thread.
            tried, written = await self.app.broker.loop_connections.run(plan.write_async)
            if tried is Tried.WRITTEN:
                return written  # type: ignore[return-value]
            if tried is Tried.LOST:  # it may have committed: a repeat that meets its row is done
                try:
                    return await in_thread(lambda: self.run(plan, call))
                except psycopg.errors.UniqueViolation:
                    log.info("the send had committed before its connection was lost")
                    return cast(W, None)
        return await in_thread(lambda: self.run(plan, call))
