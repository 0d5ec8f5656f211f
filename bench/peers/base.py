"""What every peer of the side-by-side bench provides, and the worker process they share.

A peer is one queue library on its own database of the bench server: it installs its
schema, empties its tables, enqueues untimed batches, names the command line of its
natural worker for each scenario, and reads back, from its own tables, when tasks were
sent, started and done (database time, ``now()`` of the writing transaction).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parent.parent.parent
# The 1 s heartbeat / 2 s stale settings of the recovery and commit scenarios (bench/recovery.py).
HEARTBEAT_S, STALE_S = 1.0, 2.0


@dataclass
class WorkerSpec:
    """One worker configuration of a peer: its command and environment, and a label for the table."""

    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class Worker:
    """A worker subprocess in its own session; stop() is SIGTERM, then SIGKILL to its group."""

    def __init__(self, spec: WorkerSpec, log: Path) -> None:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("TETHER_") or k == "TETHER_DATABASE_URL"
        }
        env.update(spec.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        self.spec = spec
        self.started_epoch = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, *spec.argv],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log.open("ab"),
            start_new_session=True,
        )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.spec.label} exited with {self.proc.returncode}; see its log")

    def stop(self, graceful: float = 10.0) -> None:
        """SIGTERM to the worker's session, SIGKILL to it after ``graceful`` seconds; and SIGKILL
        once more after the main process has gone, for anything it left in its session."""
        if self.proc.poll() is None and graceful > 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(graceful)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def kill(self) -> None:
        self.stop(graceful=0.0)


class Peer(ABC):
    """One library under test, on its own database ``url``."""

    name: str = "?"
    version: str = "?"

    def __init__(self, url: str) -> None:
        self.url = url

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, autocommit=True)

    def query(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            return conn.execute(sql, params).fetchall()

    @abstractmethod
    def install(self) -> None: ...

    @abstractmethod
    def reset(self) -> None:
        """Empty the peer's task tables (no worker running)."""

    @abstractmethod
    def enqueue(self, task: str, n: int, args: tuple[Any, ...] = ()) -> None:
        """``n`` tasks ``task(*args)`` at once, untimed (noop, anoop or hold)."""

    # -- workers ------------------------------------------------------------------------------

    @abstractmethod
    def startup_worker(self) -> WorkerSpec: ...

    @abstractmethod
    def drain_workers(self) -> list[WorkerSpec]: ...

    @abstractmethod
    def pickup_workers(self) -> list[tuple[WorkerSpec, str]]:
        """Worker configurations of the pickup scenario, each with the task it is sent."""

    @abstractmethod
    def hold_worker(self) -> WorkerSpec:
        """A worker that can run 50 ``hold`` tasks at once, heartbeats every 1 s."""

    # -- reading back -------------------------------------------------------------------------

    @abstractmethod
    def first_start_epoch(self) -> float | None:
        """Database time of the first task start recorded (None: none yet)."""

    @abstractmethod
    def left(self) -> int:
        """Tasks not yet done."""

    @abstractmethod
    def running(self) -> int:
        """Tasks started and not done."""

    @abstractmethod
    def span(self) -> tuple[float, float, int]:
        """(first start, last done, tasks done), database epoch seconds."""

    @abstractmethod
    def pickup_ms(self, since: float) -> tuple[list[float], str]:
        """Per task sent at or after ``since`` (database epoch), start - send in ms, and what
        'start' is for this peer."""

    # -- producers ----------------------------------------------------------------------------

    def recovery_workers(self) -> tuple[WorkerSpec, WorkerSpec] | None:
        """Workers A and B of the kill scenario, 1 s heartbeats and 2 s stale; None: the peer
        makes no recovery decision by itself."""
        return None

    def ready_since(self, since: float) -> bool:
        """A worker started at or after ``since`` (database epoch) is connected and registered."""
        raise NotImplementedError

    def decision_epoch(self) -> float | None:
        """When the held task's worker was judged dead (database time); None: not yet."""
        raise NotImplementedError

    def claim_ms(self, since: float) -> list[float] | None:
        """Per task sent at or after ``since``, claim - send in ms, where the peer records a claim
        apart from the start (tether); None where its start is the claim."""
        return None

    @abstractmethod
    def producer(self, task: str) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        """(open, send one ``task``, close): the pickup scenario's producer."""

    @abstractmethod
    def senders(self) -> dict[str, tuple[Callable[[], None], Callable[[int], None], Callable[[], None]]]:
        """Send kinds: label -> (open, send n one at a time, close)."""
