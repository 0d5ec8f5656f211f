"""Fenced writes from the process that runs the code: start a task, record its outcome.

Every write names the status it expects, the attempt and the owner. When it
matches no row, this attempt lost the task (cancelled, recovered after this
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
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from tether.broker.queries import q
from tether.worker.execute import Outcome
from tether.worker.protocol import TaskPayload

log = logging.getLogger("tether.worker.recorder")

T = TypeVar("T")
Row = dict[str, Any]


class Recorder:
    def __init__(
        self, url: str, worker_id: str, *, connect_timeout: int = 5, give_up_after_s: float = 300.0
    ) -> None:
        self.url = url
        self.worker_id = worker_id
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.connect_timeout = connect_timeout
        self.give_up_after_s = give_up_after_s
        self._conn: psycopg.Connection[Row] | None = None

    def _connection(self) -> psycopg.Connection[Row]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.url,
                autocommit=True,
                row_factory=dict_row,
                connect_timeout=self.connect_timeout,
                application_name="tether-child",
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
                log.warning("database connection lost during %s (%s); retrying in %.2fs", what, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                retried = True

    # -- statements -------------------------------------------------------------

    def start(self, task: TaskPayload) -> bool:
        """CLAIMED -> RUNNING. False if the claim was lost (then the code must not run)."""
        rows, retried = self._with_retry(
            f"starting task {task.id}",
            lambda c: c.execute(q("start_task"), self._fence(task, "CLAIMED")).fetchall(),
        )
        if rows:
            return True
        return self._explain_miss(task, "start", retried, applied_status="RUNNING")

    def record(
        self, task: TaskPayload, outcome: Outcome, next_task: TaskPayload | None = None
    ) -> tuple[bool, bool | None]:
        """Record the outcome (and start ``next_task`` in the same transaction).

        Returns (outcome recorded, next started or None when there was no next).
        """
        name, params = self._outcome_statement(task, outcome)

        def work(c: psycopg.Connection[Row]) -> tuple[bool, bool | None]:
            if next_task is None:
                return bool(c.execute(q(name), params).fetchall()), None
            with c.transaction():
                recorded = bool(c.execute(q(name), params).fetchall())
                started = bool(c.execute(q("start_task"), self._fence(next_task, "CLAIMED")).fetchall())
            return recorded, started

        (recorded, started), retried = self._with_retry(f"recording task {task.id}", work)
        if not recorded:
            applied = "PENDING" if outcome.will_retry else outcome.status
            recorded = self._explain_miss(task, "record its outcome", retried, applied_status=applied)
        if next_task is not None and not started:
            started = self._explain_miss(next_task, "start", retried, applied_status="RUNNING")
        return recorded, started

    def _outcome_statement(
        self, task: TaskPayload, outcome: Outcome, expect: str = "RUNNING"
    ) -> tuple[str, dict[str, Any]]:
        params = {
            **self._fence(task, expect),
            "expect": expect,
            "result": outcome.result_json,
            "error_code": outcome.error_code,
            "error_message": outcome.error_message,
            "hostname": self.hostname,
            "pid": self.pid,
        }
        if outcome.will_retry:
            params["delay"] = timedelta(seconds=outcome.retry_delay_s or 0.0)
            return "retry_task", params
        params["status"] = outcome.status
        return "finish_task", params

    def run_fenced_outcome(self, task: TaskPayload, outcome: Outcome, *, expect: str) -> bool:
        """Record an outcome decided outside the child (crash, unregistered): status ``expect`` -> outcome."""
        name, params = self._outcome_statement(task, outcome, expect=expect)
        rows, retried = self._with_retry(
            f"recording task {task.id}", lambda c: c.execute(q(name), params).fetchall()
        )
        if rows:
            return True
        if not retried:
            return False
        applied = "PENDING" if outcome.will_retry else outcome.status
        return self._explain_miss(task, "record its outcome", retried, applied_status=applied)

    def release(self, tasks: list[TaskPayload]) -> int:
        """CLAIMED -> PENDING for tasks whose code never started here (shutdown, dead child)."""
        params = {"ids": [t.id for t in tasks], "worker_id": self.worker_id}
        rows, _ = self._with_retry(
            "releasing claimed tasks", lambda c: c.execute(q("release_claimed"), params).fetchone()
        )
        return int(rows["released"]) if rows else 0

    def _fence(self, task: TaskPayload, expect: str) -> dict[str, Any]:
        return {"id": task.id, "attempt": task.attempt, "worker_id": self.worker_id, "expect": expect}

    def _explain_miss(self, task: TaskPayload, action: str, retried: bool, *, applied_status: str) -> bool:
        """A fenced write matched nothing. True if it was in fact our own earlier commit."""
        row, _ = self._with_retry(
            f"reading task {task.id}", lambda c: c.execute(q("get_fence"), {"id": task.id}).fetchone()
        )
        if (
            retried
            and row is not None
            and row["attempt"] == task.attempt
            and row["status"] == applied_status
            and row["claimed_by_worker_id"] in (self.worker_id, None)
        ):
            log.info("task %s: the write to %s was committed before the connection dropped", task.id, action)
            return True
        now = (
            "gone"
            if row is None
            else f"{row['status']}, attempt {row['attempt']}, owner {row['claimed_by_worker_id']}"
        )
        log.warning(
            "lost task %s (%s) attempt %d: could not %s, the row moved on (now %s); nothing was changed",
            task.id,
            task.name,
            task.attempt,
            action,
            now,
        )
        return False
