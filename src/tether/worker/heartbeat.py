"""The worker's heartbeat writer: ONE statement per interval for the whole worker.

Each beat writes the registry row, a 'claimer' row for every task this worker
holds CLAIMED, and a 'runner' row for every RUNNING task whose child stamped
its slot in time; every few beats it adds a snapshot to tether_worker_states.
However many tasks the worker holds, that is one transaction per interval.

The same loop watches the children's stamps (a child silent past the running
stale threshold is hung: it is killed and its task recorded as crashed), and
fences the worker off when the database has been unreachable for so long that
the reaper elsewhere will treat this worker as dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil
import psycopg
from psycopg.rows import dict_row

from tether.broker.queries import q
from tether.config import AppConfig

if TYPE_CHECKING:
    from tether.worker.main import Worker

log = logging.getLogger("tether.worker.heartbeat")

SNAPSHOT_EVERY = 10  # beats between two tether_worker_states rows
RETRY_AFTER_FAILURE_S = 0.2


@dataclass
class Beat:
    task_ids: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    running: int = 0
    claimed: int = 0

    def add(self, task_id: str, role: str, pid: int) -> None:
        self.task_ids.append(task_id)
        self.roles.append(role)
        self.pids.append(pid)
        if role == "runner":
            self.running += 1
        else:
            self.claimed += 1


def interval_s(worker: Worker) -> float:
    rc = worker.app.config.recovery
    return min(rc.claimer_heartbeat_interval_ms, rc.runner_heartbeat_interval_ms) / 1000


def collect(worker: Worker) -> Beat:
    """What this beat reports: every task the worker holds, in the role it holds it."""
    assert worker.supervisor is not None
    rc = worker.app.config.recovery
    fresh_within = 2 * rc.runner_heartbeat_interval_ms / 1000
    beat = Beat()
    main_pid = os.getpid()
    for task in worker.buffer:
        beat.add(task.id, "claimer", main_pid)
    for slot in worker.supervisor.alive():
        if slot.current is not None:
            if not slot.running:
                beat.add(slot.current.id, "claimer", main_pid)
            elif slot.pid is not None and (slot.frozen or worker.supervisor.stamp_age(slot) <= fresh_within):
                # A frozen child's task is reported too: the answer ('lost' or not)
                # decides whether it is resumed or killed, right after this beat.
                beat.add(slot.current.id, "runner", slot.pid)
        for task in slot.queued:
            beat.add(task.id, "claimer", main_pid)
    return beat


def kill_hung_children(worker: Worker) -> None:
    """A child whose heartbeat thread has not stamped past the running threshold is hung."""
    assert worker.supervisor is not None
    limit = worker.app.config.recovery.running_stale_threshold_ms / 1000
    for slot in worker.supervisor.alive():
        if slot.running and not slot.frozen and slot.current is not None and slot.process.is_alive():
            age = worker.supervisor.stamp_age(slot)
            if age > limit:
                log.error(
                    "child %d (pid %s) running task %s (%s) has not stamped its heartbeat for %.1fs "
                    "(hung, or the GIL is held): killing it",
                    slot.index,
                    slot.pid,
                    slot.current.id,
                    slot.current.name,
                    age,
                )
                slot.process.kill()  # the supervisor sees the exit and records the crash


def resources(worker: Worker) -> tuple[int | None, float | None]:
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
    backoff, and a heartbeat must get through at once or the worker fences itself.
    """

    def __init__(self, url: str, config: AppConfig, session: dict[str, Any]) -> None:
        self.url = url
        self.session = session
        self.connect_timeout = max(2, round(config.broker.connect_timeout_s))
        self.last_ok = time.monotonic()
        self._conn: psycopg.AsyncConnection[dict[str, Any]] | None = None

    async def write(self, params: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(self._write(params), timeout)
        except (psycopg.Error, OSError, TimeoutError):
            await self.close()  # a fresh connection for the next try
            raise

    async def _write(self, params: dict[str, Any]) -> dict[str, Any] | None:
        if self._conn is None or self._conn.closed:
            self._conn = await psycopg.AsyncConnection.connect(
                self.url,
                autocommit=True,
                row_factory=dict_row,
                connect_timeout=self.connect_timeout,
                application_name="tether-heartbeat",
                **self.session,
            )
        cur = await self._conn.execute(q("write_heartbeats"), params)
        row = await cur.fetchone()
        self.last_ok = time.monotonic()
        return row

    async def close(self) -> None:
        if self._conn is not None and not self._conn.closed:
            with contextlib.suppress(psycopg.Error, OSError):
                await self._conn.close()
        self._conn = None


async def heartbeat_loop(worker: Worker, writer: HeartbeatWriter) -> None:
    every = interval_s(worker)
    beats = 0
    while True:
        kill_hung_children(worker)
        beat = collect(worker)
        snapshot = beats % SNAPSHOT_EVERY == 0
        rss, cpu = resources(worker) if snapshot else (None, None)
        params: dict[str, Any] = {
            "worker_id": worker.worker_id,
            "hostname": worker.identity.hostname,
            "task_ids": beat.task_ids,
            "roles": beat.roles,
            "pids": beat.pids,
            "snapshot": snapshot,
            "running": beat.running,
            "claimed": beat.claimed,
            "tasks_done": worker.tasks_done,
            "rss_bytes": rss,
            "cpu_percent": cpu,
        }
        try:
            row = await writer.write(params, timeout=every)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            silent = time.monotonic() - writer.last_ok
            log.warning("heartbeat failed (%s); none written for %.1fs", exc or type(exc).__name__, silent)
            await asyncio.sleep(min(every, RETRY_AFTER_FAILURE_S))  # try again soon, not a beat later
            continue
        beats += 1
        lost = set(row["lost"]) if row and row["lost"] else set()
        if worker.fenced:
            worker.unfence(lost)
        if lost:
            worker.on_lost(lost)
        await asyncio.sleep(every)


async def fence_watch(worker: Worker, writer: HeartbeatWriter) -> None:
    """Fence the worker off before any reaper may declare it dead.

    A reaper elsewhere may act once the last heartbeat is older than the running
    stale threshold. Waiting for a failed write to notice would be too late (a
    write can hang for seconds), so this clock runs on its own and fences a
    margin before that moment: then no task's code runs here and on a
    crash-retrying worker at the same time.
    """
    rc = worker.app.config.recovery
    every = interval_s(worker)
    fence_after = rc.running_stale_threshold_ms / 1000 - max(0.1, every / 4)
    while True:
        await asyncio.sleep(min(0.1, every / 10))
        silent = time.monotonic() - writer.last_ok
        if silent > fence_after and not worker.fenced:
            worker.fence(silent)
