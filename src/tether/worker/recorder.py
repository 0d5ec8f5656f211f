"""Fenced writes from the worker: start a task, record its outcome, give claims back.

Every write names the status it expects, the attempt and the owner. When it
matches no row, this attempt lost the task (cancelled, or recovered after this
worker was declared dead): nothing is changed and a WARNING says so.

The connection may drop at any moment (database restart, pg_terminate_backend).
A statement is then retried on a new connection with backoff; since a COMMIT
may have happened before the drop, a retried write that matches nothing reads
the row to tell "already recorded by us" from "lost".
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tether import outcomes
from tether.broker import claims, heartbeats
from tether.broker.claims import Fence, TaskPayload
from tether.broker.types import Conn, OperationalError
from tether.config import AppConfig
from tether.db.connection import connect_worker
from tether.outcomes import Outcome
from tether.result import TaskError
from tether.workflow import engine

log = logging.getLogger("tether.worker.recorder")

T = TypeVar("T")


class Recorder:
    """The fenced writes of one process (a child, or the worker's main process) on its own connection."""

    def __init__(
        self, url: str, worker_id: str, config: AppConfig, *, give_up_after_s: float = 300.0
    ) -> None:
        self.url = url
        self.worker_id = worker_id
        self.config = config
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.give_up_after_s = give_up_after_s
        self._conn: Conn | None = None
        # The main process calls in from worker threads; one statement at a time.
        self._lock = threading.RLock()

    def _connection(self) -> Conn:
        if self._conn is None or self._conn.closed:
            self._conn = connect_worker(self.url, self.config, "worker")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def _with_retry(self, what: str, work: Callable[[Conn], T]) -> tuple[T, bool]:
        """Run ``work``; on a lost connection reconnect and run it again. Returns (value, retried)."""
        delay = 0.05
        deadline = time.monotonic() + self.give_up_after_s
        retried = False
        with self._lock:
            while True:
                try:
                    return work(self._connection()), retried
                except OperationalError as exc:
                    if self._conn is not None:
                        self._conn.close()
                    if time.monotonic() > deadline:
                        log.error(
                            "giving up on %s after %.0fs without the database: %s",
                            what,
                            self.give_up_after_s,
                            exc,
                        )
                        raise
                    log.warning(
                        "database connection lost during %s (%s); retrying in %.2fs", what, exc, delay
                    )
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    retried = True

    def fence(self, task: TaskPayload, expect: str) -> Fence:
        return Fence(task.id, task.attempt, self.worker_id, expect)

    # -- statements -------------------------------------------------------------

    def start(self, task: TaskPayload) -> bool:
        """CLAIMED -> RUNNING. False if the claim was lost (then the code must not run)."""
        started, retried = self._with_retry(
            f"starting task {task.id}", lambda c: claims.start_task(c, task, self.worker_id)
        )
        return started or self._explain_miss(task, "start", retried, settled="RUNNING")

    def record(
        self, task: TaskPayload, outcome: Outcome, next_task: TaskPayload | None = None
    ) -> tuple[bool, bool | None]:
        """Record the outcome (and start ``next_task`` in the same transaction).

        Returns (outcome recorded, next started or None when there was no next).
        """
        fence = self.fence(task, "RUNNING")

        def work(c: Conn) -> tuple[bool, bool | None]:
            # One statement in autocommit: the outcome, its attempt row and the next
            # task's start commit together, in one round trip.
            done = claims.record_outcome(
                c, fence, outcome, hostname=self.hostname, pid=self.pid, start_next=next_task
            )
            return done.recorded, None if next_task is None else done.next_started

        (recorded, started), retried = self._with_retry(f"recording task {task.id}", work)
        if not recorded:
            recorded = self._explain_miss(task, "record its outcome", retried, settled=outcome.settles_as)
        if next_task is not None and not started:
            started = self._explain_miss(next_task, "start", retried, settled="RUNNING")
        if recorded:
            self.after_outcome(task, outcome)
        return recorded, started

    def record_for(self, task: TaskPayload, outcome: Outcome, *, expect: str) -> bool:
        """Record an outcome decided outside the child (crash, unregistered): ``expect`` -> outcome."""
        fence = self.fence(task, expect)
        done, retried = self._with_retry(
            f"recording task {task.id}",
            lambda c: claims.record_outcome(c, fence, outcome, hostname=self.hostname, pid=self.pid),
        )
        recorded = done.recorded or (
            retried and self._explain_miss(task, "record its outcome", retried, settled=outcome.settles_as)
        )
        if recorded:
            self.after_outcome(task, outcome)
        return recorded

    def after_outcome(self, task: TaskPayload, outcome: Outcome) -> None:
        """A workflow step's task has ended: advance its workflow (a transaction of its own).

        If this process dies first, the step stays ENQUEUED with an ended task and
        the reaper's reconciliation advances the workflow instead.
        """
        if task.workflow_id is None or outcome.will_retry:
            return
        workflow_id = task.workflow_id
        try:
            self._with_retry(
                f"advancing workflow {workflow_id}",
                lambda c: engine.advance(c, workflow_id, [task.id]),
            )
        except Exception:  # never fatal to the worker: reconciliation repairs the step
            log.exception(
                "task %s: could not advance workflow %s; the reaper will reconcile the step",
                task.id,
                workflow_id,
            )

    def record_crash(self, task: TaskPayload, killed_for: TaskError | None) -> str:
        """A child holding ``task`` died: its started task failed, an unstarted one never ran.

        killed_for: the worker killed the child (its time limit passed); else it crashed.
        Returns what became of the task, for the log.
        """
        if killed_for is not None:
            outcome = outcomes.failure(killed_for, task.retry_policy, task.retry_count)
        else:
            outcome = outcomes.crashed(
                task.retry_policy, task.retry_count, "the worker process running this task died"
            )
        code = outcome.error_code
        if self.record_for(task, outcome, expect="RUNNING"):
            return f"retry scheduled after {code}" if outcome.will_retry else f"FAILED with {code}"
        if self.release([task]):
            return "released back to PENDING (its code never started)"
        return "already settled elsewhere"

    def unstart(self, task: TaskPayload) -> bool:
        """RUNNING -> PENDING for a task this process started but whose code it never ran."""
        given_back, _ = self._with_retry(
            f"giving back task {task.id}", lambda c: claims.unstart_task(c, task, self.worker_id)
        )
        return given_back

    def release(self, tasks: list[TaskPayload]) -> int:
        """CLAIMED -> PENDING for tasks whose code never started here (shutdown, dead child)."""
        released, _ = self._with_retry(
            "releasing claimed tasks", lambda c: claims.release_claimed(c, tasks, self.worker_id)
        )
        return released

    def report_progress(self, task: TaskPayload, progress: dict[str, Any]) -> bool:
        """Store progress on the row (fenced); it also counts as a runner heartbeat."""
        reported, _ = self._with_retry(
            f"reporting progress of task {task.id}",
            lambda c: heartbeats.report_progress(c, task.id, task.attempt, self.worker_id, progress),
        )
        return reported

    def _explain_miss(self, task: TaskPayload, action: str, retried: bool, *, settled: str) -> bool:
        """A fenced write matched nothing. True if it was in fact our own earlier commit."""
        now, _ = self._with_retry(f"reading task {task.id}", lambda c: claims.read_fence(c, task.id))
        if (
            retried
            and now is not None
            and now.attempt == task.attempt
            and now.status == settled
            and now.owner in (self.worker_id, None)
            # An outcome is ours only if this process wrote its attempt row (a reaper
            # that recorded the same status leaves pid NULL); a start has no such row.
            and (settled == "RUNNING" or now.recorded_by_pid == self.pid)
        ):
            log.info("task %s: the write to %s was committed before the connection dropped", task.id, action)
            return True
        holder = "gone" if now is None else f"{now.status}, attempt {now.attempt}, owner {now.owner}"
        log.warning(
            "lost task %s (%s) attempt %d: could not %s, the row moved on (now %s); nothing was changed",
            task.id,
            task.name,
            task.attempt,
            action,
            holder,
        )
        return False
