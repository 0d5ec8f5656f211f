"""The worker registry (workers.sql): a worker's row, its siblings, and who runs which names."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from tether.broker.queries import q
from tether.broker.types import AsyncConn, Conn


@dataclass(frozen=True, slots=True)
class Registration:
    """What a starting worker writes about itself."""

    worker_id: str
    hostname: str
    pid: int
    process_started_at: datetime
    host_key: str
    queues: list[str]
    processes: int  # sync children
    async_processes: int
    async_concurrency: int | None  # None without async children
    version: str
    task_names: list[str]


@dataclass(frozen=True, slots=True)
class Sibling:
    """Another worker registered on this host (same hostname and host key)."""

    worker_id: str
    pid: int
    process_started_at: datetime | None
    status: str


@dataclass(frozen=True, slots=True)
class WorkerSummary:
    """A row of `tether workers` (claimed and running: the tasks it holds in each status now)."""

    id: str
    hostname: str
    pid: int
    queues: list[str]
    processes: int  # sync children
    async_processes: int
    async_concurrency: int | None
    status: str
    started_at: datetime
    last_heartbeat_at: datetime
    heartbeat_age_s: float
    claimed: int
    running: int


async def register_worker(conn: AsyncConn, me: Registration) -> None:
    await conn.execute(
        q("register_worker"),
        {
            "id": me.worker_id,
            "hostname": me.hostname,
            "pid": me.pid,
            "process_started_at": me.process_started_at,
            "queues": me.queues,
            "processes": me.processes,
            "async_processes": me.async_processes,
            "async_concurrency": me.async_concurrency,
            "version": me.version,
            "task_names": me.task_names,
            "host_key": me.host_key,
        },
    )


async def record_listener_session(conn: AsyncConn, worker_id: str, closed_after_ms: int) -> None:
    """On the listener's connection: this session as the worker's, for the session_closed rule."""
    await conn.execute(
        q("record_listener_session"), {"id": worker_id, "after": timedelta(milliseconds=closed_after_ms)}
    )


async def stop_worker(conn: AsyncConn, worker_id: str) -> None:
    """Mark the worker stopped; it no longer waits for work."""
    await conn.execute(q("stop_worker"), {"id": worker_id})


async def name_known_elsewhere(conn: AsyncConn, *, me: str, name: str, queue: str) -> bool:
    """Does another active worker serving ``queue`` know the task name ``name``?"""
    cur = await conn.execute(q("name_known_elsewhere"), {"me": me, "name": name, "queue": queue})
    row = await cur.fetchone()
    return bool(row and row["known"])


def workers_on_host(conn: Conn, *, hostname: str, host_key: str, me: str) -> list[Sibling]:
    """Other workers of this host that are active, or inactive and still own in-flight tasks."""
    rows = conn.execute(q("workers_on_host"), {"hostname": hostname, "host_key": host_key, "me": me})
    return [Sibling(r["id"], r["pid"], r["process_started_at"], r["status"]) for r in rows.fetchall()]


def list_workers(conn: Conn, *, include_inactive: bool, limit: int) -> list[WorkerSummary]:
    """Active workers (all of them with ``include_inactive``), active first, newest first."""
    rows = conn.execute(q("list_workers"), {"all": include_inactive, "limit": limit}).fetchall()
    return [WorkerSummary(**row) for row in rows]
