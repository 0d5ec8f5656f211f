"""The dashboard's actions: each is a POST of a JSON object to ``/api/actions/<name>``.

The server checks the token before any of these runs (tether.web.auth). Each action calls
the same function as the CLI and the Python API (tether.cancelling, tether.retrying,
tether.queue_control, the workflow engine, tether.recovering) with
``by="dashboard:<client address>"``, and
answers what it changed in a sentence; the server logs that sentence at INFO with the
action, its target and the client's address.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from tether import cancelling, names, queue_control, recovering, retrying
from tether.broker import PostgresBroker
from tether.broker.answers import CHANGED
from tether.config import RecoveryConfig
from tether.errors import InvalidOptionError, TaskNotFoundError
from tether.result import TaskStatus
from tether.web import api
from tether.web.jsonout import ApiError
from tether.workflow import engine


@dataclass(frozen=True, slots=True)
class Acted:
    """What an action did: its target, whether it changed anything, a sentence saying what,
    and the details the page shows."""

    target: str
    changed: bool
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def reply(self) -> dict[str, Any]:
        return {"changed": self.changed, "message": self.message, **self.details}


class Desk(Protocol):
    """What an action works with: the dashboard's broker, and the recovery thresholds it was
    started with (its app's, with --app; else TETHER_* and the defaults)."""

    @property
    def broker(self) -> PostgresBroker: ...

    @property
    def recovery(self) -> RecoveryConfig: ...


Action = Callable[[Desk, Mapping[str, Any], str], Acted]


def cancel_task(desk: Desk, body: Mapping[str, Any], by: str) -> Acted:
    """``{"task_id"}``: cancel a task (a RUNNING one is asked to stop; it ends CANCELLED)."""
    task_id = _id(body, "task_id")
    try:
        answer = cancelling.cancel_task(desk.broker, task_id, by=by)
    except TaskNotFoundError as exc:
        raise ApiError(404, str(exc)) from None
    return Acted(
        f"task {task_id}",
        bool(answer.reply),
        answer.message,
        {"reply": answer.reply.value, "status": answer.status.value},
    )


def retry_task(desk: Desk, body: Mapping[str, Any], by: str) -> Acted:
    """``{"task_id", "from_scratch": bool}``: retry an ended task (back to PENDING, same id),
    keeping its recorded steps unless ``from_scratch`` (default false)."""
    task_id = _id(body, "task_id")
    from_scratch = _flag(body, "from_scratch")
    try:
        answer = retrying.retry_task(desk.broker, task_id, by=by, from_scratch=from_scratch)
    except TaskNotFoundError as exc:
        raise ApiError(404, str(exc)) from None
    message = f"task {task_id} {answer.reason}"  # "retried: PENDING as ...", "not retried: it is ..."
    return Acted(
        f"task {task_id}",
        answer.retried,
        message,
        {"retried": answer.retried, "status": answer.status.value, "reason": answer.reason},
    )


def retry_tasks(desk: Desk, body: Mapping[str, Any], by: str) -> Acted:
    """``{"filter": {status, queue, name, error_code, since, until}, "dry_run": bool,
    "from_scratch": bool}``: retry every ended task the filter matches (statuses default to
    FAILED; ``since`` and ``until`` bound when the task ended, as in tether.retrying;
    ``from_scratch`` deletes their recorded steps, default false). The page sends a dry run
    first, shows the count and a sample, and sends the real one when confirmed."""
    raw = body.get("filter", {})
    if not isinstance(raw, dict):
        raise ApiError(400, "filter must be an object")
    dry_run = body.get("dry_run", True)
    if not isinstance(dry_run, bool):
        raise ApiError(400, "dry_run must be true or false")
    from_scratch = _flag(body, "from_scratch")
    query = {key: [str(value)] for key, value in raw.items() if value not in (None, "")}
    where = api.task_filter(query)
    wanted = retrying.RetryFilter(
        statuses=tuple(where.statuses) or (TaskStatus.FAILED,),
        queue=where.queue,
        name=where.name,
        error_code=where.error_code,
        since=where.since,
        until=where.until,
    )
    try:
        bulk = retrying.retry_tasks(desk.broker, wanted, by=by, dry_run=dry_run, from_scratch=from_scratch)
    except InvalidOptionError as exc:
        raise ApiError(400, str(exc)) from None
    described = _described(wanted)
    if bulk.dry_run:
        message = f"dry run: {bulk.matched} task(s) match {described}; nothing changed"
    else:
        message = f"retried {bulk.retried} of {bulk.matched} task(s) matching {described}"
        if bulk.skipped:
            message += f" ({bulk.skipped} skipped)"
    return Acted(
        f"tasks matching {described}",
        bool(bulk.retried) and not bulk.dry_run,
        message,
        {
            "matched": bulk.matched,
            "retried": bulk.retried,
            "skipped": bulk.skipped,
            "dry_run": bulk.dry_run,
            "sample": bulk.sample,
            "skips": bulk.skips,
        },
    )


def _described(wanted: retrying.RetryFilter) -> str:
    parts = [f"status {','.join(wanted.statuses)}"]
    for key, label in (
        ("queue", "queue"),
        ("name", "name"),
        ("error_code", "error code"),
        ("since", "ended since"),
        ("until", "ended before"),
    ):
        value = getattr(wanted, key)
        if value is not None:
            parts.append(f"{label} {value.isoformat() if isinstance(value, datetime) else value}")
    return "{" + ", ".join(parts) + "}"


def pause_queue(desk: Desk, body: Mapping[str, Any], by: str) -> Acted:
    """``{"queue"}``: workers stop claiming from the queue (running tasks go on)."""
    queue = _queue(body)
    changed = queue_control.pause_queue(desk.broker, queue, by=by)
    return Acted(
        f"queue {queue}", changed, f"queue {queue} paused" if changed else f"queue {queue} was already paused"
    )


def resume_queue(desk: Desk, body: Mapping[str, Any], by: str) -> Acted:
    """``{"queue"}``: workers claim from the queue again."""
    queue = _queue(body)
    changed = queue_control.resume_queue(desk.broker, queue, by=by)
    return Acted(
        f"queue {queue}", changed, f"queue {queue} resumed" if changed else f"queue {queue} was not paused"
    )


def cancel_workflow(desk: Desk, body: Mapping[str, Any], by: str) -> Acted:
    """``{"workflow_id"}``: steps not started end CANCELLED; running ones finish."""
    wid = _id(body, "workflow_id")
    changed = desk.broker.run_request(lambda conn: engine.cancel(conn, wid), CHANGED)
    message = f"workflow {wid} cancelled" if changed else f"workflow {wid} not cancelled: it is not open"
    return Acted(f"workflow {wid}", changed, message)


def pause_workflow(desk: Desk, body: Mapping[str, Any], by: str) -> Acted:
    """``{"workflow_id"}``: start no new steps until resumed."""
    wid = _id(body, "workflow_id")
    changed = desk.broker.run_request(lambda conn: engine.pause(conn, wid), CHANGED)
    message = f"workflow {wid} paused" if changed else f"workflow {wid} not paused: it is not RUNNING"
    return Acted(f"workflow {wid}", changed, message)


def resume_workflow(desk: Desk, body: Mapping[str, Any], by: str) -> Acted:
    """``{"workflow_id"}``: a PAUSED workflow runs on; steps that became ready start."""
    wid = _id(body, "workflow_id")
    changed = desk.broker.run_request(lambda conn: engine.resume(conn, wid), CHANGED)
    message = f"workflow {wid} resumed" if changed else f"workflow {wid} not resumed: it is not PAUSED"
    return Acted(f"workflow {wid}", changed, message)


def recover(desk: Desk, body: Mapping[str, Any], by: str) -> Acted:
    """``{"dry_run": bool}`` (true unless false): manual recovery, as ``tether recover`` does it
    with the dashboard's thresholds: every task rule of the reaper once (stale CLAIMED back to
    PENDING, stale RUNNING retried or failed, PENDING past good_until expired, silent workers
    marked inactive), then the workflow reconciliation. The page sends a dry run first, shows
    what it would do, and sends the real one when confirmed. The reply holds the report of
    ``tether recover --json``."""
    dry_run = body.get("dry_run", True)
    if not isinstance(dry_run, bool):
        raise ApiError(400, "dry_run must be true or false")
    report = recovering.recover(desk.broker, desk.recovery, dry_run=dry_run)
    message = f"{report.tasks_summary()}; {report.workflows_summary()}"
    return Acted(
        "stale tasks and workflows",
        report.changed,
        f"dry run: {message}; nothing changed" if dry_run else message,
        report.as_json(),
    )


ACTIONS: dict[str, Action] = {
    "cancel-task": cancel_task,
    "retry-task": retry_task,
    "retry-tasks": retry_tasks,
    "pause-queue": pause_queue,
    "resume-queue": resume_queue,
    "cancel-workflow": cancel_workflow,
    "pause-workflow": pause_workflow,
    "resume-workflow": resume_workflow,
    "recover": recover,
}


def _id(body: Mapping[str, Any], key: str) -> uuid.UUID:
    value = body.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{key} is required (a UUID)")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise ApiError(400, f"{key} {value!r} is not a UUID") from None


def _queue(body: Mapping[str, Any]) -> str:
    try:
        return names.check_queue_name(body.get("queue"))
    except InvalidOptionError as exc:
        raise ApiError(400, str(exc)) from None


def _flag(body: Mapping[str, Any], key: str) -> bool:
    """An optional true/false of the body (absent: false)."""
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be true or false")
    return value
