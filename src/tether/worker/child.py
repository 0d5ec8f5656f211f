"""Entry point of a worker child process: run one task at a time, record each outcome.

The child owns the RUNNING transition and the outcome write (rule 4: the
process that ran the code records what happened), so a supervisor dying after
the work finished can never turn a success into a crash.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from tether.progress import set_reporter
from tether.worker import protocol
from tether.worker.app_loader import load_app
from tether.worker.execute import Executor, internal_failure
from tether.worker.protocol import TaskPayload
from tether.worker.recorder import Recorder

log = logging.getLogger("tether.worker.child")

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL us when the parent dies; a watchdog thread where it cannot."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                # The parent may have died before prctl took effect.
                if os.getppid() != parent_pid:
                    os._exit(1)
                return
        except OSError as exc:
            log.warning("prctl(PR_SET_PDEATHSIG) unavailable (%s); using a watchdog thread", exc)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tether-parent-watchdog", daemon=True).start()


def stamp_heartbeats(stamps: Any, index: int, interval_s: float) -> None:
    """The runner heartbeat's origin: a thread of the task's own process stamps its slot.

    If the task holds the GIL (a C extension stuck in a loop) or the process
    hangs, the stamp goes stale; the main process then stops relaying runner
    heartbeats for it and, past the running stale threshold, kills the child.
    """

    def beat() -> None:
        while True:
            stamps[index] = time.monotonic()
            time.sleep(interval_s)

    threading.Thread(target=beat, name="tether-runner-heartbeat", daemon=True).start()


def child_main(
    conn: Connection,
    app_path: str,
    url: str,
    worker_id: str,
    parent_pid: int,
    log_level: int,
    stamps: Any,
    index: int,
) -> None:
    die_with_parent(parent_pid)
    # Ctrl-C in a terminal, or systemd's SIGTERM to the whole control group, reaches every
    # process of the worker: shutdown (and the grace period) is the main process's call.
    # The child still dies with its parent (PR_SET_PDEATHSIG) and to the parent's SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s [child {os.getpid()}] %(name)s: %(message)s"
    )
    app = load_app(app_path)
    stamp_heartbeats(stamps, index, app.config.recovery.runner_heartbeat_interval_ms / 1000)
    executor = Executor(app)
    recorder = Recorder(url, worker_id, connect_timeout=max(1, round(app.config.broker.connect_timeout_s)))
    try:
        _serve(conn, executor, recorder)
    finally:
        recorder.close()


def _serve(conn: Connection, executor: Executor, recorder: Recorder) -> None:
    protocol.send(conn, protocol.READY)
    current: TaskPayload | None = None
    while True:
        if current is None:
            msg = protocol.recv(conn)
            if msg["op"] == protocol.STOP:
                return
            if msg["op"] != protocol.RUN:
                continue
            current = msg["task"]
            started = recorder.start(current)
            protocol.send(conn, protocol.STARTED, id=current.id, lost=not started)
            if not started:
                current = None
                continue
        set_reporter(partial(recorder.report_progress, current))
        try:
            outcome = executor.run(current)
        except Exception as exc:  # a bug of ours must not kill the child and pass as a crash
            outcome = internal_failure(current, exc)
        finally:
            set_reporter(None)
        # Ask for the next task before recording, so the outcome of this one and the
        # start of the next share one transaction (one commit per task, not two).
        protocol.send(conn, protocol.NEXT, id=current.id)
        reply = protocol.recv(conn)
        next_task = reply["task"] if reply["op"] == protocol.RUN else None
        recorded, next_started = recorder.record(current, outcome, next_task)
        protocol.send(
            conn,
            protocol.DONE,
            id=current.id,
            status=outcome.status if recorded else "LOST",
            next_id=next_task.id if next_task else None,
            next_lost=next_task is not None and not next_started,
        )
        if reply["op"] == protocol.STOP:
            return
        current = next_task if next_started else None
