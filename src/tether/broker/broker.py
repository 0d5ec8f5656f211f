"""PostgresBroker: the app's door to the database (pools, schema check, run(work) with retry).

Transport only: where the database is, its pool, running work on it (run, run_request,
connection, connect), which database it is (identity), closing. What is read or written is
in the broker's other modules; the overview of `tether status` is broker/status.py, and the
seed's manual-recovery calls kept here are thin doors to broker/manual_recovery.py.

One sync pool serves every caller; async APIs run it in a thread. (psycopg's
async pool belongs to one event loop, and one left behind by a finished loop
never closes cleanly: a process that calls asyncio.run() repeatedly would hang
or leak.) The pool is opened lazily on first use, so importing an app (as every worker child
does) opens nothing, and a forked process never reuses its parent's sockets.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, cast

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool, PoolTimeout

from tether.broker import answers
from tether.broker.identity import DatabaseIdentity, database_identity
from tether.broker.loop_connections import LoopConnections
from tether.config import PostgresConfig
from tether.db.connection import connect, connect_kwargs, listen_url, resolve_database_url, unreachable
from tether.db.migrate import ensure_schema
from tether.db.read_only import PrimaryCursor, ServerReadOnlyError

if TYPE_CHECKING:
    # Imported by the manual-recovery doors below on first use: manual_recovery brings
    # recovery, claims and retention (with their row dataclasses), which a producer and the
    # broker's other callers never need.
    from tether.broker.recovery import StaleTask

log = logging.getLogger("tether.broker")

Row = dict[str, Any]
T = TypeVar("T")


class _AnsweredMeanwhile(Exception):
    """Rolls back a repeated request whose first attempt committed its answer meanwhile."""


class PostgresBroker:
    def __init__(self, config: PostgresConfig, *, auto_migrate: bool = True) -> None:
        self.config = config
        self.auto_migrate = auto_migrate
        self._lock = threading.Lock()
        self._url: str | None = None
        self._pid = os.getpid()
        self._pool: ConnectionPool[psycopg.Connection[Row]] | None = None
        self._identity: DatabaseIdentity | None = None
        # send_async()'s own connection per event loop (loop_connections.py says why).
        self.loop_connections = LoopConnections(lambda: self.url, config)

    # -- where and how -------------------------------------------------------

    @property
    def url(self) -> str:
        """The database URL, resolving the embedded server (and checking the schema) once."""
        self._forget_if_forked()
        if self._url is None:
            with self._lock:
                if self._url is None:
                    url = resolve_database_url(self.config)
                    with connect(url, self.config) as conn:
                        ensure_schema(conn, auto_migrate=self.auto_migrate)
                    self._url = url
        return self._url

    def identity(self) -> DatabaseIdentity:
        """Which database (and tether_tasks table) the app uses; asked once, then remembered."""
        if self._identity is None:
            self._identity = self.run(database_identity)
        return self._identity

    @property
    def remembered_identity(self) -> DatabaseIdentity | None:
        """identity() if it was asked already (no I/O), else None."""
        return self._identity

    def connect(self, *, autocommit: bool = True) -> psycopg.Connection[Row]:
        """A dedicated connection (for listeners and worker children), not from the pool."""
        return connect(self.url, self.config, autocommit=autocommit)

    @property
    def listen_url(self) -> str | None:
        """Where this app LISTENs (db/connection.py listen_url); None: behind a transaction
        pooler with no listen_url, where waiting for a result polls instead."""
        return listen_url(self.config, self.url)

    def connect_listener(self) -> psycopg.Connection[Row]:
        """A dedicated connection to LISTEN on; only when ``listen_url`` is not None."""
        url = self.listen_url
        if url is None:
            raise RuntimeError("no LISTEN behind a transaction pooler without PostgresConfig.listen_url")
        return connect(url, self.config)

    def _forget_if_forked(self) -> None:
        if os.getpid() != self._pid:
            # The parent's pool sockets belong to the parent: never close or use them here.
            self._pid = os.getpid()
            self._pool = None
            self._lock = threading.Lock()

    def _pool_kwargs(self) -> dict[str, Any]:
        return {
            "autocommit": True,
            "row_factory": dict_row,
            "cursor_factory": PrimaryCursor,  # a read-only server is a lost connection (db/read_only.py)
            **connect_kwargs(self.config),
        }

    @property
    def pool(self) -> ConnectionPool[psycopg.Connection[Row]]:
        self._forget_if_forked()
        if self._pool is None:
            url = self.url
            with self._lock:
                if self._pool is None:
                    self._pool = ConnectionPool(
                        url,
                        min_size=self.config.pool_min_size,
                        max_size=self.config.pool_max_size,
                        kwargs=self._pool_kwargs(),
                        check=_check_if_idle,
                        timeout=self.config.connect_timeout_s,
                        name="tether",
                        open=True,
                    )
                    _open_brokers.add(self)
        return self._pool

    # -- running work on a pooled connection ---------------------------------

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Row]]:
        try:
            with _pooled(self.pool) as conn:
                yield conn
        except PoolTimeout as exc:
            raise unreachable(self.url, exc) from exc
        except psycopg.OperationalError as exc:
            raise unreachable(self.url, exc) from exc

    def run(self, work: Callable[[psycopg.Connection[Row]], T], *, idempotent_insert: bool = False) -> T:
        """``work`` on a pooled connection; once more on a fresh one if that one turns out dead.

        A pooled connection can die with the server (a restart, a failover,
        pg_terminate_backend) while it sits in the pool. A statement sent on it
        either never ran, or ran and committed just before the connection broke.
        Reads, sends and the worker's fenced writes are safe to repeat in both cases
        (an insert of a client-generated id that meets its own row is taken as done);
        a request that changes something and answers what it did goes through
        run_request instead, which keeps the first attempt's answer.
        """
        return self._attempts(lambda conn, repeat: work(conn), idempotent_insert=idempotent_insert)

    def run_request(self, work: Callable[[psycopg.Connection[Row]], T], answer: answers.Answer[T]) -> T:
        """``work``, a request that changes something (pause, resume, cancel, retry), with run()'s
        retry and an answer that stays true across it.

        Repeated after a lost connection whose statement had committed, a request would
        answer for the state its first attempt left ("already paused", "already ended")
        rather than for what it did. Here each attempt runs in one transaction that also
        records its answer (as ``answer`` encodes the answers of its type)
        under an id made for this call (answers.sql, migration 0010). A repeat returns the
        recorded answer if there is one; else it works, and if the first attempt commits
        meanwhile (it was still running on the server), the id's primary key makes the
        repeat roll back and return that answer. Work that raises records nothing.
        """
        request_id = uuid.uuid4()

        def attempt(conn: psycopg.Connection[Row], repeat: bool) -> T:
            if repeat:
                earlier = answers.recorded_answer(conn, request_id)
                if earlier is not None:
                    log.info("the request had committed before its connection was lost; its answer stands")
                    return answer.load(earlier)
            try:
                with conn.transaction():
                    result = work(conn)
                    if not answers.record_answer(conn, request_id, answer.dump(result)):
                        raise _AnsweredMeanwhile
            except _AnsweredMeanwhile:
                recorded = answers.recorded_answer(conn, request_id)
                assert recorded is not None  # committed before this attempt's insert gave way
                log.info("the request's first attempt committed while it was repeated; its answer stands")
                return answer.load(recorded)
            return result

        return self._attempts(attempt, idempotent_insert=False)

    def _attempts(
        self, attempt: Callable[[psycopg.Connection[Row], bool], T], *, idempotent_insert: bool
    ) -> T:
        """``attempt(conn, repeat)`` until one returns: again on another pooled connection while
        the one it had turns out dead (``repeat`` is True from the second attempt on)."""
        lost = False
        last: BaseException = RuntimeError("every pooled connection was dead")
        # Every connection in the pool may have died together: each dead one is
        # discarded on its way back, so at most pool_max_size of them can fail.
        for _ in range(self.config.pool_max_size + 1):
            try:
                with _pooled(self.pool) as conn:
                    try:
                        return attempt(conn, lost)
                    except psycopg.errors.UniqueViolation:
                        if idempotent_insert and lost:
                            log.info("the insert had committed before the connection was lost")
                            return cast(T, None)
                        raise
                    except psycopg.OperationalError as exc:
                        if not (conn.broken or conn.closed):
                            raise
                        lost, last = True, exc
                        if isinstance(exc, ServerReadOnlyError):  # said by db/read_only.py
                            log.debug("a pooled connection's server is read-only; retrying on another")
                        else:
                            log.warning("a pooled connection was dead (%s); retrying on another", exc)
            except PoolTimeout as exc:
                raise unreachable(self.url, exc) from exc
            except psycopg.OperationalError as exc:
                raise unreachable(self.url, exc) from exc
        raise unreachable(self.url, last)

    # -- the seed's manual recovery (docs/internals.md "The seed contract") ----------
    # Async as in the seed documents, with sync twins: thin doors to manual_recovery, which
    # `tether recover` and the dashboard use too.

    def get_stale_tasks_sync(self, stale_threshold_minutes: float = 5.0) -> list[StaleTask]:
        """RUNNING tasks with no runner heartbeat for longer than the threshold, with their worker."""
        from tether.broker import manual_recovery

        minutes = manual_recovery.check_positive("stale_threshold_minutes", stale_threshold_minutes)
        threshold_ms = minutes * 60_000
        with self.connection() as conn:
            return manual_recovery.stale_tasks(conn, threshold_ms)

    async def get_stale_tasks(self, stale_threshold_minutes: float = 5.0) -> list[StaleTask]:
        return await asyncio.to_thread(self.get_stale_tasks_sync, stale_threshold_minutes)

    def mark_stale_tasks_as_failed_sync(self, stale_threshold_ms: int = 300_000) -> int:
        """Fail (or crash-retry, per each task's policy) RUNNING tasks silent past the threshold."""
        from tether.broker import manual_recovery

        threshold_ms = manual_recovery.check_positive("stale_threshold_ms", stale_threshold_ms)
        rules = manual_recovery.Rules(running_threshold_ms=threshold_ms)
        with self.connection() as conn:
            done = manual_recovery.recover(conn, rules)
        return len(done.retried) + len(done.failed)

    async def mark_stale_tasks_as_failed(self, stale_threshold_ms: int = 300_000) -> int:
        return await asyncio.to_thread(self.mark_stale_tasks_as_failed_sync, stale_threshold_ms)

    def requeue_stale_claimed_sync(self, stale_threshold_ms: int = 120_000) -> int:
        """Put CLAIMED tasks whose claimer went silent past the threshold back to PENDING."""
        from tether.broker import manual_recovery

        threshold_ms = manual_recovery.check_positive("stale_threshold_ms", stale_threshold_ms)
        rules = manual_recovery.Rules(claimed_threshold_ms=threshold_ms)
        with self.connection() as conn:
            return len(manual_recovery.recover(conn, rules).requeued)

    async def requeue_stale_claimed(self, stale_threshold_ms: int = 120_000) -> int:
        return await asyncio.to_thread(self.requeue_stale_claimed_sync, stale_threshold_ms)

    # -- lifecycle -----------------------------------------------------------

    def close(self) -> None:
        self.loop_connections.close_all()
        if self._pool is not None and os.getpid() == self._pid:
            self._pool.close()
        self._pool = None
        _open_brokers.discard(self)


# Pools still open when the interpreter exits are closed by atexit, while their
# threads can still run. Left to the garbage collector, Python 3.13 finalises a
# pool after its threads are frozen: each join times out (5 s per thread, with a
# warning on stderr), so a script that sends and ends took ~20 s to exit.
_open_brokers: weakref.WeakSet[PostgresBroker] = weakref.WeakSet()


@atexit.register
def _close_open_brokers() -> None:
    for broker in list(_open_brokers):
        try:
            broker.close()
        except Exception:  # one broker failing to close must not keep the others open
            log.exception("closing the connection pool of %r at exit failed", broker)


# A connection that sat in the pool may have died with the server (restart,
# pg_terminate_backend, a failover). Checking costs a round trip, so only
# connections idle for a while are checked; busy ones were proven alive just now.
CHECK_IF_IDLE_S = 1.0
_returned_at: weakref.WeakKeyDictionary[psycopg.Connection[Any], float] = weakref.WeakKeyDictionary()


# The return time is noted here rather than in the pool's reset callback: with a
# reset callback psycopg_pool hands every returned connection to a worker thread
# (or, async, a task), which cost a send ~50 us and let the next send find no
# connection back yet.
#
# getconn/putconn rather than pool.connection(): that one also enters the connection
# (`with conn`, whose exit commits or rolls back under the connection's lock) and times the
# use for the pool's statistics, ~7 us of a send's ~11 us checkout and return. The pool's
# connections are autocommit, so a transaction is open here only if ``work`` left one
# (a `with conn.transaction()` block closes its own): it is ended as `with conn` would.
@contextmanager
def _pooled(pool: ConnectionPool[psycopg.Connection[Row]]) -> Iterator[psycopg.Connection[Row]]:
    conn = pool.getconn()
    try:
        yield conn
        # A lost connection (its status UNKNOWN) is left alone: putconn discards it, and a
        # commit would raise where `work` already dealt with the loss (Broker._attempts).
        if not conn.broken:
            status = conn.pgconn.transaction_status
            if status == TransactionStatus.INTRANS:
                conn.commit()
            elif status == TransactionStatus.INERROR:
                conn.rollback()
    except BaseException:
        if not (conn.closed or conn.broken) and conn.pgconn.transaction_status != TransactionStatus.IDLE:
            try:
                conn.rollback()
            except Exception as exc:  # a broken connection: putconn discards it
                log.warning("rolling back a pooled connection failed: %s", exc)
        raise
    finally:
        _returned_at[conn] = time.monotonic()
        pool.putconn(conn)


def _check_if_idle(conn: psycopg.Connection[Any]) -> None:
    if time.monotonic() - _returned_at.get(conn, 0.0) > CHECK_IF_IDLE_S:
        ConnectionPool.check_connection(conn)
