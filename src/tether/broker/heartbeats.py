"""Heartbeats (heartbeats.sql): the worker's one statement per interval, and progress reports."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tether.broker.queries import q
from tether.broker.types import AsyncConn, Conn


@dataclass
class Beat:
    """One heartbeat's content: every task the worker holds, in the role it holds it."""

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


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A row for tether_worker_states, added to some beats."""

    tasks_done: int
    rss_bytes: int | None
    cpu_percent: float | None


@dataclass(frozen=True, slots=True)
class BeatAnswer:
    """What a beat learned: the tasks reported that the worker no longer holds, the
    RUNNING ones it holds whose cancel was requested, and the seconds until the next slot
    of its queues' live schedules (None: there is none; ``slots_read`` False: not read)."""

    lost: frozenset[str] = frozenset()
    cancel_requested: frozenset[str] = frozenset()
    next_slot_in: float | None = None
    slots_read: bool = False
    sent_at: float = 0.0  # time.monotonic() when the beat was sent (set by its writer)


def _beat_params(
    worker_id: str, hostname: str, beat: Beat, snapshot: Snapshot | None, queues: list[str] | None
) -> dict[str, Any]:
    return {
        "queues": queues or [],
        "worker_id": worker_id,
        "hostname": hostname,
        "task_ids": beat.task_ids,
        "roles": beat.roles,
        "pids": beat.pids,
        "snapshot": snapshot is not None,
        "running": beat.running,
        "claimed": beat.claimed,
        "tasks_done": snapshot.tasks_done if snapshot else None,
        "rss_bytes": snapshot.rss_bytes if snapshot else None,
        "cpu_percent": snapshot.cpu_percent if snapshot else None,
    }


def _answer(row: dict[str, Any] | None, queues: list[str] | None) -> BeatAnswer:
    if row is None:
        return BeatAnswer()
    slot = row["next_slot_in_s"]
    return BeatAnswer(
        frozenset(row["lost"]),
        frozenset(row["cancel_requested"]),
        None if slot is None else float(slot),
        slots_read=queues is not None,
    )


async def write_heartbeats(
    conn: AsyncConn,
    *,
    worker_id: str,
    hostname: str,
    beat: Beat,
    snapshot: Snapshot | None,
    queues: list[str] | None = None,
) -> BeatAnswer:
    """Write the beat; returns what the database said of the tasks reported, and when the
    next slot of the schedules of ``queues`` comes."""
    cur = await conn.execute(q("write_heartbeats"), _beat_params(worker_id, hostname, beat, snapshot, queues))
    return _answer(await cur.fetchone(), queues)


def write_heartbeats_sync(
    conn: Conn,
    *,
    worker_id: str,
    hostname: str,
    beat: Beat,
    snapshot: Snapshot | None,
    queues: list[str] | None = None,
) -> BeatAnswer:
    """The same statement on a blocking connection, in its caller's transaction: the reaper's
    pass carries the beat that way (worker/beat_rides.py)."""
    row = conn.execute(
        q("write_heartbeats"), _beat_params(worker_id, hostname, beat, snapshot, queues)
    ).fetchone()
    return _answer(row, queues)


def report_progress(conn: Conn, task_id: str, attempt: int, worker_id: str, progress: Any) -> bool:
    """Store progress on a RUNNING row (fenced); it counts as a runner heartbeat too."""
    params = {"id": task_id, "attempt": attempt, "worker_id": worker_id, "progress": json.dumps(progress)}
    return bool(conn.execute(q("report_progress"), params).fetchall())
