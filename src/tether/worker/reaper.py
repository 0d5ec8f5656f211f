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
check_interval_ms. When nothing is due before the check interval, the worker that did the
pass plans the next one on its own heartbeat, in the beat's transaction (beat_rides.py):
an idle worker commits once per interval, not twice.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid

from tether.broker import limited_claims, reaper_passes, recovery
from tether.broker.heartbeats import BeatAnswer
from tether.broker.types import Conn, DatabaseError, OperationalError
from tether.config import AppConfig
from tether.metrics import hooks
from tether.worker import beat_rides
from tether.worker.backoff import Backoff
from tether.worker.retention import Retention
from tether.worker.services import Service
from tether.worker.shared_connection import SharedConnection
from tether.workflow import recovery as workflow_recovery

log = logging.getLogger("tether.reaper")

#: A tick's outcome: the pass (None: not this worker's), seconds to the next tick, and the
#: answer to the beat it carried (None: it carried none).
_Round = tuple[recovery.Recovered | None, float, BeatAnswer | None]

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
        beats: beat_rides.BeatClock | None = None,
    ) -> None:
        """``connection``: the main process's shared one (closed by its owner); else its own.
        ``beats``: the worker's heartbeat, whose beats an idle pass rides on (beat_rides.py)."""
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
        self.beats = beats
        self.rides = 0  # passes that carried a beat
        self._ride_at: float | None = None  # the beat (time.monotonic()) the next pass rides on
        self._ride: beat_rides.Ride | None = None  # a beat handed over, for the next round

    async def tick(self) -> float:
        """One tick (in a thread); the seconds until the next, with jitter: 0 when a step filled its batch."""
        ride, self._ride = self._ride, None
        if ride is not None and not ride.wanted:
            ride = None  # the heartbeat stopped waiting for it
        fallback = self._ride_fallback_in()
        if ride is None and fallback is not None and fallback > 0:
            # The next pass rides on a beat that has not come yet; only pruning that is
            # behind goes on meanwhile.
            if not self.retention.behind:
                return fallback
            until = fallback
            return await self.in_thread(lambda: self._prune_meanwhile(until))
        try:
            done, wait, answer = await self.in_thread(lambda: self._run(ride))
        except BaseException as exc:
            self._ride_at = None  # back to the fleet's own schedule until a pass plans again
            if ride is not None and not ride.answer.done():
                if isinstance(exc, Exception):
                    ride.answer.set_exception(exc)
                else:
                    ride.answer.cancel()
            raise
        if ride is not None and answer is not None:
            self.rides += 1  # its answer went to the heartbeat as the transaction committed
        elif ride is not None and not ride.answer.done():
            ride.answer.set_exception(RuntimeError("the pass left the beat out"))
        self.last = done
        hooks.reaper_pass(done)
        if done is not None and _full(done):
            return 0.0
        fallback = self._ride_fallback_in()
        if fallback is not None:  # no jitter: the beat is the moment, this only covers its absence
            return min(fallback, PRUNE_AGAIN_S) if self.retention.behind else fallback
        return wait + random.uniform(0.0, min(JITTER_MAX_S, wait / 10))

    async def close(self) -> None:
        self._ride_at = None  # a stopped reaper carries no beat: the heartbeat writes its own
        await self.round_over()
        if self._owns_connection:
            await asyncio.to_thread(self.connection.close)

    # -- riding on the heartbeat (beat_rides.py) ---------------------------------------------

    def wants_ride(self, now: float) -> bool:
        ride_at = self._ride_at
        return ride_at is not None and self.beats is not None and now >= ride_at - self._slack()

    async def ride(self, write: beat_rides.BeatWriter, next_beat_at: float) -> BeatAnswer:
        ride = beat_rides.Ride(write, next_beat_at, asyncio.get_running_loop().create_future())
        self._ride = ride
        self.wake()
        try:
            return await asyncio.wait_for(asyncio.shield(ride.answer), self._slack())
        except BaseException:
            ride.abandoned.set()
            if not ride.answer.done():
                ride.answer.cancel()
            raise

    def _slack(self) -> float:
        return beat_rides.slack(self.beats.every) if self.beats is not None else 0.0

    def _ride_fallback_in(self) -> float | None:
        """Seconds until this worker does the planned pass itself, the beat not having come."""
        if self._ride_at is None:
            return None
        return self._ride_at + self._slack() - time.monotonic()

    def _prune_meanwhile(self, fallback: float) -> float:
        with self.connection.turn() as conn:
            self.retention.run(conn)
        return min(fallback, PRUNE_AGAIN_S) if self.retention.behind else fallback

    # -- the tick ------------------------------------------------------------------------------

    def run_once(self) -> tuple[recovery.Recovered | None, float]:
        """One tick, on the connection's turn (see _tick)."""
        done, wait, _answer = self._run(None)
        return done, wait

    def _run(self, ride: beat_rides.Ride | None) -> _Round:
        with self.connection.turn() as conn:
            return self._tick(conn, ride)

    def _tick(self, conn: Conn, ride: beat_rides.Ride | None = None) -> _Round:
        """One tick, how long to sleep after it, and the answer to the beat it carried.

        The pass is None when it was not this worker's to do: not due yet (one read), or
        another worker claimed it. A pass is one transaction, the claim, the next due
        moment and the workflow steps to reconcile included; ``ride``'s beat too, when the
        heartbeat handed one over (then also when the pass went to another worker). An
        idle worker's passes ride on its beats: one commit per interval, the beat's.
        """
        cfg = self.config
        began = time.monotonic()
        self._ride_at = None  # this is the planned pass (or the fleet's schedule took over)
        # A worker that did the last pass set the moment of the next itself, and sleeps until
        # then: it claims at once, without the read first (the claim says so if another worker
        # moved the moment meanwhile). A lone worker's pass is then one transaction, not two.
        if ride is None and not self._did_last_pass:
            due = reaper_passes.due_in(conn, cfg.check_interval_ms)
            if due.due_in_s > 0:
                return None, self._not_due(conn, due.due_in_s), None
            if due.running:
                return None, self._busy_sleep(), None
        stuck: dict[uuid.UUID, list[uuid.UUID]] = {}
        unfinished: list[uuid.UUID] = []
        done, wait, answer = recovery.Recovered(), 0.0, None
        early = self._slack() if ride is not None else 0.0
        with conn.transaction():
            turn = reaper_passes.claim(conn, self.worker_id, cfg.check_interval_ms, early)
            self._did_last_pass = turn.pass_number is not None
            if turn.pass_number is not None:
                done = self._act(conn)
            # After the pass's recovery (its answer then says which of our tasks it took),
            # before what reads the heartbeats (next_due_in counts this beat's). Late in the
            # transaction: the worker's registry row stays locked for the rest of it only.
            if ride is not None and ride.wanted:
                answer = ride.write(conn)
            if turn.pass_number is not None:
                # Read in this transaction, so the steps of tasks failed just now are found.
                stuck = workflow_recovery.find_stuck(conn)
                unfinished = workflow_recovery.find_unfinished(conn)
                more = _full(done) or sum(map(len, stuck.values())) >= workflow_recovery.BATCH
                wait, idle = (0.0, False) if more else self._sleep_for(conn)
                ride_at = self._plan_ride(began, wait, ride) if idle else None
                if ride_at is not None:
                    # The planned beat's moment, on the database's clock as closely as it can
                    # be told: from this statement's own moment, not the transaction's start
                    # (which a loaded machine may have begun well after ``began``).
                    wait = ride_at - time.monotonic()
                    reaper_passes.schedule_next_from_now(conn, wait)
                else:
                    reaper_passes.schedule_next(conn, wait)
        if ride is not None and answer is not None:
            ride.deliver(answer)
        if turn.pass_number is None:
            if turn.due_in_s > 0:  # another worker claimed it first (or moved the moment)
                return None, self._not_due(conn, turn.due_in_s), answer
            return None, self._busy_sleep(), answer  # another worker is doing it now
        self.passes += 1
        log.debug(
            "reaper pass %d done by worker %s; the next is due in %.2fs%s",
            turn.pass_number,
            self.worker_id,
            wait,
            " (riding on a beat)" if self._ride_at is not None else "",
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
        return done, wait, answer

    def _plan_ride(self, began: float, wait: float, ride: beat_rides.Ride | None) -> float | None:
        """Nothing is due before the check interval: the next pass at the last beat before it
        is due, if one comes (beat_rides.plan); its time.monotonic(), also set as the plan."""
        if self.beats is None:
            return None
        next_beat_at = ride.next_beat_at if ride is not None else self.beats.next_at
        self._ride_at = beat_rides.plan(began, wait, next_beat_at, self.beats.every, time.monotonic())
        return self._ride_at

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
        if cfg.auto_requeue_stale_claimed or cfg.auto_fail_stale_running:
            # Workers that opted in, whose listener session closed: their process is gone. In a
            # savepoint of its own: an error here must not cost the pass the rules above.
            try:
                closed = recovery.recover_closed_sessions(
                    conn, requeue=cfg.auto_requeue_stale_claimed, fail=cfg.auto_fail_stale_running
                )
                done.session_closed, done.deactivated = closed.session_closed, closed.deactivated
            except OperationalError:
                raise
            except DatabaseError as exc:
                log.error("could not check workers for closed listener sessions: %s", exc)
        try:
            with conn.transaction():
                done.deactivated += recovery.deactivate_stale_workers(conn, self.worker_stale_ms)
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

    def _sleep_for(self, conn: Conn) -> tuple[float, bool]:
        """Until the next thing turns stale or expires, within [MIN_SLEEP_S, check_interval];
        and whether nothing does before the check interval (the pass may ride on a beat)."""
        check = self.config.check_interval_ms / 1000
        due = recovery.next_due_in(conn, self.config)
        if due is None or due + AFTER_DUE_S >= check:
            return check, True
        return self._clamp(due + AFTER_DUE_S), False

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
        or len(done.session_closed) >= batch
        or done.workflow_steps >= workflow_recovery.BATCH
    )
