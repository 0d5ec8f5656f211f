"""Recovery of what dead or silent workers left behind, by the rules of DESIGN.md section 2.

- A CLAIMED task whose claimer heartbeat went stale goes back to PENDING: its
  code never ran, so this is always safe.
- A RUNNING task whose runner heartbeat went stale was executing: it is retried
  only if its retry policy lists WORKER_CRASHED and retries are left, otherwise
  it FAILS with WORKER_CRASHED. Either way one attempt row is written in the
  same statement as the transition.

Every action is a guarded UPDATE (status + attempt + owner), so a reaper that
races another reaper, or a worker that comes back late, cannot act twice.
These functions take a sync connection; the worker's reaper runs them in a
thread. Manual recovery (broker/manual_recovery.py) applies the same rules on demand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from uuid import UUID

from tether import outcomes
from tether.broker import retention
from tether.broker.claims import Fence, record_outcome
from tether.broker.queries import q
from tether.broker.types import Conn
from tether.config import RecoveryConfig
from tether.log_fields import about_task
from tether.result import TaskStatus

log = logging.getLogger("tether.recovery")

BATCH = 500


@dataclass(frozen=True, slots=True)
class RequeuedTask:
    """A CLAIMED task put back to PENDING: its claimer went silent before its code ran."""

    id: UUID
    name: str
    attempt: int
    claimed_by_worker_id: str
    silent_s: float  # seconds since the claim or the claimer's last heartbeat for it
    queue: str
    trace_context: str | None = None  # what it was sent with (tracing): its log lines name the trace


@dataclass(frozen=True, slots=True)
class CrashedTask:
    """A RUNNING task whose runner went silent, settled with WORKER_CRASHED.

    ``retry_delay_s`` is set when its retry policy scheduled another attempt, None when it
    ended: FAILED, or CANCELLED when its cancel had been requested (``settled`` says which).
    """

    id: UUID
    name: str
    attempt: int
    claimed_by_worker_id: str
    silent_s: float  # seconds since the start or the runner's last heartbeat
    retry_delay_s: float | None
    settled: TaskStatus  # PENDING (a retry), FAILED or CANCELLED
    queue: str
    trace_context: str | None = None  # what it was sent with (tracing): its log lines name the trace


@dataclass(frozen=True, slots=True)
class DeactivatedWorker:
    """A worker marked inactive: its heartbeat went stale, or its process was found gone."""

    id: str
    hostname: str
    pid: int
    age_s: float  # seconds since its last heartbeat


@dataclass(frozen=True, slots=True)
class StaleTask:
    """A RUNNING task with no runner heartbeat or progress past a threshold, and its worker."""

    id: UUID
    name: str
    queue: str
    attempt: int
    worker_id: str | None
    worker_hostname: str | None  # None when the worker's row was pruned
    worker_pid: int | None
    worker_status: str | None
    started_at: datetime | None
    last_heartbeat_at: datetime | None  # the latest of start, progress and runner heartbeat
    silent_s: float

    def __getitem__(self, field_name: str) -> object:
        """``task['id']``: a field by name, as the seed documents read these rows."""
        if field_name not in self.__dataclass_fields__:
            raise KeyError(field_name)
        return getattr(self, field_name)


@dataclass
class Recovered:
    """What one recovery pass did, task by task, for logs, the CLI and tests."""

    expired: int = 0
    requeued: list[RequeuedTask] = field(default_factory=list)
    retried: list[CrashedTask] = field(default_factory=list)
    failed: list[CrashedTask] = field(default_factory=list)
    deactivated: list[DeactivatedWorker] = field(default_factory=list)
    workflow_steps: int = 0  # workflow steps settled by reconciliation
    workflows_finished: list[str] = field(default_factory=list)
    # Tasks of workers whose listener session closed (recover_closed_sessions), each settled
    # as the stale rules would (requeued, retried or failed), kept apart: another rule.
    session_closed: list[RequeuedTask | CrashedTask] = field(default_factory=list)

    @property
    def acted(self) -> bool:
        return bool(
            self.expired
            or self.requeued
            or self.retried
            or self.failed
            or self.deactivated
            or self.workflow_steps
            or self.workflows_finished
            or self.session_closed
        )

    def merge(self, other: Recovered) -> None:
        self.expired += other.expired
        self.requeued += other.requeued
        self.retried += other.retried
        self.failed += other.failed
        self.deactivated += other.deactivated
        self.workflow_steps += other.workflow_steps
        self.workflows_finished += other.workflows_finished
        self.session_closed += other.session_closed


def _ms(value: int | float) -> timedelta:
    return timedelta(milliseconds=value)


def expire_pending(conn: Conn, limit: int = BATCH) -> int:
    row = conn.execute(q("expire_pending"), {"limit": limit}).fetchone()
    return int(row["expired"]) if row else 0


def requeue_stale_claimed(
    conn: Conn, threshold_ms: float, *, owner: str | None = None, limit: int = BATCH, quiet: bool = False
) -> list[RequeuedTask]:
    rows = conn.execute(
        q("requeue_stale_claimed"), {"threshold": _ms(threshold_ms), "owner": owner, "limit": limit}
    ).fetchall()
    requeued = [
        RequeuedTask(
            r["id"],
            r["name"],
            r["attempt"],
            r["claimed_by_worker_id"],
            r["silent_s"],
            r["queue"],
            r["trace_context"],
        )
        for r in rows
    ]
    for task in [] if quiet else requeued:
        log.warning(
            "requeued task %s (%s) attempt %d: CLAIMED by %s with no claimer heartbeat for %.1fs; "
            "its code never ran, back to PENDING",
            task.id,
            task.name,
            task.attempt,
            task.claimed_by_worker_id,
            task.silent_s,
            extra=about_task(task, task.claimed_by_worker_id),
        )
    return requeued


def recover_stale_running(
    conn: Conn,
    threshold_ms: float,
    *,
    owner: str | None = None,
    limit: int = BATCH,
    why: str | None = None,
    quiet: bool = False,
) -> tuple[list[CrashedTask], list[CrashedTask]]:
    """Retry or fail RUNNING tasks whose runner went silent. Returns (retried, ended): ended
    ones are FAILED, or CANCELLED if their cancel had been requested.

    Runs in one transaction: the rows stay locked from the scan to the write.
    """
    retried: list[CrashedTask] = []
    failed: list[CrashedTask] = []
    with conn.transaction():
        stale = conn.execute(
            q("stale_running"), {"threshold": _ms(threshold_ms), "owner": owner, "limit": limit}
        ).fetchall()
        for row in stale:
            how = (
                why
                or f"no runner heartbeat for {row['silent_s']:.1f}s from worker {row['claimed_by_worker_id']}"
            )
            outcome = outcomes.crashed(row["retry_policy"], row["retry_count"], how)
            fence = Fence(str(row["id"]), row["attempt"], row["claimed_by_worker_id"], TaskStatus.RUNNING)
            settled = record_outcome(conn, fence, outcome, hostname=None, pid=None).settled
            if settled is None:
                continue  # settled by its own worker in the meantime: nothing to do
            task = CrashedTask(
                row["id"],
                row["name"],
                row["attempt"],
                row["claimed_by_worker_id"],
                row["silent_s"],
                outcome.retry_delay_s if settled is TaskStatus.PENDING else None,
                settled,
                row["queue"],
                row["trace_context"],
            )
            (retried if settled is TaskStatus.PENDING else failed).append(task)
            if quiet:
                continue
            log.warning(
                "task %s (%s) attempt %d: RUNNING on %s, %s; %s",
                task.id,
                task.name,
                task.attempt,
                task.claimed_by_worker_id,
                how,
                f"retry in {outcome.retry_delay_s:.1f}s (policy retries WORKER_CRASHED)"
                if settled is TaskStatus.PENDING
                else "CANCELLED (its cancel had been requested)"
                if settled is TaskStatus.CANCELLED
                else "FAILED with WORKER_CRASHED",
                extra=about_task(task, task.claimed_by_worker_id),
            )
    return retried, failed


def deactivate_stale_workers(
    conn: Conn, threshold_ms: float, limit: int = BATCH, *, quiet: bool = False
) -> list[DeactivatedWorker]:
    rows = conn.execute(
        q("deactivate_stale_workers"), {"threshold": _ms(threshold_ms), "limit": limit}
    ).fetchall()
    workers = [DeactivatedWorker(**row) for row in rows]
    for worker in [] if quiet else workers:
        log.warning(
            "worker %s (host %s, pid %s) heartbeat is stale (%.0fs old), marking it inactive",
            worker.id,
            worker.hostname,
            worker.pid,
            worker.age_s,
        )
    if workers and not quiet:
        log.info("deactivated %d worker(s) with stale heartbeats", len(workers))
    return workers


def recover_worker(conn: Conn, worker_id: str, why: str) -> Recovered:
    """Everything a worker known to be gone held: no waiting for its heartbeats to go stale."""
    done = Recovered()
    done.deactivated = [
        DeactivatedWorker(**row) for row in conn.execute(q("deactivate_worker"), {"id": worker_id})
    ]
    done.requeued = requeue_stale_claimed(conn, 0, owner=worker_id)
    done.retried, done.failed = recover_stale_running(conn, 0, owner=worker_id, why=why)
    return done


def recover_closed_sessions(
    conn: Conn, *, requeue: bool, fail: bool, limit: int = BATCH, quiet: bool = False
) -> Recovered:
    """The session_closed rule: workers that opted in and whose listener session is gone from
    the server (their process died, so its kernel closed the connection), silent for their own
    ``session_closed_after``: marked inactive, their tasks settled at once by the same rules
    as stale ones (``requeue``: CLAIMED back to PENDING; ``fail``: RUNNING retried or FAILED
    with WORKER_CRASHED). In the caller's transaction (the reaper's pass)."""
    done = Recovered()
    with conn.transaction():
        done.deactivated = [
            DeactivatedWorker(**row) for row in conn.execute(q("closed_session_workers"), {"limit": limit})
        ]
        for worker in done.deactivated:
            why = (
                f"the listener session of worker {worker.id} closed and it has not beaten "
                f"for {worker.age_s:.1f}s: its process is gone"
            )
            if not quiet:
                log.warning(
                    "worker %s (host %s, pid %s): its listener session closed and its heartbeat is "
                    "%.1fs old: its process is gone, recovering its tasks now (session_closed)",
                    worker.id,
                    worker.hostname,
                    worker.pid,
                    worker.age_s,
                )
            if requeue:
                done.session_closed += requeue_stale_claimed(conn, 0, owner=worker.id, quiet=quiet)
            if fail:
                retried, failed = recover_stale_running(conn, 0, owner=worker.id, why=why, quiet=quiet)
                done.session_closed += retried + failed
    return done


def next_due_in(conn: Conn, config: RecoveryConfig) -> float | None:
    """Seconds until something turns stale or expires (None: nothing in flight)."""
    row = conn.execute(
        q("next_due_in"),
        {
            "claimed_threshold": _ms(config.claimed_stale_threshold_ms),
            "running_threshold": _ms(config.running_stale_threshold_ms),
        },
    ).fetchone()
    return None if row is None or row["seconds"] is None else float(row["seconds"])


def prune(conn: Conn, config: RecoveryConfig, limit: int = 5_000) -> dict[str, int]:
    """Delete rows past their retention: one pass from the start (broker/retention.py)."""
    return retention.prune(conn, config, limit)
