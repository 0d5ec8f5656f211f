"""The dashboard's reads (browse.sql): pages of tasks and workflows by keyset, one task with
its workflow and cancel request, the tasks workers hold now.

Every statement runs unprepared (``prepare=False``): psycopg prepares a statement after a
few runs on a connection, and PostgreSQL may then plan it once for any parameter values,
where an absent filter no longer folds away and a status no longer picks its partial
index. Planned each time with its values, a page is one backward range scan of the
primary key from the cursor (or a few rows of a partial index), at any depth.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tether.broker.queries import q
from tether.broker.rows import TaskInfo, TaskSummary, WorkflowSummary, with_status
from tether.broker.tasks import get_task
from tether.broker.types import Conn
from tether.result import TaskStatus, WorkflowStatus

#: The cursor of a first page: every id is below it.
TOP = uuid.UUID(int=(1 << 128) - 1)
#: Rows one page of a task list reads at most, below its cursor, through the primary key.
#: A filter that few tasks match stops there rather than read a large table to its end:
#: the page says how far it searched, and the next page goes on from there. The rows are
#: next to each other in the table (ids are made in time order): about 2,000 pages.
SCAN = 20_000
#: The same through a partial index (a list of unsuccessful or in-flight statuses only):
#: those rows are spread over the whole table, each one read from a page of its own.
SCAN_INDEXED = 2_000
# Statuses with a partial index over their rows (migrations 1, 2, 10): a list of only
# these reads that index, not the primary key, and its scan counts only their rows.
UNSUCCESSFUL = frozenset({TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.EXPIRED})
IN_FLIGHT = frozenset({TaskStatus.CLAIMED, TaskStatus.RUNNING})
#: A list of one queue's PENDING tasks is read whole from the claim index when the queue
#: has at most this many waiting (their ids sorted: about 10 ms for 10,000); beyond, it
#: reads the primary key like any list, where a long backlog's tasks are many.
WAITING_LISTED = 10_000


def id_time(task_id: uuid.UUID) -> datetime:
    """When a UUIDv7 was made (its millisecond timestamp), as an aware datetime."""
    return datetime.fromtimestamp((task_id.int >> 80) / 1000, UTC)


def id_floor(at: datetime) -> uuid.UUID:
    """The smallest UUIDv7 made at or after ``at`` (an aware datetime): ids made before it
    are below it, ids made at or after it are not."""
    ms = int(at.timestamp() * 1000)
    return uuid.UUID(int=max(0, min(ms, (1 << 48) - 1)) << 80)


@dataclass(frozen=True, slots=True)
class TaskFilter:
    """What a task list shows: every field optional. ``since``/``until`` bound the time the
    task was made (its id's UUIDv7 time), ``until`` excluded."""

    statuses: Sequence[TaskStatus] = ()
    queue: str | None = None
    name: str | None = None
    error_code: str | None = None
    since: datetime | None = None
    until: datetime | None = None


@dataclass(frozen=True, slots=True)
class TaskPage:
    """One page of a task list, newest first.

    ``next``: the cursor of the next page (None: nothing older is left). ``searched_to``:
    set when the page stopped after reading its SCAN rows before it had ``limit`` matches;
    then the tasks made before that moment (ids below ``next``) are not searched yet, and
    a page with few or no tasks does not mean there are no more.
    """

    tasks: list[TaskSummary]
    next: uuid.UUID | None
    searched_to: datetime | None
    scan: int  # the most rows this page could read


@dataclass(frozen=True, slots=True)
class TaskDetail:
    """A task (tasks.get_task's, with its attempts) and the workflow it is a step of, if any."""

    task: TaskInfo
    workflow_id: uuid.UUID | None
    workflow_name: str | None
    workflow_status: WorkflowStatus | None
    step_name: str | None


@dataclass(frozen=True, slots=True)
class InFlight:
    """A task a worker holds now."""

    id: uuid.UUID
    name: str
    queue: str
    status: TaskStatus
    attempt: int
    claimed_at: datetime | None
    started_at: datetime | None
    claimed_by_worker_id: str | None
    progress: Any
    cancel_requested_at: datetime | None


def limit_time(conn: Conn, ms: int) -> None:
    """In the caller's transaction: stop any statement that runs longer than ``ms``."""
    conn.execute(q("browse_time_limit"), {"ms": int(ms)})


def page_params(where: TaskFilter, *, before: uuid.UUID | None, limit: int, scan: int) -> dict[str, Any]:
    """The parameters of a page's statement: one more row than ``limit``, and the statuses
    (and error code) whose partial index the scan reads instead of the primary key (None:
    the primary key; browse.sql says why only those)."""
    upper = before or TOP
    if where.until is not None:
        upper = min(upper, id_floor(where.until))
    indexed = _indexed(where)
    return {
        "before": upper,
        "id_from": None if where.since is None else id_floor(where.since),
        "statuses": list(where.statuses) or None,
        "queue": where.queue,
        "name": where.name,
        "error_code": where.error_code,
        "index_statuses": list(where.statuses) if indexed else None,
        # FAILED alone with a code: tether_tasks_failed_code_idx, keyed by the code.
        "index_code": where.error_code if set(where.statuses) == {TaskStatus.FAILED} else None,
        "scan": scan,
        "limit": limit + 1,
    }


def browse_tasks(
    conn: Conn, where: TaskFilter, *, before: uuid.UUID | None, limit: int, scan: int | None = None
) -> TaskPage:
    """Up to ``limit`` tasks matching ``where`` with an id below ``before`` (None: from the
    newest), newest first, reading at most ``scan`` rows (None: SCAN, or SCAN_INDEXED for
    the statuses with a partial index)."""
    indexed = _indexed(where)
    scan = scan if scan is not None else SCAN_INDEXED if indexed else SCAN
    params = page_params(where, before=before, limit=limit, scan=scan)
    statement = "browse_tasks_indexed" if indexed else "browse_tasks"
    if where.queue is not None and set(where.statuses) == {TaskStatus.PENDING}:
        # One queue's waiting tasks: all of them from the claim index when they are few.
        bound = {"queue": where.queue, "bound": WAITING_LISTED + 1}
        counted = conn.execute(q("count_waiting_up_to"), bound).fetchone()
        if counted is not None and counted["n"] <= WAITING_LISTED:
            statement = "browse_tasks_waiting"
    rows = conn.execute(q(statement), params, prepare=False).fetchall()
    read_to = rows[-1] if rows and rows[-1]["nth"] == scan else None  # the scan's last row
    matched = [with_status(TaskSummary, _summary(row), TaskStatus) for row in rows if row["matches"]]
    if len(matched) > limit:
        return TaskPage(matched[:limit], matched[limit - 1].id, None, scan)
    if read_to is not None:
        return TaskPage(matched, read_to["id"], id_time(read_to["id"]), scan)
    return TaskPage(matched, None, None, scan)


def _indexed(where: TaskFilter) -> bool:
    """Whether every status asked for has a partial index (the list reads it, not the key)."""
    wanted = set(where.statuses)
    return bool(wanted) and (wanted <= UNSUCCESSFUL or wanted <= IN_FLIGHT)


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    del row["matches"], row["nth"]
    return row


def task_detail(conn: Conn, task_id: uuid.UUID) -> TaskDetail | None:
    task = get_task(conn, task_id)
    if task is None:
        return None
    step = conn.execute(q("task_step"), {"id": task_id}).fetchone()
    if step is None:
        return TaskDetail(task, None, None, None, None)
    return TaskDetail(
        task,
        step["workflow_id"],
        step["workflow_name"],
        WorkflowStatus(step["workflow_status"]),
        step["step_name"],
    )


def browse_workflows(
    conn: Conn, *, status: WorkflowStatus | None, name: str | None, before: uuid.UUID | None, limit: int
) -> list[WorkflowSummary]:
    """Up to ``limit`` workflows (exact status and name when given) with an id below
    ``before``, newest first."""
    params = {"before": before or TOP, "status": status, "name": name, "limit": limit}
    rows = conn.execute(q("browse_workflows"), params, prepare=False).fetchall()
    return [with_status(WorkflowSummary, row, WorkflowStatus) for row in rows]


def in_flight(conn: Conn, limit: int) -> list[InFlight]:
    """Up to ``limit`` CLAIMED and RUNNING tasks, longest held first."""
    rows = conn.execute(q("browse_in_flight"), {"limit": limit}, prepare=False).fetchall()
    return [with_status(InFlight, row, TaskStatus) for row in rows]
