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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from tether import outcomes
from tether.broker import claims, heartbeats, steps, suspensions
from tether.broker.claims import Fence, FenceState, OutcomeWrite, TaskPayload
from tether.broker.types import Conn, DatabaseError, OperationalError, RolledBackError
from tether.config import AppConfig
from tether.db.connection import DedicatedConnection
from tether.db.read_only import ServerReadOnlyError
from tether.log_fields import about_task
from tether.outcomes import Outcome
from tether.result import ErrorCode, TaskError, TaskStatus
from tether.worker.backoff import Backoff
from tether.workflow import engine

log = logging.getLogger("tether.worker.recorder")

T = TypeVar("T")


class Recorder:
    """The fenced writes of one process (a child, or the worker's main process) on its own connection."""

    def __init__(
        self,
        url: str,
        worker_id: str,
        config: AppConfig,
        *,
        give_up_after_s: float = 300.0,
        role: str = "worker",
    ) -> None:
        """``role`` names the connection in pg_stat_activity: ``tether-<role>``."""
        self.worker_id = worker_id
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.give_up_after_s = give_up_after_s
        self.connection = DedicatedConnection(url, config, role)
        # The main process calls in from worker threads; one statement at a time.
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self.connection.close()

    def _with_retry(self, what: str, work: Callable[[Conn], T]) -> tuple[T, bool]:
        """Run ``work``; on a lost connection reconnect and run it again. Returns (value, retried).

        Each connection lost during a statement is a WARNING. Failing to connect again is
        one WARNING per statement, the further tries at DEBUG: a database away for minutes
        would otherwise log a line per try for every task waiting to be recorded.
        """
        backoff = Backoff(0.05, 2.0)
        deadline = time.monotonic() + self.give_up_after_s
        retried = unreachable = refused_before = False
        with self._lock:
            while True:
                conn: Conn | None = None
                try:
                    conn = self.connection.get()
                    return work(conn), retried
                except RolledBackError as exc:
                    # A deadlock with another writer of the same rows (a batch and the
                    # reaper lock them in different orders): nothing was written.
                    if time.monotonic() > deadline:
                        raise
                    log.warning("%s was rolled back by the database (%s); running it again", what, exc)
                    retried = True
                    continue
                except OperationalError as exc:
                    self.connection.close()
                    if time.monotonic() > deadline:
                        log.error(
                            "giving up on %s after %.0fs without the database: %s",
                            what,
                            self.give_up_after_s,
                            exc,
                        )
                        raise
                    delay = backoff.next()
                    if conn is not None:  # it broke under the statement
                        # A read-only server (a failover) refuses every try until a primary
                        # answers: one WARNING per statement, the further tries at DEBUG.
                        quiet = isinstance(exc, ServerReadOnlyError) and refused_before
                        refused_before = refused_before or isinstance(exc, ServerReadOnlyError)
                        log.log(
                            logging.DEBUG if quiet else logging.WARNING,
                            "database connection lost during %s (%s); retrying in %.2fs",
                            what,
                            exc,
                            delay,
                        )
                    else:  # no new one could be opened: the database is still away
                        log.log(
                            logging.DEBUG if unreachable else logging.WARNING,
                            "cannot reach the database for %s (%s); retrying in %.2fs, "
                            "then with backoff up to 2s (further tries at DEBUG)",
                            what,
                            exc,
                            delay,
                        )
                        unreachable = True
                    time.sleep(delay)
                    retried = True

    def fence(self, task: TaskPayload, expect: TaskStatus) -> Fence:
        return Fence(task.id, task.attempt, self.worker_id, expect)

    # -- statements -------------------------------------------------------------

    def start(self, task: TaskPayload) -> bool:
        """CLAIMED -> RUNNING. False if the claim was lost (then the code must not run)."""
        started, retried = self._with_retry(
            f"starting task {task.id}", lambda c: claims.start_task(c, task, self.worker_id)
        )
        return started or self._explain_miss(task, "start", retried, settled=TaskStatus.RUNNING) is not None

    def record(
        self, task: TaskPayload, outcome: Outcome, next_task: TaskPayload | None = None
    ) -> tuple[TaskStatus | None, bool | None]:
        """Record the outcome (and start ``next_task`` in the same transaction).

        Returns (the status the row settled in, None when the outcome was not recorded;
        next started, or None when there was no next). The status is the outcome's, except
        that a failure of a task whose cancel was requested settles as CANCELLED.
        """
        if outcome.suspension is not None:  # its own statement: it writes a step, not a result
            suspended = self.suspend(task, outcome)
            return suspended, None if next_task is None else self.start(next_task)
        fence = self.fence(task, TaskStatus.RUNNING)

        def work(c: Conn) -> tuple[TaskStatus | None, bool | None]:
            # One statement in autocommit: the outcome, its attempt row and the next
            # task's start commit together, in one round trip.
            done = claims.record_outcome(
                c, fence, outcome, hostname=self.hostname, pid=self.pid, start_next=next_task
            )
            return done.settled, None if next_task is None else done.next_started

        (settled, started), retried = self._with_retry(f"recording task {task.id}", work)
        if settled is None:
            settled = self._explain_miss(task, "record its outcome", retried, settled=outcome.settles_as)
        if next_task is not None and not started:
            started = self._explain_miss(next_task, "start", retried, settled=TaskStatus.RUNNING) is not None
        if settled is not None:
            self.after_outcome(task, settled)
        return settled, started

    def write_batch(
        self, outcomes: Sequence[OutcomeWrite], starts: Sequence[TaskPayload] = ()
    ) -> tuple[dict[str, TaskStatus], set[str]]:
        """Record many outcomes and start many tasks in one statement; returns (the status each
        recorded task settled in, the ids started).

        A miss is explained as in record(); a row the database refuses (the batch fails
        as a whole) makes each write go alone, so it cannot hold back the others.
        """
        suspended: dict[str, TaskStatus] = {}
        if any(w.outcome.suspension is not None for w in outcomes):
            for w in outcomes:
                if w.outcome.suspension is not None and (done := self.suspend(w.task, w.outcome)) is not None:
                    suspended[w.task.id] = done
            outcomes = [w for w in outcomes if w.outcome.suspension is None]
        settled, started, retried = self._write_batch(outcomes, starts)
        settled |= suspended
        missed = [w.task for w in outcomes if w.task.id not in settled]
        if missed:
            expected = {w.task.id: w.outcome.settles_as for w in outcomes}
            settled |= self._explain_misses(missed, expected, retried)
        missed_starts = [t for t in starts if t.id not in started]
        if missed_starts:
            started |= set(
                self._explain_misses(
                    missed_starts, {t.id: TaskStatus.RUNNING for t in missed_starts}, retried
                )
            )
        self.after_outcomes([w.task for w in outcomes if w.task.id in settled], settled)
        return settled, started

    def _write_batch(
        self, outcomes: Sequence[OutcomeWrite], starts: Sequence[TaskPayload]
    ) -> tuple[dict[str, TaskStatus], set[str], bool]:
        """The batch in one statement: (settled statuses, started, whether it ran more than once)."""
        what = f"writing {len(outcomes)} outcome(s) and {len(starts)} start(s)"
        try:
            written, retried = self._with_retry(
                what,
                lambda c: claims.write_batch(
                    c,
                    worker_id=self.worker_id,
                    hostname=self.hostname,
                    pid=self.pid,
                    outcomes=outcomes,
                    starts=starts,
                ),
            )
            return dict(written.settled), set(written.started), retried
        except OperationalError:
            raise  # the database stayed away past give_up_after_s
        except DatabaseError:
            log.exception("%s failed; writing each row alone", what)
        settled = {}
        for w in outcomes:
            status = self._record_alone(w)
            if status is not None:
                settled[w.task.id] = status
        started = {t.id for t in starts if self.start(t)}
        return settled, started, False

    def _record_alone(self, write: OutcomeWrite) -> TaskStatus | None:
        """One outcome on its own; if the database refuses it, a failure that says why instead.
        Returns the status the row settled in, None if the write matched nothing."""
        fence = self.fence(write.task, write.expect)
        try:
            done, _ = self._with_retry(
                f"recording task {write.task.id}",
                lambda c: claims.record_outcome(
                    c, fence, write.outcome, hostname=self.hostname, pid=self.pid
                ),
            )
            return done.settled
        except OperationalError:
            raise
        except DatabaseError as exc:
            log.exception(
                "task %s: the database refused its outcome; recording the refusal",
                write.task.id,
                extra=about_task(write.task, self.worker_id),
            )
            error = TaskError(ErrorCode.RESULT_NOT_SERIALIZABLE, f"the database refused the outcome: {exc}")
            outcome = outcomes.failure(error, write.task.retry_policy, write.task.retry_count)
            done, _ = self._with_retry(
                f"recording task {write.task.id}",
                lambda c: claims.record_outcome(c, fence, outcome, hostname=self.hostname, pid=self.pid),
            )
            return done.settled

    def record_crashes(
        self, tasks: Sequence[TaskPayload], killed_for: Mapping[str, TaskError], how: str
    ) -> dict[str, str]:
        """A child holding ``tasks`` died: each started one failed (or is retried), each unstarted one
        never ran and goes back to PENDING. One statement for the started ones, one for the rest.

        killed_for: the error of each task the worker killed the child for (its time limit,
        or a cancel it ignored); every other started task crashed, ``how`` says in what way.
        A task whose cancel was requested settles as CANCELLED whatever the reason. Returns
        what became of each task, for the log.
        """
        writes = []
        for task in tasks:
            error = killed_for.get(task.id)
            if error is not None:
                outcome = outcomes.failure(error, task.retry_policy, task.retry_count)
            else:
                outcome = outcomes.crashed(task.retry_policy, task.retry_count, how)
            writes.append(OutcomeWrite(task, outcome))
        settled, _, retried = self._write_batch(writes, ())
        missed = [w.task for w in writes if w.task.id not in settled]
        if retried and missed:  # one of ours may have committed before the connection dropped
            expected = {w.task.id: w.outcome.settles_as for w in writes}
            settled |= self._explain_misses(missed, expected, retried, quiet=True)
        verdicts: dict[str, str] = {}
        for w in writes:
            status = settled.get(w.task.id)
            if status is not None:
                code = w.outcome.error_code
                verdicts[w.task.id] = (
                    f"retry scheduled after {code}"
                    if status is TaskStatus.PENDING
                    else "CANCELLED (its cancel had been requested)"
                    if status is TaskStatus.CANCELLED and code != ErrorCode.TASK_CANCELLED
                    else f"{status} with {code}"
                )
        self.after_outcomes([w.task for w in writes if w.task.id in settled], settled)
        unstarted = [t for t in tasks if t.id not in settled]
        if unstarted:
            released = self.release(unstarted)
            for task in unstarted:
                verdicts[task.id] = (
                    "released back to PENDING (its code never started)"
                    if task.id in released
                    else "already settled elsewhere"
                )
        return verdicts

    def after_outcomes(self, written: Sequence[TaskPayload], settled: Mapping[str, TaskStatus]) -> None:
        """after_outcome for a batch (``settled``: each task's status now): one advance per workflow."""
        steps: dict[str, list[str]] = {}
        for task in written:
            if (
                task.workflow_id is not None
                and settled.get(task.id, TaskStatus.PENDING) is not TaskStatus.PENDING
            ):
                steps.setdefault(task.workflow_id, []).append(task.id)
        for workflow_id, task_ids in steps.items():
            self._advance(workflow_id, task_ids)

    def record_for(self, task: TaskPayload, outcome: Outcome, *, expect: TaskStatus) -> bool:
        """Record an outcome decided outside the child (crash, unregistered): ``expect`` -> outcome."""
        fence = self.fence(task, expect)
        done, retried = self._with_retry(
            f"recording task {task.id}",
            lambda c: claims.record_outcome(c, fence, outcome, hostname=self.hostname, pid=self.pid),
        )
        settled = done.settled
        if settled is None and retried:
            settled = self._explain_miss(task, "record its outcome", retried, settled=outcome.settles_as)
        if settled is not None:
            self.after_outcome(task, settled)
        return settled is not None

    def after_outcome(self, task: TaskPayload, settled: TaskStatus) -> None:
        """A workflow step's task has ended (``settled``: its status now; PENDING, a retry, has
        not ended): advance its workflow (a transaction of its own).

        If this process dies first, the step stays ENQUEUED with an ended task and
        the reaper's reconciliation advances the workflow instead.
        """
        if task.workflow_id is None or settled is TaskStatus.PENDING:
            return
        self._advance(task.workflow_id, [task.id])

    def _advance(self, workflow_id: str, task_ids: list[str]) -> None:
        try:
            self._with_retry(
                f"advancing workflow {workflow_id}",
                lambda c: engine.advance(c, workflow_id, task_ids),
            )
        except Exception:  # never fatal to the worker: reconciliation repairs the step
            log.exception(
                "task(s) %s: could not advance workflow %s; the reaper will reconcile the step",
                ", ".join(task_ids),
                workflow_id,
                extra={"task_ids": task_ids, "task_count": len(task_ids), "workflow_id": workflow_id},
            )

    def unstart(self, task: TaskPayload) -> bool:
        """RUNNING -> PENDING for a task this process started but whose code it never ran."""
        given_back, _ = self._with_retry(
            f"giving back task {task.id}", lambda c: claims.unstart_task(c, task, self.worker_id)
        )
        return given_back

    def release(self, tasks: list[TaskPayload]) -> set[str]:
        """CLAIMED -> PENDING for tasks whose code never started here (shutdown, dead child);
        returns the ids released (the others had moved on)."""
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

    def load_steps(self, task: TaskPayload) -> dict[steps.StepKey, str]:
        """The steps of ``task`` stored by earlier attempts (read once per attempt)."""
        done, _ = self._with_retry(
            f"reading the steps of task {task.id}", lambda c: steps.load_steps(c, task.id)
        )
        return done

    def write_step(self, task: TaskPayload, name: str, occurrence: int, result: str) -> str | None:
        """Store one completed step of ``task`` (fenced); the stored JSON text, or None when this
        attempt lost the task (nothing was written, a WARNING says so)."""
        written, _ = self._with_retry(
            f"recording step {name!r} of task {task.id}",
            lambda c: steps.write_step(
                c,
                task_id=task.id,
                attempt=task.attempt,
                worker_id=self.worker_id,
                name=name,
                occurrence=occurrence,
                result=result,
            ),
        )
        if not written.held:
            self._explain_miss(task, f"record step {name!r}", False, settled=TaskStatus.RUNNING)
            return None
        # Held but nothing inserted: a retry after a connection lost around our own COMMIT
        # found the row it wrote (no other attempt can write while this one holds the task).
        return written.stored if written.stored is not None else result

    def write_steps(self, writes: Sequence[tuple[TaskPayload, str, int, str]]) -> list[str | None]:
        """write_step for many steps (task, name, occurrence, result) in one statement; the answer
        of each, in order."""
        rows = [steps.StepToWrite(t.id, t.attempt, name, occ, result) for t, name, occ, result in writes]
        done, _ = self._with_retry(
            f"recording {len(rows)} step(s)",
            lambda c: steps.write_steps(c, worker_id=self.worker_id, steps=rows),
        )
        answers: list[str | None] = []
        for task, name, occurrence, result in writes:
            key = (task.id, name, occurrence)
            if key not in done:
                self._explain_miss(task, f"record step {name!r}", False, settled=TaskStatus.RUNNING)
                answers.append(None)
            else:  # None: our own row, found by a retry after a lost COMMIT (see write_step)
                answers.append(done[key] or result)
        return answers

    def suspend(self, task: TaskPayload, outcome: Outcome) -> TaskStatus | None:
        """Record a suspension (a sleep, a wait): the task PENDING until due, fenced like an outcome.
        Returns PENDING; CANCELLED when a cancel requested meanwhile won (recorded as such); None
        when this attempt lost its task (a WARNING says so)."""
        s = outcome.suspension
        assert s is not None
        done, retried = self._with_retry(
            f"suspending task {task.id}",
            lambda c: suspensions.suspend_task(
                c,
                task_id=task.id,
                attempt=task.attempt,
                worker_id=self.worker_id,
                hostname=self.hostname,
                pid=self.pid,
                name=s.name,
                occurrence=s.occurrence,
                delay_s=s.delay_s,
                key=s.key,
            ),
        )
        if done.suspended:
            return TaskStatus.PENDING
        if done.cancel_requested:
            settled, _ = self.record(task, outcomes.cancelled("cancelled while running (it was suspending)"))
            return settled
        return self._explain_miss(task, "suspend", retried, settled=TaskStatus.PENDING)

    def take_event(self, task: TaskPayload, occurrence: int, key: str) -> suspensions.Taken:
        """wait_for_event's first look: the key's event, or the wait's timeout, stored as its step."""
        taken, retried = self._with_retry(
            f"taking event {key!r} for task {task.id}",
            lambda c: suspensions.take_event(
                c,
                task_id=task.id,
                attempt=task.attempt,
                worker_id=self.worker_id,
                occurrence=occurrence,
                key=key,
            ),
        )
        if not taken.held:
            self._explain_miss(task, f"wait for event {key!r}", False, settled=TaskStatus.RUNNING)
        elif taken.stored is None and retried:
            # The connection dropped around a COMMIT: our own earlier try may have stored the step.
            mine = self.load_steps(task).get((suspensions.EVENT_STEP, occurrence))
            if mine is not None:
                return suspensions.Taken(True, mine, None)
        return taken

    def _explain_miss(
        self, task: TaskPayload, action: str, retried: bool, *, settled: TaskStatus
    ) -> TaskStatus | None:
        """A fenced write matched nothing. The row's status if it was in fact our own earlier
        commit, else None."""
        now, _ = self._with_retry(f"reading task {task.id}", lambda c: claims.read_fence(c, task.id))
        return now.status if now is not None and self._judge(task, now, action, retried, settled) else None

    def _explain_misses(
        self,
        tasks: Sequence[TaskPayload],
        settled: Mapping[str, TaskStatus],
        retried: bool,
        *,
        quiet: bool = False,
    ) -> dict[str, TaskStatus]:
        """_explain_miss for the misses of a batch, read in one statement; returns the status of
        each that was our own earlier commit. quiet: a miss is expected (a crash record), do not warn."""
        fences, _ = self._with_retry(
            f"reading {len(tasks)} task(s)", lambda c: claims.read_fences(c, [t.id for t in tasks])
        )
        ours = {}
        for task in tasks:
            expected = settled[task.id]
            action = "start" if expected is TaskStatus.RUNNING else "record its outcome"
            now = fences.get(task.id)
            if now is not None and self._judge(task, now, action, retried, expected, quiet=quiet):
                ours[task.id] = now.status
        return ours

    def _judge(
        self,
        task: TaskPayload,
        now: FenceState | None,
        action: str,
        retried: bool,
        settled: TaskStatus,
        *,
        quiet: bool = False,
    ) -> bool:
        if (
            retried
            and now is not None
            and now.attempt == task.attempt
            # A failure of a task whose cancel was requested settles as CANCELLED.
            and (
                now.status is settled
                or (now.status is TaskStatus.CANCELLED and settled in (TaskStatus.FAILED, TaskStatus.PENDING))
            )
            and now.owner in (self.worker_id, None)
            # An outcome is ours only if this process wrote its attempt row (a reaper
            # that recorded the same status leaves pid NULL); a start has no such row.
            and (settled is TaskStatus.RUNNING or now.recorded_by_pid == self.pid)
        ):
            log.info(
                "task %s: the write to %s was committed before the connection dropped",
                task.id,
                action,
                extra=about_task(task, self.worker_id),
            )
            return True
        if quiet:
            return False
        holder = "gone" if now is None else f"{now.status}, attempt {now.attempt}, owner {now.owner}"
        log.warning(
            "lost task %s (%s) attempt %d: could not %s, the row moved on (now %s); nothing was changed",
            task.id,
            task.name,
            task.attempt,
            action,
            holder,
            extra=about_task(task, self.worker_id),
        )
        return False
