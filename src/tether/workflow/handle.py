"""WorkflowHandle: what Workflow.start() returns; waits for, inspects, pauses and cancels one workflow."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from tether.app_view import AppView
from tether.broker import workflows
from tether.broker.answers import CHANGED
from tether.broker.workflows import WorkflowState
from tether.codec import decode_result
from tether.errors import WorkflowNotFoundError
from tether.handle import TaskHandle
from tether.offload import in_thread
from tether.result import ErrorCode, TaskError, TaskResult, WorkflowStatus
from tether.result_wait import check_timeout, timed_out, wait_for, wait_for_async
from tether.workflow import engine

if TYPE_CHECKING:
    # Public as tether.StepInfo and tether.WorkflowInfo (and importable from here, as always:
    # __getattr__ below imports them on first use).
    from tether.broker.rows import StepInfo as StepInfo
    from tether.broker.rows import WorkflowInfo as WorkflowInfo


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
        return self._state().status

    async def status_async(self) -> WorkflowStatus:
        return await in_thread(self.status)

    def info(self) -> WorkflowInfo:
        info = self.app.broker.run(lambda c: workflows.get_workflow(c, self.id))
        if info is None:
            raise self._not_found()
        return info

    async def info_async(self) -> WorkflowInfo:
        return await in_thread(self.info)

    def results(self) -> dict[str, TaskResult[Any, TaskError] | None]:
        """Every step's result by node name; None for steps that have not finished."""
        self._state()
        return {s.name: s.result for s in self._steps()}

    async def results_async(self) -> dict[str, TaskResult[Any, TaskError] | None]:
        return await in_thread(self.results)

    def task(self, node_name: str) -> TaskHandle[Any]:
        """The TaskHandle of one step (its task may not exist yet: see info())."""
        for step in self._steps():
            if step.name == node_name:
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
        return self._outcome(self.app.broker.run(lambda c: workflows.workflow_state(c, self.id)))

    def _outcome(self, row: WorkflowState | None) -> TaskResult[Any, TaskError] | None:
        if row is None:
            return TaskResult(err=TaskError(ErrorCode.WORKFLOW_NOT_FOUND, f"no workflow with id {self.id}"))
        status = row.status
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

    def _state(self) -> WorkflowState:
        state = self.app.broker.run(lambda c: workflows.workflow_state(c, self.id))
        if state is None:
            raise self._not_found()
        return state

    def _not_found(self) -> WorkflowNotFoundError:
        return WorkflowNotFoundError(f"no workflow with id {self.id} (never started, or pruned by retention)")

    def _steps(self) -> list[StepInfo]:
        return self.app.broker.run(lambda c: workflows.get_workflow_steps(c, self.id))


if not TYPE_CHECKING:  # for a type checker, the names are imported above

    def __getattr__(name: str) -> object:
        """broker/rows.py's types, imported on first use (a send and a worker never build
        them): ``from tether.workflow.handle import StepInfo`` works as before."""
        if name in ("StepInfo", "WorkflowInfo"):
            value = getattr(__import__("tether.broker.rows", fromlist=[name]), name)
            globals()[name] = value  # the next lookup is a plain one
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
