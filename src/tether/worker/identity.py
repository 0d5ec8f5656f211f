"""Who a worker is: ``hostname-pid-random``, plus what tells a live process from a reused pid."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from datetime import UTC, datetime

import psutil


@dataclass(frozen=True, slots=True)
class Identity:
    worker_id: str
    hostname: str
    pid: int
    process_started_at: datetime
    host_key: str


def host_key() -> str:
    """This kernel's boot id and our pid namespace: two workers with equal keys see the same pids.

    Containers can share a hostname while living in different pid namespaces; a
    pid number means nothing across them, so reconciliation compares keys first.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = "?"
    return f"{boot}:{pid_ns}"


def process_start_time(pid: int) -> datetime | None:
    """When the process with this pid started, or None if there is no such process."""
    try:
        return datetime.fromtimestamp(psutil.Process(pid).create_time(), tz=UTC)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def current_identity() -> Identity:
    hostname = socket.gethostname()
    pid = os.getpid()
    started = process_start_time(pid) or datetime.now(UTC)
    return Identity(f"{hostname}-{pid}-{secrets.token_hex(4)}", hostname, pid, started, host_key())
