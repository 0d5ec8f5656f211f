"""The reaper, a background service (services.py): runs in every worker; for the whole fleet,
one pass per due moment (broker/reaper_passes.py, one row of tether_reaper).

A tick first reads when the fleet's next pass is due (one statement; not after a pass of
its own, whose next moment it set itself). Not yet: it sleeps until then. Due: it claims
the pass in the transaction that does it, and only one worker gets it. A pass, in this
order: expire PENDING tasks past good_until; requeue stale CLAIMED; retry or fail stale
RUNNING; mark silent workers inactive; read the workflow
steps to reconcile and when the next task turns stale or expires; write that moment to the
row as the fleet's next pass (all in one transaction); then reconcile workflow steps and
finish workflows, one transaction per workflow and only when there is any; then, at most
once a minute per worker, delete what is past its retention, in small batches
(worker/retention.py). A worker whose retention is behind (it used its budget with rows
left) prunes again after PRUNE_AGAIN_S, between the fleet's passes too. The next pass is
due when the next task would turn stale or expire, but never later than check_interval_ms,
so recovery does not wait for a fixed tick; at once when a step filled its batch. Each
worker sleeps until that moment plus a little jitter, so the fleet's wake-ups spread and
one of them claims it. On a database error it tries again after 0.5 s, backing off up to
check_interval_ms.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid

from tether.broker import limited_claims, reaper_passes, recovery
from tether.broker.types import Conn, DatabaseError, OperationalError
from tether.config import AppConfig
from tether.metrics import hooks
from tether.worker.backoff import Backoff
from tether.worker.retention import Retention
from tether.worker.services import Service
from tether.worker.shared_connection import SharedConnection
from tether.workflow import recovery as workflow_recovery

log = logging.getLogger("tether.reaper")

# Retention used its budget with rows left: the next pass this soon.
PRUNE_AGAIN_S = 0.1
# Staleness is strict ("older than"): look a little after the moment itself.
AFTER_DUE_S = 0.01
MIN_SLEEP_S = 0.05
# Workers that read the same due moment wake within this spread, up to a tenth of the
# sleep: the first claims the pass, and the later ones, finding it done, sleep again.
# Those that wake while it runs cost a claim each, so the spread is wide against a pass's
# length. It delays a pass by at most this much (by about spread / workers in a fleet).
JITTER_MAX_S = 1.0
# Due, but another worker's pass holds it: it is running, and will set the next moment.
# Looking again only covers its worker dying mid-pass (the pass rolls back, still due):
# after this fraction of BUSY_LOOK_S, or of the check interval if that is shorter (on a
# starved machine a pass can take seconds, and a fleet must not poll it meanwhile).
BUSY_SLEEP = (0.5, 1.0)
BUSY_LOOK_S = 5.0


class Reaper(Service):
    name = "reaper tick"
    log = log

    def __init__(
        self,
        url: str,
        config: AppConfig,
        heartbeat_interval_s: float,
        worker_id: str | None = None,
        connection: SharedConnection | None = None,
    ) -> None:
        """``connection``: the main process's shared one (closed by its owner); else its own."""
        self.config = config.recovery
        super().__init__(Backoff(0.5, max(0.5, self.config.check_interval_ms / 1000)))
        self._owns_connection = connection is None
        self.connection = connection or SharedConnection(url, config, "reaper")
        self.worker_id = worker_id  # written to tether_reaper with each pass it does
        self.worker_stale_ms = 3 * heartbeat_interval_s * 1000
        self.retention = Retention(self.config)
        self.last: recovery.Recovered | None = None  # what this tick's pass did (None: no pass here)
        self.passes = 0  # passes this worker did
        self._did_last_pass = False  # this worker did the fleet's last pass (as far as it knows)

    async def tick(self) -> float:
        """One tick (in a thread); the seconds until the next, with jitter: 0 when a step filled its batch."""
        done, wait = await self.in_thread(self.run_once)
        self.last = done
        hooks.reaper_pass(done)
        if done is not None and _full(done):
            return 0.0
        return wait + random.uniform(0.0, min(JITTER_MAX_S, wait / 10))

    async def close(self) -> None:
        await self.round_over()
        if self._owns_connection:
            await asyncio.to_thread(self.connection.close)

    def run_once(self) -> tuple[recovery.Recovered | None, float]:
        """One tick, on the connection's turn (see _tick)."""
        with self.connection.turn() as conn:
            return self._tick(conn)

    def _tick(self, conn: Conn) -> tuple[recovery.Recovered | None, float]:
        """One tick, and how long to sleep after it.

        The pass is None when it was not this worker's to do: not due yet (one read), or
        another worker claimed it. A pass is one transaction, the claim, the next due
        moment and the workflow steps to reconcile included (heartbeat + reaper = 2
        commits per interval for the worker that does the pass, 1 for the others; the
        others' ticks are reads).
        """
        cfg = self.config
        # A worker that did the last pass set the moment of the next itself, and sleeps until
        # then: it claims at once, without the read first (the claim says so if another worker
        # moved the moment meanwhile). A lone worker's pass is then one transaction, not two.
        if not self._did_last_pass:
            due = reaper_passes.due_in(conn, cfg.check_interval_ms)
            if due.due_in_s > 0:
                return None, self._not_due(conn, due.due_in_s)
            if due.running:
                return None, self._busy_sleep()
        stuck: dict[uuid.UUID, list[uuid.UUID]] = {}
        unfinished: list[uuid.UUID] = []
        done, wait = recovery.Recovered(), 0.0
        with conn.transaction():
            turn = reaper_passes.claim(conn, self.worker_id, cfg.check_interval_ms)
            self._did_last_pass = turn.pass_number is not None
            if turn.pass_number is not None:
                done = self._act(conn)
                # Read in this transaction, so the steps of tasks failed just now are found.
                stuck = workflow_recovery.find_stuck(conn)
                unfinished = workflow_recovery.find_unfinished(conn)
                more = _full(done) or sum(map(len, stuck.values())) >= workflow_recovery.BATCH
                wait = 0.0 if more else self._sleep_for(conn)
                reaper_passes.schedule_next(conn, wait)
        if turn.pass_number is None:
            if turn.due_in_s > 0:  # another worker claimed it first (or moved the moment)
                return None, self._not_due(conn, turn.due_in_s)
            return None, self._busy_sleep()  # another worker is doing it now
        self.passes += 1
        log.debug(
            "reaper pass %d done by worker %s; the next is due in %.2fs",
            turn.pass_number,
            self.worker_id,
            wait,
        )
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

    def _not_due(self, conn: Conn, due_in_s: float) -> float:
        """Not the fleet's pass yet: this worker's pruning goes on if it is behind."""
        if self.retention.behind:
            self.retention.run(conn)
            if self.retention.behind:
                return PRUNE_AGAIN_S
        return self._clamp(due_in_s)

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
        try:
            # Per-key rate buckets that refilled to full say nothing (no row is a full bucket):
            # dropped here, in the pass's transaction, so they do not pile up with keys.
            with conn.transaction():
                limited_claims.prune_key_tokens(conn)
        except OperationalError:
            raise
        except DatabaseError as exc:
            log.error("could not prune per-key rate buckets: %s", exc)
        return done

    def _sleep_for(self, conn: Conn) -> float:
        """Until the next thing turns stale or expires, within [MIN_SLEEP_S, check_interval]."""
        due = recovery.next_due_in(conn, self.config)
        if due is None:
            return self.config.check_interval_ms / 1000
        return self._clamp(due + AFTER_DUE_S)

    def _busy_sleep(self) -> float:
        return random.uniform(*BUSY_SLEEP) * min(BUSY_LOOK_S, self.config.check_interval_ms / 1000)

    def _clamp(self, seconds: float) -> float:
        return min(self.config.check_interval_ms / 1000, max(MIN_SLEEP_S, seconds))


def _full(done: recovery.Recovered) -> bool:
    """A step hit its batch limit: more is waiting, go again at once."""
    batch = recovery.BATCH
    return (
        done.expired >= batch
        or len(done.requeued) >= batch
        or len(done.retried) + len(done.failed) >= batch
        or done.workflow_steps >= workflow_recovery.BATCH
    )
