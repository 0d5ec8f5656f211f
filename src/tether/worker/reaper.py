"""The reaper: runs in every worker; one worker acts at a time (advisory lock).

Each tick, in this order: expire PENDING tasks past good_until; requeue stale
CLAIMED; retry or fail stale RUNNING; mark silent workers inactive (all in one
transaction); then reconcile workflow steps whose task has ended (including the
ones this tick just failed) and finish workflows, one transaction per workflow
and only when there is any; prune by retention (at most hourly). Between
ticks it sleeps until the next task would turn stale or expire, but never
longer than check_interval_ms, so recovery does not wait for a fixed tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from tether.broker import recovery
from tether.broker.types import Conn, DatabaseError, OperationalError
from tether.config import AppConfig
from tether.db.connection import connect_worker
from tether.workflow import recovery as workflow_recovery

log = logging.getLogger("tether.reaper")

PRUNE_EVERY_S = 3600.0
# Staleness is strict ("older than"): look a little after the moment itself.
AFTER_DUE_S = 0.01
MIN_SLEEP_S = 0.05


class Reaper:
    def __init__(self, url: str, config: AppConfig, heartbeat_interval_s: float) -> None:
        self.url = url
        self.app_config = config
        self.config = config.recovery
        self.worker_stale_ms = 3 * heartbeat_interval_s * 1000
        self._conn: Conn | None = None
        self._last_prune = -PRUNE_EVERY_S  # prune on the first tick that gets the lock

    def _connection(self) -> Conn:
        if self._conn is None or self._conn.closed:
            self._conn = connect_worker(self.url, self.app_config, "reaper")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def tick(self) -> tuple[recovery.Recovered | None, float]:
        """One pass, and how long to sleep after it: one transaction either way.

        The pass is None when another worker's reaper holds the lock (it is acting).
        Reading the next due moment in the same transaction keeps the reaper at one
        commit per tick (heartbeat + reaper = 2 commits per interval per worker).
        """
        conn = self._connection()
        stuck: dict[uuid.UUID, list[uuid.UUID]] = {}
        unfinished: list[uuid.UUID] = []
        with conn.transaction():
            done = self._act(conn) if recovery.take_reaper_lock(conn) else None
            if done is not None:
                # Read in this transaction, so the steps of tasks failed just now are found.
                stuck = workflow_recovery.find_stuck(conn)
                unfinished = workflow_recovery.find_unfinished(conn)
            wait = self._sleep_for(conn)
        if done is None:
            return None, wait
        if stuck or unfinished:
            try:
                settled = workflow_recovery.reconcile(conn, stuck, unfinished)
                done.workflow_steps, done.workflows_finished = settled.steps, settled.finished
            except OperationalError:
                raise
            except DatabaseError as exc:
                log.error("could not reconcile workflow steps: %s", exc)
        if time.monotonic() - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = time.monotonic()
            with conn.transaction():
                recovery.prune(conn, self.config)
        return done, wait

    def _act(self, conn: Conn) -> recovery.Recovered:
        cfg = self.config
        done = recovery.Recovered()
        done.expired = recovery.expire_pending(conn)
        if done.expired:
            log.info("expired %d task(s) past good_until (TASK_EXPIRED)", done.expired)
        if cfg.auto_requeue_stale_claimed:
            done.requeued = recovery.requeue_stale_claimed(conn, cfg.claimed_stale_threshold_ms)
        if cfg.auto_fail_stale_running:
            done.retried, done.failed = recovery.recover_stale_running(conn, cfg.running_stale_threshold_ms)
        try:
            with conn.transaction():
                done.deactivated = recovery.deactivate_stale_workers(conn, self.worker_stale_ms)
        except DatabaseError as exc:
            log.error("could not check workers for stale heartbeats: %s", exc)
        return done

    def _sleep_for(self, conn: Conn) -> float:
        """Until the next thing turns stale or expires, within [MIN_SLEEP_S, check_interval]."""
        check = self.config.check_interval_ms / 1000
        due = recovery.next_due_in(conn, self.config)
        if due is None:
            return check
        return min(check, max(MIN_SLEEP_S, due + AFTER_DUE_S))


async def reaper_loop(reaper: Reaper) -> None:
    backoff = 0.5
    while True:
        try:
            done, wait = await asyncio.to_thread(reaper.tick)
            if done is not None and _full(done):
                wait = 0.0
            backoff = 0.5
        except DatabaseError as exc:
            reaper.close()
            log.error("reaper tick failed: %s; next try in %.1fs", exc, backoff)
            wait = backoff
            backoff = min(backoff * 2, reaper.config.check_interval_ms / 1000)
        await asyncio.sleep(wait)


def _full(done: recovery.Recovered) -> bool:
    """A step hit its batch limit: more is waiting, go again at once."""
    batch = recovery.BATCH
    return (
        done.expired >= batch
        or len(done.requeued) >= batch
        or len(done.retried) + len(done.failed) >= batch
        or done.workflow_steps >= workflow_recovery.BATCH
    )
