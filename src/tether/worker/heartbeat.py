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
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil
import psycopg

if TYPE_CHECKING:
    from tether.worker.main import Worker

log = logging.getLogger("tether.worker.heartbeat")

SNAPSHOT_EVERY = 10  # beats between two tether_worker_states rows


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
            elif worker.supervisor.stamp_age(slot) <= fresh_within and slot.pid is not None:
                beat.add(slot.current.id, "runner", slot.pid)
        if slot.next is not None:
            beat.add(slot.next.id, "claimer", main_pid)
    return beat


def kill_hung_children(worker: Worker) -> None:
    """A child whose heartbeat thread has not stamped past the running threshold is hung."""
    assert worker.supervisor is not None
    limit = worker.app.config.recovery.running_stale_threshold_ms / 1000
    for slot in worker.supervisor.alive():
        if slot.running and slot.current is not None and slot.process.is_alive():
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


async def heartbeat_loop(worker: Worker) -> None:
    every = interval_s(worker)
    fence_after = worker.app.config.recovery.running_stale_threshold_ms / 1000
    last_ok = time.monotonic()
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
            row = await worker.fetchone("write_heartbeats", params)
            last_ok = time.monotonic()
            beats += 1
            if worker.fenced:
                worker.unfence()
            if row and row["lost"]:
                worker.on_lost(set(row["lost"]))
        except (psycopg.Error, OSError) as exc:
            silent = time.monotonic() - last_ok
            log.warning("heartbeat failed (%s); no heartbeat written for %.1fs", exc, silent)
            if silent > fence_after and not worker.fenced:
                worker.fence(silent)
        await asyncio.sleep(every)
