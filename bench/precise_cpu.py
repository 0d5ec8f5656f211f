"""CPU time to the nanosecond, of a worker's processes and of its server sessions.

psutil's cpu_times() counts in 10 ms ticks (3-7 us a task over a drain of a few thousand
no-op tasks); the scheduler's own count, /proc/PID/task/TID/schedstat, is in nanoseconds.
The server must run on this machine (its sessions' processes are read the same way).
"""

from __future__ import annotations

import os

import psutil

from bench.infra import BenchDatabase


def process_cpu(pid: int) -> float:
    """CPU seconds used so far by process ``pid``'s threads, to the nanosecond: the
    scheduler's own count (/proc/PID/task/TID/schedstat), where psutil's cpu_times() counts
    in 10 ms ticks, 3-7 us a task over a drain of 3,000 no-op tasks. 0 for a process gone."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass  # gone meanwhile (a thread or a child that ended)
    return total / 1e9


def worker_cpu(pid: int) -> tuple[float, float]:
    """(CPU seconds of the worker's main process, of its children), as process_cpu counts."""
    children = psutil.Process(pid).children(recursive=True)
    return process_cpu(pid), sum(process_cpu(child.pid) for child in children)


def sessions_cpu(db: BenchDatabase) -> dict[int, tuple[str, float]]:
    """(application_name, CPU seconds used so far) of each server process serving one of the
    worker's sessions (tether-...) on ``db``, as process_cpu counts: the server runs here."""
    rows = db.query(
        "SELECT pid, application_name FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'tether-%'"
    )
    return {pid: (name, process_cpu(pid)) for pid, name in rows}
