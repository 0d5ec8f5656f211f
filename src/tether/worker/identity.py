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
    return Identity(f"{hostname}-{pid}-{secrets.token_hex(4)}", hostname, pid, started)
