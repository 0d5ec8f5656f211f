"""Startup reconciliation: recover what earlier workers on this host left behind.

A worker that starts looks at the workers registered on the same host (same
hostname and same kernel/pid namespace) that are still marked active. A pid
that no longer exists, or that now belongs to a process started at another
time (pids are reused), means that worker is gone: its tasks are recovered at
once by the reaper's rules, instead of after the stale thresholds. A live
sibling worker is never touched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from tether.broker import recovery, workers
from tether.config import AppConfig
from tether.db.connection import DedicatedConnection
from tether.worker.identity import Identity, process_start_time
from tether.worker.shared_connection import SharedConnection

log = logging.getLogger("tether.worker.reconcile")

# Process start times come from /proc in clock ticks: allow for rounding.
START_TIME_SLACK_S = 1.0


def is_same_process(pid: int, started_at: datetime | None) -> bool:
    now_started = process_start_time(pid)
    if now_started is None:
        return False
    if started_at is None:
        return True  # cannot tell a reused pid: assume alive rather than recover a live worker
    return abs((now_started - started_at).total_seconds()) <= START_TIME_SLACK_S


def reconcile_host(
    url: str,
    config: AppConfig,
    me: Identity,
    connection: SharedConnection | None = None,
    may_write: Callable[[], bool] | None = None,
) -> recovery.Recovered:
    """``connection``: the main process's shared one (its turn); else one of its own, closed after.

    ``may_write``: called (it may block) once a gone worker is found, before anything is
    written; False writes nothing. The worker's main process starts reconciliation beside
    its work listener's connect, and lets it write only once the listener listens: a crash
    retry it schedules notifies its due time, and that notification must be heard. The read
    that finds no gone worker, the usual start, waits for nothing.
    """
    done = recovery.Recovered()
    turn = connection.turn() if connection is not None else DedicatedConnection(url, config, "worker")
    with turn as conn:
        others = workers.workers_on_host(conn, hostname=me.hostname, host_key=me.host_key, me=me.worker_id)
        gone = [other for other in others if not is_same_process(other.pid, other.process_started_at)]
        if gone and may_write is not None and not may_write():
            return done
        for other in gone:
            why = f"its worker {other.worker_id} (pid {other.pid}) on this host is gone"
            log.warning(
                "worker %s is gone (pid %s no longer runs it): recovering its tasks",
                other.worker_id,
                other.pid,
            )
            done.merge(recovery.recover_worker(conn, other.worker_id, why))
    if done.acted:
        log.info(
            "startup reconciliation: %d worker(s) marked inactive, "
            "%d task(s) requeued, %d retried, %d failed",
            len(done.deactivated),
            len(done.requeued),
            len(done.retried),
            len(done.failed),
        )
    return done
