"""The worker's heartbeat, a background service (services.py): ONE statement per interval
for the whole worker.

Each beat writes the registry row, a 'claimer' row for every task this worker
holds CLAIMED, and a 'runner' row for every RUNNING task whose child stamped
its slot in time; every few beats it adds a snapshot to tether_worker_states.
However many tasks the worker holds, that is one transaction per interval.

When the reaper planned its next pass on a beat (an idle worker's, beat_rides.py), that
beat is written in the pass's transaction, on the reaper's connection: one commit for
both. If the pass has not written it within a quarter interval (at most a second), the
beat is written alone here after all.

The heartbeat knows the worker only through `BeatSource`: what to report, and where
to send the database's answer (tasks no longer ours; heartbeats getting through).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Protocol

import psutil

from tether.broker import heartbeats
from tether.broker.heartbeats import Beat, BeatAnswer, Snapshot
from tether.broker.types import Conn
from tether.config import AppConfig, RecoveryConfig
from tether.db.connection import AsyncDedicatedConnection
from tether.metrics import hooks, recovery_tally
from tether.worker.backoff import Backoff
from tether.worker.beat_rides import PassRider
from tether.worker.services import Service

log = logging.getLogger("tether.worker.heartbeat")

SNAPSHOT_EVERY = 10  # beats between two tether_worker_states rows
RETRY_AFTER_FAILURE_S = 0.2


class BeatSource(Protocol):
    """What the heartbeat needs from the worker."""

    @property
    def tasks_done(self) -> int:
        """Tasks whose outcome this worker's children recorded, for the snapshots."""
        ...

    def collect(self) -> Beat:
        """Every task held, in the role it is held in; also the moment to kill hung children."""
        ...

    def answered(self, answer: BeatAnswer) -> None:
        """A beat got through: the tasks reported that the worker no longer holds, and those
        whose cancel was requested."""
        ...


def interval_s(config: RecoveryConfig) -> float:
    return min(config.claimer_heartbeat_interval_ms, config.runner_heartbeat_interval_ms) / 1000


def resources() -> tuple[int | None, float | None]:
    """Resident memory of the main process and its children, and the main process's CPU."""
    try:
        me = psutil.Process()
        rss = me.memory_info().rss
        for child in me.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except psutil.Error:
                continue
        return rss, me.cpu_percent(interval=None)
    except psutil.Error as exc:
        log.debug("could not read resource usage: %s", exc)
        return None, None


class Heartbeat(Service):
    """Writes the beat on a connection of its own, once per interval.

    Not through the worker's pool: a pool that lost its connections (database
    restart, pg_terminate_backend) hands out new ones only after seconds of
    backoff, and a heartbeat must get through at once or the worker isolates itself.
    So a beat that fails is tried again soon (RETRY_AFTER_FAILURE_S), not a beat later.
    """

    name = "heartbeat"
    log = log
    failure_level = logging.WARNING

    def __init__(
        self,
        url: str,
        config: AppConfig,
        worker_id: str,
        hostname: str,
        source: BeatSource,
        every: float,
        queues: list[str] | None = None,
    ) -> None:
        """``queues``: the beat also reads when their schedules' next slot comes (BeatAnswer)."""
        retry = min(every, RETRY_AFTER_FAILURE_S)
        super().__init__(Backoff(retry, retry))
        self.connection = AsyncDedicatedConnection(url, config, "heartbeat")
        self.worker_id = worker_id
        self.hostname = hostname
        self.source = source
        self.every = every
        self.queues = queues
        self.beats = 0  # written so far
        self.rider: PassRider | None = None  # the reaper, whose pass may carry a beat
        self.next_at: float | None = None  # time.monotonic() of the next beat (beat_rides.BeatClock)
        self.last_ok = time.monotonic()  # when the last beat got through (the isolation watch reads it)
        self._tried = False

    async def tick(self) -> float:
        """Write one beat within the interval, hand the database's answer to the worker."""
        if not self._tried:
            # Silence counts from the first try: the start-up before it (children spawning
            # on a busy host) is no silence, and must not make the worker isolate itself.
            self._tried = True
            self.last_ok = time.monotonic()
        beat = self.source.collect()
        snapshot = None
        if self.beats % SNAPSHOT_EVERY == 0:
            snapshot = Snapshot(self.source.tasks_done, *resources())
        # Opening a connection (after a failed beat) is not part of the beat's time limit:
        # over a slow link the handshake alone takes two round trips, and a limit that
        # counted it would fail every beat from then on. connect_timeout bounds it.
        self.next_at = None  # unknown until this beat got through
        try:
            sent = time.monotonic()
            rider = self.rider if self.rider is not None and self.rider.wants_ride(sent) else None
            rode = rider is not None
            answer = await self._ride(rider, beat, snapshot, sent) if rider is not None else None
            if answer is None:
                conn = await self.connection.get()  # a beat that cannot connect failed too
                if not rode:
                    # (After a ride that did not carry it, the beat keeps its moment: the next
                    # is an interval after it, where the reaper planned its next pass.)
                    sent = time.monotonic()
                answer = await asyncio.wait_for(
                    heartbeats.write_heartbeats(
                        conn,
                        worker_id=self.worker_id,
                        hostname=self.hostname,
                        beat=beat,
                        snapshot=snapshot,
                        queues=self.queues,
                    ),
                    self.every,
                )
        except Exception:
            hooks.heartbeat(None)
            raise
        hooks.heartbeat(time.monotonic() - sent)
        # The database stamped this beat after it was sent: silence counted from the sending,
        # not from the answer, keeps the isolation watch ahead of every reaper however long
        # the answer took to come back.
        self.last_ok = sent
        self.next_at = sent + self.every
        self.beats += 1
        self.source.answered(dataclasses.replace(answer, sent_at=sent))
        await self._record_recoveries()
        # Beats are sent an interval apart, however long each took: the gaps the reaper sees
        # stay one interval, not an interval plus a round trip.
        return max(0.0, self.every - (time.monotonic() - sent))

    async def _ride(
        self, rider: PassRider, beat: Beat, snapshot: Snapshot | None, sent: float
    ) -> BeatAnswer | None:
        """The beat written by the reaper's pass, which was planned on it; None: write it here."""

        def write(conn: Conn) -> BeatAnswer:
            return heartbeats.write_heartbeats_sync(
                conn,
                worker_id=self.worker_id,
                hostname=self.hostname,
                beat=beat,
                snapshot=snapshot,
                queues=self.queues,
            )

        try:
            return await rider.ride(write, sent + self.every)
        except Exception as exc:
            log.debug("the reaper's pass did not carry the beat (%r): written alone", exc)
            return None

    async def _record_recoveries(self) -> None:
        """The recoveries tallied since the last beat, for the dashboard's chart: one more
        statement, only when there were any. A failure keeps them for a later beat and is no
        failed beat: the heartbeat itself got through."""
        tally = recovery_tally.take()
        if not tally:
            return
        # Imported here, on a worker's first recovery: the dashboard's chart queries (and
        # broker.health's) are no part of a worker's start-up (bench/README.md "Start-up").
        from tether.broker import charts

        try:
            conn = await self.connection.get()
            await asyncio.wait_for(charts.record_recoveries(conn, tally), self.every)
        except Exception as exc:
            recovery_tally.give_back(tally)
            log.warning("could not record %d recovery count(s) for the dashboard: %s", len(tally), exc)

    async def close(self) -> None:
        await self.connection.close()  # a beat cut short by its timeout leaves it unusable
