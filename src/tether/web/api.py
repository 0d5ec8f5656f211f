"""The dashboard's read endpoints: GET requests that only read, each answering one JSON object.

Query parameters are checked here (a bad one is a 400 that names it); the database work is
in tether.broker.browse and the other broker modules. Every read runs in a transaction with
a statement time limit, so a filter that almost nothing matches on a very large table ends
with a clear 503 instead of holding a connection for minutes.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg

from tether import queue_control
from tether.broker import PostgresBroker, browse, limited_claims, tasks, workers, workflows
from tether.broker.limited_claims import LimitUse
from tether.broker.rows import StepInfo
from tether.broker.types import Conn
from tether.result import TaskStatus, WorkflowStatus
from tether.web.jsonout import ApiError

T = TypeVar("T")
E = TypeVar("E", TaskStatus, WorkflowStatus)
Query = Mapping[str, Sequence[str]]

PAGE_SIZE = 50
MAX_PAGE_SIZE = 200
HEARTBEATS_SHOWN = 20
# The task page's timeline: enough for a long run at the default interval, few enough to draw.
TIMELINE_HEARTBEATS = 500
# The task page's steps: a step in a long loop can record thousands; the page lists the first.
STEPS_SHOWN = 1_000
MAX_WORKERS = 200
MAX_IN_FLIGHT = 2_000
READ_TIME_LIMIT_MS = 10_000
MESSAGE_CUT = 300


# -- reading ------------------------------------------------------------------------------------


def read(broker: PostgresBroker, work: Callable[[Conn], T]) -> T:
    """``work`` in one transaction limited to READ_TIME_LIMIT_MS."""

    def limited(conn: Conn) -> T:
        try:
            with conn.transaction():
                browse.limit_time(conn, READ_TIME_LIMIT_MS)
                return work(conn)
        except psycopg.errors.QueryCanceled:
            raise ApiError(
                503,
                f"the query took longer than {READ_TIME_LIMIT_MS // 1000} s and was stopped; "
                "narrow the filter (a status, a time range)",
            ) from None

    return broker.run(limited)


def tasks_page(broker: PostgresBroker, query: Query) -> dict[str, Any]:
    """``GET /api/tasks``: a page of tasks, newest first, and the cursor of the next page.

    ``searched_to`` (else null): the page read its ``scan`` rows (browse.SCAN, or
    browse.SCAN_INDEXED) before it had ``limit`` matches, so tasks made before that time are
    not searched yet; ``next`` goes on there.
    """
    where = task_filter(query)
    before = _uuid(query, "before")
    limit = _limit(query)
    page = read(broker, lambda conn: browse.browse_tasks(conn, where, before=before, limit=limit))
    return {
        "tasks": page.tasks,
        "next": None if page.next is None else str(page.next),
        "searched_to": page.searched_to,
        "scan": page.scan,
    }


def task_filter(query: Query) -> browse.TaskFilter:
    """The task filter of a query (``status`` may list several, comma-separated)."""
    statuses: list[TaskStatus] = []
    for value in query.get("status", ()):
        for part in value.split(","):
            if part.strip():
                statuses.append(_choice("status", part.strip().upper(), TaskStatus))
    since, until = _time(query, "since"), _time(query, "until")
    if since is not None and until is not None and since >= until:
        raise ApiError(400, "since must be before until")
    return browse.TaskFilter(
        statuses=tuple(dict.fromkeys(statuses)),
        queue=_text(query, "queue"),
        name=_text(query, "name"),
        error_code=_text(query, "error_code"),
        since=since,
        until=until,
    )


def task_page(broker: PostgresBroker, task_id: str) -> dict[str, Any]:
    """``GET /api/tasks/<id>``: the task, every attempt, its recorded steps (the first
    STEPS_SHOWN, and how many there are), its latest heartbeats (the table's few, and the
    timeline's more), and the server's time (the timeline's right edge)."""
    tid = _parse_uuid("task id", task_id)

    def work(conn: Conn) -> dict[str, Any]:
        detail = browse.task_detail(conn, tid)
        if detail is None:
            raise ApiError(404, f"no task with id {tid}")
        step = {
            f: getattr(detail, f) for f in ("workflow_id", "workflow_name", "workflow_status", "step_name")
        }
        beats = tasks.get_heartbeats(conn, tid, TIMELINE_HEARTBEATS)
        return {
            "task": {**detail.task.as_stored(), **step},
            "attempts": detail.task.attempts,
            "steps": detail.task.steps[:STEPS_SHOWN],
            "steps_total": len(detail.task.steps),
            "heartbeats": beats[:HEARTBEATS_SHOWN],
            # The timeline's: when and in which role, the latest TIMELINE_HEARTBEATS.
            "timeline_heartbeats": [{"sent_at": b.sent_at, "role": b.role} for b in beats],
            "now": datetime.now(UTC),
        }

    return read(broker, work)


def workflows_page(broker: PostgresBroker, query: Query) -> dict[str, Any]:
    """``GET /api/workflows``: a page of workflows, newest first."""
    given = _text(query, "status")
    status = None if given is None else _choice("status", given.upper(), WorkflowStatus)
    name, before, limit = _text(query, "name"), _uuid(query, "before"), _limit(query)
    rows = read(
        broker,
        lambda conn: browse.browse_workflows(conn, status=status, name=name, before=before, limit=limit + 1),
    )
    return {"workflows": rows[:limit], "next": str(rows[limit - 1].id) if len(rows) > limit else None}


def workflow_page(broker: PostgresBroker, workflow_id: str) -> dict[str, Any]:
    """``GET /api/workflows/<id>``: the workflow and its steps (their results cut to the error's
    message: a workflow may have thousands of steps)."""
    wid = _parse_uuid("workflow id", workflow_id)

    def work(conn: Conn) -> dict[str, Any]:
        info = workflows.get_workflow(conn, wid)
        if info is None:
            raise ApiError(404, f"no workflow with id {wid}")
        nodes = {s.name: s.node for s in info.steps}
        shown = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name != "steps"}
        return {"workflow": shown, "steps": [_step(s, nodes) for s in info.steps]}

    return read(broker, work)


def _step(step: StepInfo, nodes: dict[str, int]) -> dict[str, Any]:
    """A step as the page reads it: its dependencies by node, its error's message cut short."""
    err = step.result.err if step.result is not None else None
    message = err.message if err is not None else None
    return {
        "node": step.node,
        "node_name": step.name,
        "task_id": step.task_id,
        "task_name": step.task_name,
        "queue": step.queue,
        "status": step.status,
        "depends_on": [nodes[name] for name in step.depends_on],
        "join_mode": step.join,
        "run_anyway": step.run_anyway,
        "error_code": step.error_code,
        "error_message": message[:MESSAGE_CUT] if message is not None else None,
        "enqueued_at": step.enqueued_at,
        "finished_at": step.finished_at,
        "task_status": step.task_status,
        "attempt": step.attempt,
        "retry_count": step.retry_count,
    }


def queues_page(broker: PostgresBroker, declared: Sequence[str]) -> dict[str, Any]:
    """``GET /api/queues``: every queue with its counts, oldest due task and pause (the
    ``declared`` ones, of the app's configuration, even when they have no task), and the
    flow-controlled ones with their limits and use now (docs/limits.md)."""
    return {
        "queues": queue_control.list_queues(broker, also=declared),
        "limits": [_limit_use(u) for u in broker.run(limited_claims.limit_uses)],
    }


def _limit_use(use: LimitUse) -> dict[str, Any]:
    lim = use.limits
    return {
        "queue": use.queue,
        "max_in_flight": lim.max_in_flight,
        "per_key": lim.per_key,
        "rate_limit": lim.rate_limit,
        "rate_period_s": lim.rate_period_s if lim.rate_limit else None,
        "burst": lim.burst,
        "key_weights": lim.key_weights,
        "key_rate_limit": lim.key_rate_limit,
        "key_rate_period_s": lim.key_rate_period_s if lim.key_rate_limit else None,
        "key_burst": lim.key_burst,
        "keys_out_of_tokens": use.keys_out_of_tokens,
        "in_flight": use.in_flight,
        "keys_in_flight": use.keys_in_flight,
        "busiest_key_in_flight": use.busiest_key_in_flight,
        "keys_at_limit": use.keys_at_limit,
        "tokens": use.tokens,
        "set_by": use.set_by,
        "updated_at": use.updated_at,
    }


def workers_page(broker: PostgresBroker, query: Query) -> dict[str, Any]:
    """``GET /api/workers``: the workers (``all=1``: stopped and inactive ones too) and the
    tasks they hold now."""
    everyone = _text(query, "all") in ("1", "true", "yes")

    def work(conn: Conn) -> dict[str, Any]:
        return {
            "workers": workers.list_workers(conn, include_inactive=everyone, limit=MAX_WORKERS),
            "in_flight": browse.in_flight(conn, MAX_IN_FLIGHT),
        }

    return read(broker, work)


# -- query parameters -----------------------------------------------------------------------------


def text(query: Query, key: str) -> str | None:
    """The last value of ``key`` stripped (None if absent or empty; a 400 if too long)."""
    return _text(query, key)


def _text(query: Query, key: str) -> str | None:
    values = query.get(key)
    if not values:
        return None
    value = values[-1].strip()
    if len(value) > 200:
        raise ApiError(400, f"{key} is longer than 200 characters")
    return value or None


def _choice(key: str, value: str, allowed: type[E]) -> E:
    """The member of the status enum ``allowed`` named ``value`` (a 400 naming ``key`` if none is)."""
    if value not in allowed.__members__:
        raise ApiError(400, f"{key} {value!r} is not one of {', '.join(allowed)}")
    return allowed(value)


def _parse_uuid(what: str, value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise ApiError(400, f"{what} {value!r} is not a UUID") from None


def _uuid(query: Query, key: str) -> uuid.UUID | None:
    value = _text(query, key)
    return None if value is None else _parse_uuid(key, value)


def _time(query: Query, key: str) -> datetime | None:
    value = _text(query, key)
    if value is None:
        return None
    try:
        at = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(400, f"{key} {value!r} is not an ISO 8601 time") from None
    if at.tzinfo is None:
        raise ApiError(400, f"{key} {value!r} has no time zone (add Z or +HH:MM)")
    return at


def _limit(query: Query) -> int:
    value = _text(query, "limit")
    if value is None:
        return PAGE_SIZE
    try:
        limit = int(value)
    except ValueError:
        raise ApiError(400, f"limit {value!r} is not a number") from None
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ApiError(400, f"limit must be from 1 to {MAX_PAGE_SIZE}")
    return limit
