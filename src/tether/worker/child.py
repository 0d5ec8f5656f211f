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
import uuid
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from tether.app import Tether
from tether.broker.claims import TaskPayload
from tether.current import RunningTask, set_cancel_probe, set_current_task
from tether.log_fields import about_task, set_worker
from tether.log_setup import LogSetup
from tether.progress import set_reporter
from tether.steps import StepBook, StepStore
from tether.worker import protocol
from tether.worker.app_loader import load_app
from tether.worker.execute import Executor, internal_failure
from tether.worker.heap import freeze_start_up
from tether.worker.progress_reports import WaitingReporter
from tether.worker.recorder import Recorder
from tether.worker.start_method import leave_fork_server
from tether.worker.step_writes import ChildSteps

log = logging.getLogger("tether.worker.child")

_PR_SET_PDEATHSIG = 1


class ParentGuard:
    """Children die with their parent, except while recording an outcome.

    While the task's code runs, the kernel SIGKILLs us the moment the parent dies
    (PR_SET_PDEATHSIG; a watchdog thread where that is unavailable): unsupervised
    code must not go on, its task will be recovered as crashed. Once the code has
    finished, the outcome is worth more than the supervisor: the guard is lifted
    while the child exchanges with the parent and records, then restored; if the
    parent died meanwhile, the child exits right after recording (rule 4).
    """

    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid  # the worker's main process
        # The process that made this one: the main process (spawn) or the worker's fork
        # server (tether.worker.start_method), which exits as soon as the main process is gone.
        # The parent-death signal follows this one; the main process is checked besides.
        self.direct_parent = os.getppid()
        self.recording = False
        self._libc: ctypes.CDLL | None = None
        if sys.platform.startswith("linux"):
            try:
                self._libc = ctypes.CDLL(None, use_errno=True)
            except OSError as exc:
                log.warning("prctl unavailable (%s); watching the parent from a thread", exc)
        if self._libc is None:
            threading.Thread(target=self._watch, name="tether-parent-watchdog", daemon=True).start()
        self.arm()

    def _deathsig(self, sig: int) -> None:
        if self._libc is not None and self._libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())

    def _watch(self) -> None:
        while True:
            if not self.parent_alive() and not self.recording:
                os._exit(1)
            time.sleep(0.2)

    def parent_alive(self) -> bool:
        if os.getppid() != self.direct_parent:
            return False
        if self.direct_parent == self.parent_pid:
            return True
        try:  # made by the fork server: the main process must still be there too
            os.kill(self.parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # a pid reused by another user's process: not ours
            return False
        return True

    def arm(self) -> None:
        self.recording = False
        self._deathsig(signal.SIGKILL)
        if not self.parent_alive():  # it died before (or while) the guard went up
            os._exit(1)

    def disarm(self) -> None:
        self.recording = True
        self._deathsig(0)


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


def begin_child(
    label: str, parent_pid: int, log_setup: LogSetup, app_path: str, worker_id: str
) -> tuple[ParentGuard, Tether]:
    """What every child does first: die with its parent, leave signals to it, log as the worker's
    main process does (level and format; every line names the worker), import the app."""
    leave_fork_server()  # before the guard: its parent's exit must follow the main process's
    guard = ParentGuard(parent_pid)
    # Ctrl-C in a terminal, or systemd's SIGTERM to the whole control group, reaches every
    # process of the worker: shutdown (and the grace period) is the main process's call.
    # The child still dies with its parent (PR_SET_PDEATHSIG) and to the parent's SIGKILL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log_setup.apply(label=label)
    set_worker(worker_id)
    return guard, load_app(app_path)


def child_main(
    conn: Connection,
    app_path: str,
    url: str,
    worker_id: str,
    parent_pid: int,
    log_setup: LogSetup,
    stamps: Any,
    index: int,
    cancels: Any,
) -> None:
    guard, app = begin_child("child", parent_pid, log_setup, app_path, worker_id)
    stamp_heartbeats(stamps, index, app.config.recovery.runner_heartbeat_interval_ms / 1000)
    set_cancel_probe(partial(_on_cancel_board, cancels, index))
    executor = Executor(app)
    recorder = Recorder(url, worker_id, app.config, role="child")
    freeze_start_up()  # its full collections walk only what its tasks leave behind (heap.py)
    try:
        _serve(conn, executor, recorder, guard)
    finally:
        recorder.close()


def _serve(conn: Connection, executor: Executor, recorder: Recorder, guard: ParentGuard) -> None:
    pushed = protocol.message_waiting(conn)
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
        set_reporter(WaitingReporter(recorder, current))
        set_current_task(running_task(current, recorder.worker_id, ChildSteps(recorder, current)))
        began = time.monotonic()
        try:
            outcome = executor.run(current)
        except Exception as exc:  # a bug of ours must not kill the child and pass as a crash
            outcome = internal_failure(current, exc)
        finally:
            set_reporter(None)
            set_current_task(None)
        ran_s = time.monotonic() - began
        guard.disarm()
        # A suspension (a durable sleep or wait) is its own statement, with no commit to share
        # with the next task's start: written at once, before asking the main process for work.
        suspended = recorder.suspend(current, outcome) if outcome.suspension is not None else None
        reply = _ask_next(conn, pushed, current)
        next_task = reply["task"] if reply["op"] == protocol.RUN else None
        if outcome.suspension is not None:
            settled, next_started = suspended, (None if next_task is None else recorder.start(next_task))
        else:
            settled, next_started = recorder.record(current, outcome, next_task)
        if not guard.parent_alive():
            log.warning(
                "task %s: outcome recorded after the worker's main process died; exiting",
                current.id,
                extra=about_task(current),
            )
            if next_task is not None and next_started:
                recorder.unstart(next_task)  # started in that same commit, none of its code ran
            return
        guard.arm()
        protocol.send(
            conn,
            protocol.DONE,
            id=current.id,
            status="SUSPENDED" if settled == "PENDING" and outcome.suspension else settled or "LOST",
            next_id=next_task.id if next_task else None,
            next_lost=next_task is not None and not next_started,
            # For the worker's metrics (tether.metrics): the main process counts for its children.
            code=outcome.error_code,
            run_s=ran_s,
        )
        if reply["op"] == protocol.STOP:
            return
        current = next_task if next_started else None


def _on_cancel_board(cancels: Any, index: int, task_id: str) -> bool:
    """Whether the main process wrote ``task_id`` on this child's slot of the cancel board."""
    size = protocol.CANCEL_ID_BYTES
    return bytes(cancels[index * size : (index + 1) * size]) == uuid.UUID(task_id).bytes


def running_task(task: TaskPayload, worker_id: str, steps: StepStore | None = None) -> RunningTask:
    """What tether.current_task() tells the task's code about this run; ``steps``: where this
    attempt's checkpointed steps are read and written (a fresh book per attempt)."""
    book = None
    if steps is not None:
        book = StepBook(steps, f"task {task.id} ({task.name}) attempt {task.attempt}")
    return RunningTask(
        id=uuid.UUID(task.id),
        name=task.name,
        queue=task.queue,
        attempt=task.attempt,
        retry_count=task.retry_count,
        worker_id=worker_id,
        _steps=book,
        _trace_context=task.trace_context,
    )


def _ask_next(conn: Connection, pushed: Callable[[], bool], finished: TaskPayload) -> dict[str, Any]:
    """Ask for the next task before recording, so the outcome of this one and the start
    of the next share one transaction (one commit per task, not two). A parent gone
    in the meantime answers nothing: then record alone and stop."""
    try:
        if pushed():  # the main process pushed the next task while this one ran
            return protocol.recv(conn)
        protocol.send(conn, protocol.NEXT, id=finished.id)
        return protocol.recv(conn)
    except (EOFError, OSError) as exc:
        log.warning(
            "task %s: lost the worker's main process (%s); recording the outcome alone",
            finished.id,
            exc,
            extra=about_task(finished),
        )
        return {"op": protocol.STOP}
