"""Retrying FAILED, CANCELLED and EXPIRED tasks by hand: one by id, or in bulk by filter.

A retried task becomes PENDING again, due now, as a new attempt of the same task (same
id, arguments and options): the next claim gives it the next attempt number, and every
earlier attempt stays in its history. Its retry policy starts over (``retry_count`` 0).
It keeps the checkpointed steps it recorded, so its next attempt resumes after the last one;
``from_scratch=True`` deletes them in the transaction that requeues it, and every step runs
again (docs/durable-steps.md#retrying-from-the-last-step).
A workflow step is retried under its workflow's rules (tether.workflow.reopen). See
docs/tasks.md#retrying-by-hand and docs/workflows.md#retrying-a-step.

``TaskHandle.retry()``, ``Tether.retry_tasks()``, ``tether retry`` and the dashboard call
these two functions.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from tether.broker import PostgresBroker, retries, tasks, workflows
from tether.broker.answers import Answer
from tether.broker.retries import RETRYABLE, Criteria, TaskToRetry
from tether.broker.rows import RetrySample as RetrySample  # what a bulk retry's sample holds
from tether.broker.types import Conn
from tether.errors import InvalidOptionError, TaskNotFoundError
from tether.ids import parse_task_id
from tether.names import check_by, check_queue_name, check_task_name
from tether.result import TaskStatus, WorkflowStatus
from tether.workflow import reopen

log = logging.getLogger("tether.retry")

#: Tasks per statement (and per transaction) of a bulk retry: millions of matches make
#: many small transactions, never one that holds a million row locks.
BATCH = 1000
MAX_SAMPLE = 1000
_RETRIED = "retried: PENDING as a new attempt"
_FROM_SCRATCH = "retried from scratch: PENDING as a new attempt, its recorded steps deleted"


@dataclass(frozen=True)
class RetryFilter:
    """Which ended tasks a bulk retry takes. Every field given must match.

    ``statuses``: one or more of FAILED, CANCELLED, EXPIRED. ``since`` / ``until``: when
    the task ended (``since`` included, ``until`` not), each an aware datetime or a
    timedelta meaning that long before now (database time). Tasks that end after the
    retry started are never taken.
    """

    statuses: tuple[str, ...] = (TaskStatus.FAILED,)  # TaskStatus members, or their names
    queue: str | None = None
    name: str | None = None
    error_code: str | None = None
    since: datetime | timedelta | None = None
    until: datetime | timedelta | None = None


@dataclass(frozen=True)
class RetryAnswer:
    """What a retry by id did. ``status``: the task's status after the call; ``reason``: why,
    in words ("retried: PENDING as a new attempt", "not retried: it is RUNNING ...")."""

    task_id: uuid.UUID
    retried: bool
    status: TaskStatus
    reason: str
    workflow_id: uuid.UUID | None = None  # the workflow of a step
    workflow_status: WorkflowStatus | None = None  # that workflow's status after the call


# The answers of the retrying requests, as PostgresBroker.run_request records them: a retry
# whose answer was lost with its connection says what it did, not "it is PENDING".
RETRY_ANSWER: Answer[RetryAnswer] = Answer(RetryAnswer)
RETRIED_ANSWER: Answer[list[retries.Retried]] = Answer(list[retries.Retried])


@dataclass(frozen=True)
class BulkRetry:
    """What a bulk retry matched and did. A dry run only counts: retried and skipped are 0.

    ``sample``: the first matched tasks (in id order); ``skips``: the first tasks that
    matched but were not retried, each with its reason.
    """

    matched: int
    retried: int
    skipped: int
    dry_run: bool
    sample: list[RetrySample]
    skips: list[RetryAnswer] = field(default_factory=list)


# -- one task -----------------------------------------------------------------------------------


def retry_task(
    broker: PostgresBroker, task_id: uuid.UUID | str, *, by: str | None = None, from_scratch: bool = False
) -> RetryAnswer:
    """Retry one FAILED, CANCELLED or EXPIRED task; any other status changes nothing.

    It keeps its recorded steps (the new attempt resumes after the last one) unless
    ``from_scratch``: then they are deleted with the requeue, in one transaction. ``by``
    says who asked (logged). Raises TaskNotFoundError for an unknown id.
    """
    tid = parse_task_id(task_id)
    check_by(by)
    _check_from_scratch(from_scratch)
    found = broker.run(lambda conn: retries.task_to_retry(conn, tid))
    if found is None:
        raise _not_found(tid)
    workflow_id = found.workflow_id
    if workflow_id is not None:
        answer = broker.run_request(
            lambda conn: _retry_step(conn, tid, workflow_id, from_scratch), RETRY_ANSWER
        )
    else:
        answer = broker.run_request(lambda conn: _retry_plain(conn, found, from_scratch), RETRY_ANSWER)
    _log_one(answer, by)
    return answer


def _retry_plain(conn: Conn, task: TaskToRetry, from_scratch: bool) -> RetryAnswer:
    if task.status not in RETRYABLE:
        return _wrong_status(task.id, task.status)
    (row,) = retries.retry_tasks(conn, [task.id], from_scratch=from_scratch) or (None,)
    if row is not None and row.retried:
        return RetryAnswer(task.id, True, TaskStatus.PENDING, _retried(from_scratch))
    if row is not None and row.holder is not None:
        return RetryAnswer(task.id, False, task.status, _key_held(task.unique_key, row.holder))
    # Its status changed since it was read (another retry won the race).
    now = retries.task_to_retry(conn, task.id)
    if now is None:
        raise _not_found(task.id)
    return _wrong_status(task.id, now.status)


def _retry_step(conn: Conn, task_id: uuid.UUID, workflow_id: uuid.UUID, from_scratch: bool) -> RetryAnswer:
    """A workflow step's retry: one transaction, the workflow's row locked first."""
    with conn.transaction():
        wf = workflows.lock_workflow(conn, workflow_id)
        task = retries.lock_task(conn, task_id)
        if task is None:
            raise _not_found(task_id)
        if task.status not in RETRYABLE:
            return _wrong_status(task_id, task.status, workflow_id, None if wf is None else wf.status)
        status = task.status

        def refused(reason: str, wf_status: WorkflowStatus | None = None) -> RetryAnswer:
            return RetryAnswer(task_id, False, status, f"not retried: {reason}", workflow_id, wf_status)

        if wf is None:
            return refused(f"its workflow {workflow_id} no longer exists (pruned by retention?)")
        if wf.status is WorkflowStatus.CANCELLED:
            return refused(
                f"its workflow {workflow_id} ({wf.name}) was cancelled, and nothing new starts in "
                "a cancelled workflow (start a new workflow instead)",
                wf.status,
            )
        if wf.status is WorkflowStatus.COMPLETED:
            return refused(f"its workflow {workflow_id} ({wf.name}) has completed", wf.status)
        workflows.plan_as_lookups(conn)
        step = next(iter(retries.steps(conn, workflow_id, [task_id])), None)
        if step is None:
            return refused(f"its workflow {workflow_id} has no step for it", wf.status)
        planned = reopen.plan(conn, workflow_id, step)
        if isinstance(planned, reopen.Refusal):
            return refused(planned.reason, wf.status)
        rows = retries.retry_tasks(conn, [task_id], workflow_id=workflow_id, from_scratch=from_scratch)
        (row,) = rows or (None,)
        if row is None or not row.retried:
            # Nothing written but the key row's no-op update (retries.sql).
            if row is not None and row.holder is not None:
                held = _key_held(task.unique_key, row.holder)
                return refused(held.removeprefix("not retried: "), wf.status)
            return refused("its status changed meanwhile", wf.status)
        after = reopen.apply(conn, workflow_id, planned) or wf.status
    if not planned.settled:
        how = f"{_retried(from_scratch)} (its workflow {workflow_id} had not taken the outcome yet)"
    else:
        how = (
            f"{_retried(from_scratch)}; step {step.node_name!r} is ENQUEUED again and its "
            f"workflow {workflow_id} is {after}"
        )
        if planned.unskipped:
            how += f"; skipped step(s) waiting again: {', '.join(planned.unskipped)}"
    return RetryAnswer(task_id, True, TaskStatus.PENDING, how, workflow_id, after)


# -- in bulk ------------------------------------------------------------------------------------


def retry_tasks(
    broker: PostgresBroker,
    filter: RetryFilter,
    *,
    by: str | None = None,
    dry_run: bool = False,
    sample_size: int = 10,
    from_scratch: bool = False,
) -> BulkRetry:
    """Retry every task ``filter`` matches, in batches of BATCH tasks (one statement and one
    transaction each, in id order); workflow steps one by one, by their workflow's rules.

    ``dry_run``: count what matches and return a sample; change nothing. ``from_scratch``:
    delete each retried task's recorded steps with its requeue (else it resumes after them).
    Bad arguments raise InvalidOptionError before anything is read.
    """
    wanted = _check_filter(filter)
    check_by(by)
    _check_from_scratch(from_scratch)
    if not isinstance(dry_run, bool):
        raise InvalidOptionError(f"dry_run must be a bool, got {dry_run!r}")
    if (
        isinstance(sample_size, bool)
        or not isinstance(sample_size, int)
        or not 0 <= sample_size <= MAX_SAMPLE
    ):
        raise InvalidOptionError(f"sample_size must be an int from 0 to {MAX_SAMPLE}, got {sample_size!r}")
    criteria = _resolve(wanted, broker.run(tasks.database_now))
    if dry_run:
        matched = broker.run(lambda conn: retries.count_candidates(conn, criteria))
        first = (
            broker.run(lambda conn: retries.find_candidates(conn, criteria, after=None, limit=sample_size))
            if sample_size and matched
            else []
        )
        log.info(
            "bulk retry (dry run) asked by %s: %d task(s) match %s", by or "unknown", matched, _shown(wanted)
        )
        return BulkRetry(matched, 0, 0, True, first)
    done = _Progress(sample_size)
    after: uuid.UUID | None = None
    while True:
        page = broker.run(partial(retries.find_candidates, criteria=criteria, after=after, limit=BATCH))
        if not page:
            break
        done.matched_page(page)
        plain = [c for c in page if c.workflow_id is None]
        if plain:
            ids = [c.id for c in plain]
            batch = partial(
                retries.retry_tasks, task_ids=ids, statuses=criteria.statuses, from_scratch=from_scratch
            )
            rows = broker.run_request(batch, RETRIED_ANSWER)
            done.plain(plain, {r.id: r for r in rows})
        for c in page:
            if c.workflow_id is not None:
                done.step(_bulk_step(broker, c, from_scratch))
        after = page[-1].id
        if len(page) < BATCH:
            break
    log.info(
        "bulk retry%s asked by %s: %d task(s) matched %s, %d retried, %d skipped",
        " from scratch" if from_scratch else "",
        by or "unknown",
        done.matched,
        _shown(wanted),
        done.retried,
        done.skipped,
    )
    return BulkRetry(done.matched, done.retried, done.skipped, False, done.sample, done.skips)


def _bulk_step(broker: PostgresBroker, c: RetrySample, from_scratch: bool) -> RetryAnswer:
    assert c.workflow_id is not None
    workflow_id = c.workflow_id
    try:
        return broker.run_request(
            lambda conn: _retry_step(conn, c.id, workflow_id, from_scratch), RETRY_ANSWER
        )
    except TaskNotFoundError:
        return RetryAnswer(c.id, False, c.status, "not retried: it was deleted meanwhile")


@dataclass
class _Progress:
    sample_size: int
    matched: int = 0
    retried: int = 0
    skipped: int = 0
    sample: list[RetrySample] = field(default_factory=list)
    skips: list[RetryAnswer] = field(default_factory=list)

    def matched_page(self, page: list[RetrySample]) -> None:
        self.matched += len(page)
        room = self.sample_size - len(self.sample)
        self.sample += page[: max(room, 0)]

    def plain(self, page: list[RetrySample], rows: dict[uuid.UUID, retries.Retried]) -> None:
        for c in page:
            row = rows.get(c.id)
            if row is not None and row.retried:
                self.retried += 1
                continue
            self.skipped += 1
            if len(self.skips) < self.sample_size:
                reason = (
                    _key_held(c.unique_key, row.holder)
                    if row is not None and row.holder is not None
                    else "not retried: its status changed meanwhile"
                )
                self.skips.append(RetryAnswer(c.id, False, c.status, reason))

    def step(self, answer: RetryAnswer) -> None:
        if answer.retried:
            self.retried += 1
            return
        self.skipped += 1
        if len(self.skips) < self.sample_size:
            self.skips.append(answer)


# -- checks, words, logs -------------------------------------------------------------------------


def _check_from_scratch(value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidOptionError(f"from_scratch must be a bool, got {value!r}")


def _retried(from_scratch: bool) -> str:
    return _FROM_SCRATCH if from_scratch else _RETRIED


def _check_filter(value: Any) -> RetryFilter:
    if not isinstance(value, RetryFilter):
        raise InvalidOptionError(f"filter must be a RetryFilter, got {type(value).__name__}")
    statuses = _check_statuses(value.statuses)
    if value.queue is not None:
        check_queue_name(value.queue, "filter.queue")
    if value.name is not None:
        check_task_name(value.name, "filter.name")
    _check_text("filter.error_code", value.error_code)
    since = _check_time("filter.since", value.since)
    until = _check_time("filter.until", value.until)
    # Both absolute (earlier first) or both relative (further back first); a mix is
    # checked once "now" is known (_resolve).
    if (isinstance(since, datetime) and isinstance(until, datetime) and since >= until) or (
        isinstance(since, timedelta) and isinstance(until, timedelta) and since <= until
    ):
        raise InvalidOptionError(f"filter.since ({since}) must be before filter.until ({until})")
    return RetryFilter(statuses, value.queue, value.name, value.error_code, since, until)


def _check_statuses(value: Any) -> tuple[TaskStatus, ...]:
    items: Iterable[Any] = (value,) if isinstance(value, str) else value
    try:
        given = [str(s).upper() if isinstance(s, str) else s for s in items]
    except TypeError:
        raise InvalidOptionError(f"filter.statuses must be a tuple of statuses, got {value!r}") from None
    if not given:
        raise InvalidOptionError(f"filter.statuses is empty: give one or more of {', '.join(RETRYABLE)}")
    for status in given:
        if status not in RETRYABLE:
            raise InvalidOptionError(
                f"filter.statuses: {status!r} cannot be retried; give one or more of {', '.join(RETRYABLE)}"
            )
    return tuple(dict.fromkeys(TaskStatus(s) for s in given))


def _check_text(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value or "\x00" in value:
        raise InvalidOptionError(f"{name} must be a non-empty string without NUL characters, got {value!r}")


def _check_time(name: str, value: Any) -> datetime | timedelta | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidOptionError(f"{name} must be timezone-aware, got the naive datetime {value}")
        return value
    if isinstance(value, timedelta):
        if value <= timedelta(0):
            raise InvalidOptionError(f"{name} must be a positive timedelta (that long ago), got {value}")
        return value
    raise InvalidOptionError(
        f"{name} must be an aware datetime or a timedelta (that long ago), got {type(value).__name__}"
    )


def _resolve(wanted: RetryFilter, now: datetime) -> Criteria:
    """Absolute bounds in database time; never past the retry's start."""
    since = now - wanted.since if isinstance(wanted.since, timedelta) else wanted.since
    until = now - wanted.until if isinstance(wanted.until, timedelta) else wanted.until
    until = now if until is None else min(until, now)
    if since is not None and since >= until:
        raise InvalidOptionError(
            f"filter.since ({since}) must be before filter.until ({until}; the database's time is {now})"
        )
    statuses = tuple(TaskStatus(s) for s in wanted.statuses)  # checked: each is retryable
    return Criteria(statuses, wanted.queue, wanted.name, wanted.error_code, since, until)


def _wrong_status(
    task_id: uuid.UUID,
    status: TaskStatus,
    workflow_id: uuid.UUID | None = None,
    wf_status: WorkflowStatus | None = None,
) -> RetryAnswer:
    return RetryAnswer(
        task_id,
        False,
        status,
        f"not retried: it is {status} (only FAILED, CANCELLED and EXPIRED tasks can be retried)",
        workflow_id,
        wf_status,
    )


def _key_held(key: str | None, holder: uuid.UUID) -> str:
    return (
        f"not retried: its unique key {key!r} is held by task {holder}, which has not ended "
        "(a task may not run twice at once under one key)"
    )


def _not_found(task_id: uuid.UUID) -> TaskNotFoundError:
    return TaskNotFoundError(f"no task with id {task_id} (never sent, or pruned by retention)")


def _shown(wanted: RetryFilter) -> str:
    parts = [f"statuses={','.join(wanted.statuses)}"]
    parts += [
        f"{name}={getattr(wanted, name)}"
        for name in ("queue", "name", "error_code", "since", "until")
        if getattr(wanted, name) is not None
    ]
    return "(" + " ".join(parts) + ")"


def _log_one(answer: RetryAnswer, by: str | None) -> None:
    log.info(
        "task %s: retry asked by %s: %s",
        answer.task_id,
        by or "unknown",
        answer.reason,
        extra={"task_id": str(answer.task_id)},
    )
