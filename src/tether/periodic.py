"""Periodic tasks: a schedule's declaration, which slots to send, and the sync at worker start.

A *slot* is one instant a cron expression names (tether.cron). Each slot gets at most one
task, enforced by a unique index on (schedule_name, schedule_slot); the worker's scheduler
(worker/scheduler.py) decides which due slots to send with ``plan_slots`` and writes them
through broker/schedules.py. See docs/periodic.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

from tether import codec
from tether.broker import schedules
from tether.broker.schedules import ScheduleDefinition
from tether.broker.types import Conn
from tether.cron import Cron, CronError
from tether.errors import (
    BadArgumentsError,
    InvalidOptionError,
    ScheduleDefinitionError,
    ScheduleNotFoundError,
    SerializationError,
)
from tether.limits import check_concurrency_key
from tether.names import is_task_name
from tether.options import SendOptions

log = logging.getLogger("tether.periodic")

CatchUp = Literal["latest", "all", "none"]
Overlap = Literal["allow", "skip"]
CATCH_UPS: tuple[CatchUp, ...] = ("latest", "all", "none")
OVERLAPS: tuple[Overlap, ...] = ("allow", "skip")

#: catch_up="all" sends at most this many missed slots (the most recent), with a warning.
CATCH_UP_LIMIT = 100
#: catch_up="none": a slot is on time (sent) when found at most this late, and at most half
#: the time to the slot after it (so a fast schedule's slot never counts as on time twice).
ON_TIME = timedelta(seconds=10)


class PeriodicTask(Protocol):
    """What a schedule uses of its task (a tether.task.Task)."""

    @property
    def name(self) -> str: ...

    @property
    def options(self) -> SendOptions: ...

    @property
    def retry_policy(self) -> Any: ...

    def encode_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str]: ...

    def bound_argument(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any: ...


@dataclass(frozen=True)
class Schedule:
    """A periodic task declared in code (``app.periodic``)."""

    name: str
    cron: Cron
    task_name: str
    definition: ScheduleDefinition

    def __repr__(self) -> str:
        return f"Schedule({self.name!r}, {self.cron.expression!r}, task={self.task_name!r})"


def declare(
    cron: str,
    task: PeriodicTask,
    *,
    name: str | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    timezone: str,
    catch_up: str,
    overlap: str,
    options: SendOptions,
) -> Schedule:
    """Check everything about a schedule now; the error names the schedule and the argument."""
    schedule_name = task.name if name is None else name
    what = f"schedule {schedule_name!r}"
    if not is_task_name(schedule_name):  # a schedule is named as its task is
        raise ScheduleDefinitionError(
            f"schedule name {schedule_name!r} is invalid: use letters, digits, '_', '.', ':' or '-' "
            "(up to 200 characters, not starting with a digit)"
        )
    try:
        parsed = Cron(cron, timezone)
    except CronError as exc:
        raise ScheduleDefinitionError(f"{what}: {exc}") from None
    if catch_up not in CATCH_UPS:
        raise ScheduleDefinitionError(
            f"{what}: catch_up must be one of {', '.join(CATCH_UPS)}; got {catch_up!r}"
        )
    if overlap not in OVERLAPS:
        raise ScheduleDefinitionError(
            f"{what}: overlap must be one of {', '.join(OVERLAPS)}; got {overlap!r}"
        )
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise ScheduleDefinitionError(f"{what}: args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ScheduleDefinitionError(f"{what}: kwargs must be a dict, got {type(kwargs).__name__}")
    try:
        args_json, kwargs_json = task.encode_arguments(tuple(args), dict(kwargs or {}))
    except (BadArgumentsError, SerializationError) as exc:
        raise ScheduleDefinitionError(f"{what}: {exc}") from None
    try:
        key = _concurrency_key(task, options, args, kwargs or {})
    except InvalidOptionError as exc:
        raise ScheduleDefinitionError(f"{what}: {exc}") from None
    policy = task.retry_policy
    definition = ScheduleDefinition(
        name=schedule_name,
        task_name=task.name,
        cron=parsed.expression,
        timezone=timezone,
        args=args_json,
        kwargs=kwargs_json,
        queue=options.queue,
        priority=options.priority,
        max_retries=policy.max_retries if policy is not None else 0,
        retry_policy=codec.dumps(policy.to_json(), what="retry_policy") if policy is not None else None,
        catch_up=catch_up,
        overlap=overlap,
        concurrency_key=key,
    )
    return Schedule(schedule_name, parsed, task.name, definition)


def _concurrency_key(
    task: PeriodicTask, options: SendOptions, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str | None:
    """The key every task of the schedule is sent with (docs/limits.md), as a send finds it:
    ``with_options(concurrency_key=...)``, else the argument the task declares, from the
    schedule's arguments (fixed when declared)."""
    if options.concurrency_key is not None:
        return options.concurrency_key
    arg: str | None = getattr(task, "concurrency_key_arg", None)
    if arg is None:
        return None
    value = task.bound_argument(arg, args, kwargs)
    if value is None:
        return None
    return check_concurrency_key(value, f"argument {arg!r} of task {task.name!r} (its concurrency key)")


# -- which slots to send ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """What one tick does with a schedule's due slots."""

    send: list[datetime]  # slots to send a task for, oldest first
    skipped: int  # due slots passed over by the catch-up rule
    more_skipped: bool  # True when ``skipped`` is a lower bound (the slots were not all counted)
    last_slot: datetime | None  # the latest due slot: the schedule's cursor moves to it
    next_slot: datetime | None  # the first slot after now


def plan_slots(cron: Cron, after: datetime, now: datetime, catch_up: str) -> SlotPlan:
    """The slots in (after, now] to send by the catch-up rule.

    With a worker running, a tick finds one slot due and sends it under every rule. After a
    time without workers it finds several: "latest" sends the most recent, "all" sends them
    all (at most CATCH_UP_LIMIT, the most recent), "none" sends the most recent only if it
    is still on time (ON_TIME), and none of the others.
    """
    wanted = CATCH_UP_LIMIT if catch_up == "all" else 1
    due, total, exact = _latest_slots(cron, after, now, wanted)
    next_slot = cron.next_after(now)
    if not due:
        return SlotPlan([], 0, False, None, next_slot)
    latest = due[-1]
    if catch_up == "all":
        send = due
    elif catch_up == "latest":
        send = [latest]
    else:
        # The slot after the latest due one is the first after now: next_slot.
        grace = ON_TIME if next_slot is None else min(ON_TIME, (next_slot - latest) / 2)
        send = [latest] if now - latest <= grace else []
    return SlotPlan(send, total - len(send), not exact, latest, next_slot)


def _latest_slots(
    cron: Cron, after: datetime, now: datetime, wanted: int
) -> tuple[list[datetime], int, bool]:
    """Up to ``wanted`` latest slots in (after, now], how many slots were found, and whether
    that count covers all of (after, now] (else it is a lower bound).

    Counted from a window before ``now`` that grows until it holds enough slots or reaches
    ``after``, so a seconds schedule that missed a week does not walk every second of it.
    """
    window = timedelta(minutes=10)
    while True:
        start = max(after, now - window)
        found = list(cron.slots(start, now))
        if start == after or len(found) >= wanted:
            return found[-wanted:], len(found), start == after
        window *= 8


# -- declarations at worker start ----------------------------------------------------------


def sync_declared(conn: Conn, declared: Sequence[Schedule], queues: Sequence[str]) -> None:
    """Store the schedules this worker's code declares for its queues; log what changed.

    A schedule of these queues that the code no longer declares is marked removed (it
    stops firing); a changed one fires by its new definition from its next slot after now.
    One transaction, with the queues' schedule rows locked: workers starting at once take turns.
    """
    mine = [s for s in declared if s.definition.queue in queues]
    with conn.transaction():
        stored, now = schedules.lock_declared_schedules(conn, queues)
        by_name = {s.definition.name: s for s in stored}
        changed_queues: set[str] = set()
        for schedule in mine:
            old = by_name.pop(schedule.name, None)
            if old is not None and not old.removed and _same(old.definition, schedule.definition):
                continue
            schedules.upsert_schedule(conn, schedule.definition, schedule.cron.next_after(now))
            changed_queues.add(schedule.definition.queue)
            if old is None:
                log.info(
                    "schedule %s added: %s (%s) sends %s", schedule.name, *_describe(schedule.definition)
                )
            elif old.removed:
                log.info(
                    "schedule %s declared again: %s (%s) sends %s",
                    schedule.name,
                    *_describe(schedule.definition),
                )
            else:
                log.warning(
                    "schedule %s changed: %s; it fires by the new definition from its next slot",
                    schedule.name,
                    "; ".join(_differences(old.definition, schedule.definition)),
                )
        for old in by_name.values():
            if old.removed:
                continue
            schedules.remove_schedule(conn, old.definition.name)
            changed_queues.add(old.definition.queue)
            log.warning(
                "schedule %s (task %s, %s) is no longer declared in the code: it stops firing",
                old.definition.name,
                old.definition.task_name,
                old.definition.cron,
            )
        if changed_queues:
            schedules.notify_schedules_changed(conn, sorted(changed_queues))


def _same(a: ScheduleDefinition, b: ScheduleDefinition) -> bool:
    return not _differences(a, b)


def _differences(old: ScheduleDefinition, new: ScheduleDefinition) -> list[str]:
    """Which fields differ, as 'field: old -> new' (JSON compared as values, not as text)."""
    found = []
    for field in ScheduleDefinition.__dataclass_fields__:
        before, after = getattr(old, field), getattr(new, field)
        if field in ("args", "kwargs", "retry_policy"):
            same = (json.loads(before) if before else None) == (json.loads(after) if after else None)
        else:
            same = before == after
        if not same:
            found.append(f"{field}: {before} -> {after}")
    return found


def _describe(d: ScheduleDefinition) -> tuple[str, str, str]:
    return d.cron, d.timezone, f"task {d.task_name} to queue {d.queue}"


# -- pause and resume ---------------------------------------------------------------------


def set_paused(conn: Conn, name: str, *, paused: bool) -> bool:
    """Pause or resume the schedule ``name``; False if it already was so.

    A resumed schedule fires from its first slot after now: the slots that passed while
    it was paused are not sent. Raises ScheduleNotFoundError for an unknown name.
    """
    with conn.transaction():
        timing = schedules.lock_schedule_timing(conn, name)
        if timing is None:
            raise ScheduleNotFoundError(f"no schedule named {name!r}")
        next_slot = None if paused else Cron(timing.cron, timing.timezone).next_after(timing.now)
        queue = schedules.set_schedule_paused(conn, name, paused=paused, next_slot=next_slot)
        if queue is None:
            return False
        schedules.notify_schedules_changed(conn, [queue])
    log.info("schedule %s %s", name, "paused" if paused else "resumed")
    return True
