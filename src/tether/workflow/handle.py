"""WorkflowHandle: what Workflow.start() returns; waits for, inspects, pauses and cancels one workflow."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tether.app_view import AppView
from tether.broker import workflows
from tether.broker.answers import CHANGED
from tether.broker.workflows import StepRow, WatchedWorkflow, WorkflowRow
from tether.codec import decode_result
from tether.errors import WorkflowNotFoundError
from tether.handle import TaskHandle
from tether.offload import in_thread
from tether.result import ErrorCode, StepStatus, TaskError, TaskResult, TaskStatus, WorkflowStatus
from tether.result_wait import check_timeout, timed_out, wait_for, wait_for_async
from tether.workflow import engine


@dataclass(frozen=True, slots=True)
class StepInfo:
    """One step of a workflow as stored, with its task's status once it has a task."""

    node: int
    name: str
    task_name: str
    task_id: uuid.UUID
    status: StepStatus
    task_status: TaskStatus | None  # None until the step is enqueued
    depends_on: tuple[str, ...]
    join: str
    run_anyway: bool
    attempt: int | None
    error_code: str | None
    result: TaskResult[Any, TaskError] | None
    enqueued_at: datetime | None
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class WorkflowInfo:
    id: uuid.UUID
    name: str
    status: WorkflowStatus
    on_error: str
    steps_total: int
    steps_done: int
    steps_failed: int
    created_at: datetime
    updated_at: datetime
    paused_at: datetime | None
    finished_at: datetime | None
    steps: tuple[StepInfo, ...]


class WorkflowHandle:
    def __init__(self, app: AppView, workflow_id: uuid.UUID, name: str | None = None) -> None:
        self.app = app
        self.id = workflow_id
        self.name = name

    def __repr__(self) -> str:
        return f"WorkflowHandle({self.name or 'workflow'}, id={self.id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkflowHandle) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    # -- reading -------------------------------------------------------------

    def status(self) -> WorkflowStatus:
        return WorkflowStatus(self._row().status)

    async def status_async(self) -> WorkflowStatus:
        return await in_thread(self.status)

    def info(self) -> WorkflowInfo:
        row = self._row()
        return _info(row, self._steps())

    async def info_async(self) -> WorkflowInfo:
        return await in_thread(self.info)

    def results(self) -> dict[str, TaskResult[Any, TaskError] | None]:
        """Every step's result by node name; None for steps that have not finished."""
        self._row()
        return {s.node_name: _step_result(s) for s in self._steps()}

    async def results_async(self) -> dict[str, TaskResult[Any, TaskError] | None]:
        return await in_thread(self.results)

    def task(self, node_name: str) -> TaskHandle[Any]:
        """The TaskHandle of one step (its task may not exist yet: see info())."""
        for step in self._steps():
            if step.node_name == node_name:
                return TaskHandle(self.app, step.task_id, step.task_name)
        raise KeyError(f"workflow {self.id} has no node named {node_name!r}")

    # -- acting --------------------------------------------------------------

    def cancel(self) -> bool:
        """Cancel: steps not started are cancelled, running ones finish. True if it was open."""
        return self.app.broker.run_request(lambda conn: engine.cancel(conn, self.id), CHANGED)

    async def cancel_async(self) -> bool:
        return await in_thread(self.cancel)

    def pause(self) -> bool:
        """Start no new steps until resume(); running ones finish. True if it was running."""
        return self.app.broker.run_request(lambda conn: engine.pause(conn, self.id), CHANGED)

    async def pause_async(self) -> bool:
        return await in_thread(self.pause)

    def resume(self) -> bool:
        """Resume a PAUSED workflow: the steps that became ready meanwhile start. True if it was paused."""
        return self.app.broker.run_request(lambda conn: engine.resume(conn, self.id), CHANGED)

    async def resume_async(self) -> bool:
        return await in_thread(self.resume)

    # -- waiting -------------------------------------------------------------

    def get(self, timeout: float | None = None) -> TaskResult[Any, TaskError]:
        """Wait for the workflow to end (a PAUSED one waits for resume or cancel).

        COMPLETED: ok with the output step's value (or, with no single output,
        a dict of every final step's value by node name). FAILED: err
        WORKFLOW_FAILED whose data names each failed step's error. CANCELLED:
        err WORKFLOW_CANCELLED. Timeout: err WAIT_TIMEOUT (the workflow goes on).
        """
        check_timeout(timeout)
        poll = self.app.config.result_poll_interval_ms / 1000
        found = wait_for(self.app.result_listener, str(self.id), self._watch, self._read, timeout, poll)
        return found if found is not None else timed_out(timeout, "workflow")

    async def get_async(self, timeout: float | None = None) -> TaskResult[Any, TaskError]:
        check_timeout(timeout)
        poll = self.app.config.result_poll_interval_ms / 1000

        async def watch() -> TaskResult[Any, TaskError] | None:
            return await in_thread(self._watch)

        async def read() -> TaskResult[Any, TaskError] | None:
            return await in_thread(self._read)

        found = await wait_for_async(self.app.result_listener, str(self.id), watch, read, timeout, poll)
        return found if found is not None else timed_out(timeout, "workflow")

    def _watch(self) -> TaskResult[Any, TaskError] | None:
        return self._outcome(self.app.broker.run(lambda c: workflows.watch_workflow(c, self.id)))

    def _read(self) -> TaskResult[Any, TaskError] | None:
        return self._outcome(self.app.broker.run(lambda c: workflows.get_workflow(c, self.id)))

    def _outcome(self, row: WatchedWorkflow | WorkflowRow | None) -> TaskResult[Any, TaskError] | None:
        if row is None:
            return TaskResult(err=TaskError(ErrorCode.WORKFLOW_NOT_FOUND, f"no workflow with id {self.id}"))
        status = WorkflowStatus(row.status)
        if not status.is_terminal:
            return None
        if status is WorkflowStatus.CANCELLED:
            return TaskResult(
                err=TaskError(ErrorCode.WORKFLOW_CANCELLED, f"workflow {self.id} was cancelled")
            )
        if status is WorkflowStatus.FAILED:
            return self._failure()
        return self._output(row.output_node)

    def _output(self, output: int | None) -> TaskResult[Any, TaskError]:
        steps = self.app.broker.run(lambda c: workflows.workflow_output(c, self.id, output))
        if output is not None and steps:
            return decode_result(steps[0].result)
        values = {}
        for step in steps:
            values[step.node_name] = decode_result(step.result).ok
        return TaskResult(ok=values)

    def _failure(self) -> TaskResult[Any, TaskError]:
        failed = self.app.broker.run(lambda c: workflows.workflow_failures(c, self.id))
        errors: dict[str, Any] = {}
        for step in failed:
            err = decode_result(step.result).err if step.result is not None else None
            errors[step.node_name] = {
                "code": str(err.code) if err else step.error_code,
                "message": err.message if err else "",
            }
        summary = ", ".join(f"{name} ({e['code']})" for name, e in list(errors.items())[:5])
        return TaskResult(
            err=TaskError(
                ErrorCode.WORKFLOW_FAILED,
                f"workflow {self.id} failed: {summary or 'a step failed'}",
                {"failed_steps": errors},
            )
        )

    def _row(self) -> WorkflowRow:
        row = self.app.broker.run(lambda c: workflows.get_workflow(c, self.id))
        if row is None:
            raise WorkflowNotFoundError(
                f"no workflow with id {self.id} (never started, or pruned by retention)"
            )
        return row

    def _steps(self) -> list[StepRow]:
        return self.app.broker.run(lambda c: workflows.get_workflow_steps(c, self.id))


def _step_result(step: StepRow) -> TaskResult[Any, TaskError] | None:
    if not StepStatus(step.status).is_terminal or step.result is None:
        return None
    return decode_result(step.result)


def _info(row: WorkflowRow, steps: list[StepRow]) -> WorkflowInfo:
    names = {s.node: s.node_name for s in steps}
    return WorkflowInfo(
        id=row.id,
        name=row.name,
        status=WorkflowStatus(row.status),
        on_error=row.on_error,
        steps_total=row.steps_total,
        steps_done=row.steps_done,
        steps_failed=row.steps_failed,
        created_at=row.created_at,
        updated_at=row.updated_at,
        paused_at=row.paused_at,
        finished_at=row.finished_at,
        steps=tuple(
            StepInfo(
                node=s.node,
                name=s.node_name,
                task_name=s.task_name,
                task_id=s.task_id,
                status=StepStatus(s.status),
                task_status=TaskStatus(s.task_status) if s.task_status else None,
                depends_on=tuple(names[d] for d in s.depends_on),
                join=s.join_mode,
                run_anyway=s.run_anyway,
                attempt=s.attempt,
                error_code=s.error_code,
                result=_step_result(s),
                enqueued_at=s.enqueued_at,
                finished_at=s.finished_at,
            )
            for s in steps
        ),
    )
