"""The reaper, a background service (services.py): runs in every worker; one worker acts at a
time (advisory lock).

Each tick, in this order: expire PENDING tasks past good_until; requeue stale
CLAIMED; retry or fail stale RUNNING; mark silent workers inactive (all in one
transaction); then reconcile workflow steps whose task has ended (including the
ones this tick just failed) and finish workflows, one transaction per workflow
and only when there is any; then, once a minute, delete what is past its retention, in
small batches (worker/retention.py). Between ticks it sleeps until the next task would turn stale or
expire, but never longer than check_interval_ms, so recovery does not wait for a fixed
tick; when a step filled its batch, it goes again at once, and when retention is behind,
after PRUNE_AGAIN_S. On a database error it tries again after 0.5 s, backing off up to
check_interval_ms.
"""

from __future__ import annotations

import logging
import uuid

from tether.broker import recovery
from tether.broker.types import Conn, DatabaseError, OperationalError
from tether.config import AppConfig
from tether.db.connection import DedicatedConnection
from tether.worker.backoff import Backoff
from tether.worker.retention import Retention
from tether.worker.services import Service
from tether.workflow import recovery as workflow_recovery

log = logging.getLogger("tether.reaper")

# Retention used its budget with rows left: the next pass this soon.
PRUNE_AGAIN_S = 0.1
# Staleness is strict ("older than"): look a little after the moment itself.
AFTER_DUE_S = 0.01
MIN_SLEEP_S = 0.05


class Reaper(Service):
    name = "reaper tick"
    log = log

    def __init__(self, url: str, config: AppConfig, heartbeat_interval_s: float) -> None:
        self.config = config.recovery
        super().__init__(Backoff(0.5, max(0.5, self.config.check_interval_ms / 1000)))
        self.connection = DedicatedConnection(url, config, "reaper")
        self.worker_stale_ms = 3 * heartbeat_interval_s * 1000
        self.retention = Retention(self.config)
        self.last: recovery.Recovered | None = None  # what the last pass did (None: another reaper acted)

    async def tick(self) -> float:
        """One pass (in a thread); the seconds until the next: 0 when a step filled its batch."""
        done, wait = await self.in_thread(self.run_once)
        self.last = done
        return 0.0 if done is not None and _full(done) else wait

    async def close(self) -> None:
        await self.round_over()
        self.connection.close()

    def run_once(self) -> tuple[recovery.Recovered | None, float]:
        """One pass, and how long to sleep after it: one transaction either way.

        The pass is None when another worker's reaper holds the lock (it is acting).
        Reading the next due moment in the same transaction keeps the reaper at one
        commit per tick (heartbeat + reaper = 2 commits per interval per worker).
        """
        conn = self.connection.get()
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
        if self.retention.due:
            self.retention.run(conn)  # one commit per batch
        if self.retention.behind:
            wait = min(wait, PRUNE_AGAIN_S)
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
        except OperationalError:
            raise  # the connection is gone: the whole tick failed, and is tried again
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


def _full(done: recovery.Recovered) -> bool:
    """A step hit its batch limit: more is waiting, go again at once."""
    batch = recovery.BATCH
    return (
        done.expired >= batch
        or len(done.requeued) >= batch
        or len(done.retried) + len(done.failed) >= batch
        or done.workflow_steps >= workflow_recovery.BATCH
    )
