"""The worker's heartbeat writer: ONE statement per interval for the whole worker.

Each beat writes the registry row, a 'claimer' row for every task this worker
holds CLAIMED, and a 'runner' row for every RUNNING task whose child stamped
its slot in time; every few beats it adds a snapshot to tether_worker_states.
However many tasks the worker holds, that is one transaction per interval.

The writer knows the worker only through `BeatSource`: what to report, and where
to send the database's answer (tasks no longer ours; heartbeats getting through).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import psutil

from tether.broker import heartbeats
from tether.broker.heartbeats import Beat, BeatAnswer, Snapshot
from tether.broker.types import AsyncConn, DatabaseError
from tether.config import AppConfig, RecoveryConfig
from tether.db.connection import connect_worker_async

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


class HeartbeatWriter:
    """Writes the beat on a connection of its own.

    Not through the worker's pool: a pool that lost its connections (database
    restart, pg_terminate_backend) hands out new ones only after seconds of
    backoff, and a heartbeat must get through at once or the worker isolates itself.
    """

    def __init__(self, url: str, config: AppConfig, worker_id: str, hostname: str) -> None:
        self.url = url
        self.config = config
        self.worker_id = worker_id
        self.hostname = hostname
        self.last_ok = time.monotonic()
        self._conn: AsyncConn | None = None

    async def write(self, beat: Beat, snapshot: Snapshot | None, timeout: float) -> BeatAnswer:
        """Write one beat within ``timeout``; returns what the database said of its tasks."""
        try:
            return await asyncio.wait_for(self._write(beat, snapshot), timeout)
        except (DatabaseError, OSError, TimeoutError):
            await self.close()  # a fresh connection for the next try
            raise

    async def _write(self, beat: Beat, snapshot: Snapshot | None) -> BeatAnswer:
        if self._conn is None or self._conn.closed:
            self._conn = await connect_worker_async(self.url, self.config, "heartbeat")
        answer = await heartbeats.write_heartbeats(
            self._conn, worker_id=self.worker_id, hostname=self.hostname, beat=beat, snapshot=snapshot
        )
        self.last_ok = time.monotonic()
        return answer

    async def close(self) -> None:
        if self._conn is not None and not self._conn.closed:
            with contextlib.suppress(DatabaseError, OSError):  # closing a broken connection: nothing to save
                await self._conn.close()
        self._conn = None


async def heartbeat_loop(source: BeatSource, writer: HeartbeatWriter, every: float) -> None:
    beats = 0
    while True:
        beat = source.collect()
        snapshot = None
        if beats % SNAPSHOT_EVERY == 0:
            snapshot = Snapshot(source.tasks_done, *resources())
        try:
            answer = await writer.write(beat, snapshot, timeout=every)
        except (DatabaseError, OSError, TimeoutError) as exc:
            silent = time.monotonic() - writer.last_ok
            log.warning("heartbeat failed (%s); none written for %.1fs", exc or type(exc).__name__, silent)
            await asyncio.sleep(min(every, RETRY_AFTER_FAILURE_S))  # try again soon, not a beat later
            continue
        beats += 1
        source.answered(answer)
        await asyncio.sleep(every)
