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

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from tether.broker.queries import q
from tether.db.connection import TCP_SETTINGS
from tether.outcomes import Fence, Outcome, outcome_statement, was_recorded
from tether.worker.protocol import TaskPayload
from tether.workflow import engine

log = logging.getLogger("tether.worker.recorder")

T = TypeVar("T")
Row = dict[str, Any]


class Recorder:
    def __init__(
        self,
        url: str,
        worker_id: str,
        *,
        connect_timeout: int = 5,
        give_up_after_s: float = 300.0,
        session: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.worker_id = worker_id
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.connect_timeout = connect_timeout
        self.give_up_after_s = give_up_after_s
        self.session = session if session is not None else dict(TCP_SETTINGS)
        self._conn: psycopg.Connection[Row] | None = None
        # The main process calls in from worker threads; one statement at a time.
        self._lock = threading.RLock()

    def _connection(self) -> psycopg.Connection[Row]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.url,
                autocommit=True,
                row_factory=dict_row,
                connect_timeout=self.connect_timeout,
                application_name="tether-worker",
                **self.session,
            )
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def _with_retry(self, what: str, work: Callable[[psycopg.Connection[Row]], T]) -> tuple[T, bool]:
        """Run ``work``; on a lost connection reconnect and run it again. Returns (value, retried)."""
        delay = 0.05
        deadline = time.monotonic() + self.give_up_after_s
        retried = False
        with self._lock:
            while True:
                try:
                    return work(self._connection()), retried
                except psycopg.OperationalError as exc:
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
        params = {"id": task.id, "attempt": task.attempt, "worker_id": self.worker_id}
        rows, retried = self._with_retry(
            f"starting task {task.id}", lambda c: c.execute(q("start_task"), params).fetchall()
        )
        return bool(rows) or self._explain_miss(task, "start", retried, settled="RUNNING")

    def record(
        self, task: TaskPayload, outcome: Outcome, next_task: TaskPayload | None = None
    ) -> tuple[bool, bool | None]:
        """Record the outcome (and start ``next_task`` in the same transaction).

        Returns (outcome recorded, next started or None when there was no next).
        """
        name, params = outcome_statement(
            self.fence(task, "RUNNING"),
            outcome,
            hostname=self.hostname,
            pid=self.pid,
            start_next=None if next_task is None else (next_task.id, next_task.attempt),
        )

        def work(c: psycopg.Connection[Row]) -> tuple[bool, bool | None]:
            # One statement in autocommit: the outcome, its attempt row and the next
            # task's start commit together, in one round trip.
            row = c.execute(q(name), params).fetchone()
            return was_recorded(row), None if next_task is None else bool(row and row["next_started"])

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
        name, params = outcome_statement(
            self.fence(task, expect), outcome, hostname=self.hostname, pid=self.pid
        )
        row, retried = self._with_retry(
            f"recording task {task.id}", lambda c: c.execute(q(name), params).fetchone()
        )
        recorded = was_recorded(row) or (
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

    def unstart(self, task: TaskPayload) -> bool:
        """RUNNING -> PENDING for a task this process started but whose code it never ran."""
        params = {"id": task.id, "attempt": task.attempt, "worker_id": self.worker_id}
        rows, _ = self._with_retry(
            f"giving back task {task.id}", lambda c: c.execute(q("unstart_task"), params).fetchall()
        )
        return bool(rows)

    def release(self, tasks: list[TaskPayload]) -> int:
        """CLAIMED -> PENDING for tasks whose code never started here (shutdown, dead child)."""
        params = {
            "ids": [t.id for t in tasks],
            "attempts": [t.attempt for t in tasks],
            "worker_id": self.worker_id,
        }
        row, _ = self._with_retry(
            "releasing claimed tasks", lambda c: c.execute(q("release_claimed"), params).fetchone()
        )
        return int(row["released"]) if row else 0

    def report_progress(self, task: TaskPayload, progress: dict[str, Any]) -> bool:
        """Store progress on the row (fenced); it also counts as a runner heartbeat."""
        params = {
            "id": task.id,
            "attempt": task.attempt,
            "worker_id": self.worker_id,
            "progress": json.dumps(progress),
        }
        rows, _ = self._with_retry(
            f"reporting progress of task {task.id}",
            lambda c: c.execute(q("report_progress"), params).fetchall(),
        )
        return bool(rows)

    def _explain_miss(self, task: TaskPayload, action: str, retried: bool, *, settled: str) -> bool:
        """A fenced write matched nothing. True if it was in fact our own earlier commit."""
        row, _ = self._with_retry(
            f"reading task {task.id}", lambda c: c.execute(q("get_fence"), {"id": task.id}).fetchone()
        )
        if (
            retried
            and row is not None
            and row["attempt"] == task.attempt
            and row["status"] == settled
            and row["claimed_by_worker_id"] in (self.worker_id, None)
            # An outcome is ours only if this process wrote its attempt row (a reaper
            # that recorded the same status leaves pid NULL); a start has no such row.
            and (settled == "RUNNING" or row["recorded_by_pid"] == self.pid)
        ):
            log.info("task %s: the write to %s was committed before the connection dropped", task.id, action)
            return True
        if row is None:
            now = "gone"
        else:
            now = f"{row['status']}, attempt {row['attempt']}, owner {row['claimed_by_worker_id']}"
        log.warning(
            "lost task %s (%s) attempt %d: could not %s, the row moved on (now %s); nothing was changed",
            task.id,
            task.name,
            task.attempt,
            action,
            now,
        )
        return False
