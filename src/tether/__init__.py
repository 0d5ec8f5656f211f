"""tether: a durable background-task queue and workflow engine for Python on PostgreSQL.

The public names are imported on first use (PEP 562's module ``__getattr__``), not by
``import tether``: a program that imports tether for one name (a producer's ``Tether``, a
child's ``current_task``) pays only for the modules behind it, and ``import tether`` alone
costs nothing. ``from tether import X`` and ``tether.X`` work as before; type checkers read
the imports under TYPE_CHECKING.
"""

from __future__ import annotations

# typing.TYPE_CHECKING without importing typing (a third of what import tether still costs):
# mypy treats any constant of this name as True.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from tether.app import Tether
    from tether.broker.recovery import StaleTask
    from tether.config import (
        AppConfig,
        LoggingConfig,
        PostgresConfig,
        RecoveryConfig,
        RetryPolicy,
        WorkerConfig,
    )
    from tether.current import RunningTask, current_task
    from tether.handle import AttemptInfo, TaskHandle, TaskInfo, TaskStepInfo, TaskSuspension
    from tether.limits import QueueLimits
    from tether.progress import report_progress, report_progress_async
    from tether.queue_control import QueueInfo
    from tether.result import (
        TASK_TERMINAL_STATES,
        WORKFLOW_TERMINAL_STATES,
        ErrorCode,
        StepStatus,
        TaskError,
        TaskResult,
        TaskStatus,
        WorkflowStatus,
    )
    from tether.retrying import BulkRetry, RetryAnswer, RetryFilter
    from tether.workflow.definition import Node, Workflow
    from tether.workflow.handle import StepInfo, WorkflowHandle, WorkflowInfo
    from tether.workflow.recovery import recover_stuck_workflows, recover_stuck_workflows_async

__version__ = "0.1.0"

# Each public name and the module it is imported from on first use.
_WHERE = {
    "Tether": "tether.app",
    "StaleTask": "tether.broker.recovery",
    "AppConfig": "tether.config",
    "LoggingConfig": "tether.config",
    "PostgresConfig": "tether.config",
    "RecoveryConfig": "tether.config",
    "RetryPolicy": "tether.config",
    "WorkerConfig": "tether.config",
    "RunningTask": "tether.current",
    "current_task": "tether.current",
    "AttemptInfo": "tether.handle",
    "TaskHandle": "tether.handle",
    "TaskInfo": "tether.handle",
    "TaskStepInfo": "tether.handle",
    "TaskSuspension": "tether.handle",
    "QueueLimits": "tether.limits",
    "report_progress": "tether.progress",
    "report_progress_async": "tether.progress",
    "QueueInfo": "tether.queue_control",
    "TASK_TERMINAL_STATES": "tether.result",
    "WORKFLOW_TERMINAL_STATES": "tether.result",
    "ErrorCode": "tether.result",
    "StepStatus": "tether.result",
    "TaskError": "tether.result",
    "TaskResult": "tether.result",
    "TaskStatus": "tether.result",
    "WorkflowStatus": "tether.result",
    "BulkRetry": "tether.retrying",
    "RetryAnswer": "tether.retrying",
    "RetryFilter": "tether.retrying",
    "Node": "tether.workflow.definition",
    "Workflow": "tether.workflow.definition",
    "StepInfo": "tether.workflow.handle",
    "WorkflowHandle": "tether.workflow.handle",
    "WorkflowInfo": "tether.workflow.handle",
    "recover_stuck_workflows": "tether.workflow.recovery",
    "recover_stuck_workflows_async": "tether.workflow.recovery",
}

if not TYPE_CHECKING:  # for a type checker, every name is imported above: no catch-all

    def __getattr__(name: str) -> object:
        where = _WHERE.get(name)
        if where is None:
            return _submodule(name)
        value = getattr(__import__(where, fromlist=[name]), name)
        globals()[name] = value  # the next lookup is a plain one
        return value

    def _submodule(name: str) -> object:
        """``tether.config`` and the like after a bare ``import tether``: the package imported
        them all before its names were lazy, and code may reach them as attributes."""
        if not name.startswith("__"):
            try:
                return __import__(f"{__name__}.{name}", fromlist=["__name__"])
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{name}":
                    raise  # the module exists but imports something missing: say so
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = [
    "TASK_TERMINAL_STATES",
    "WORKFLOW_TERMINAL_STATES",
    "AppConfig",
    "AttemptInfo",
    "BulkRetry",
    "ErrorCode",
    "LoggingConfig",
    "Node",
    "PostgresConfig",
    "QueueInfo",
    "QueueLimits",
    "RecoveryConfig",
    "RetryAnswer",
    "RetryFilter",
    "RetryPolicy",
    "RunningTask",
    "StaleTask",
    "StepInfo",
    "StepStatus",
    "TaskError",
    "TaskHandle",
    "TaskInfo",
    "TaskResult",
    "TaskStatus",
    "TaskStepInfo",
    "TaskSuspension",
    "Tether",
    "WorkerConfig",
    "Workflow",
    "WorkflowHandle",
    "WorkflowInfo",
    "WorkflowStatus",
    "__version__",
    "current_task",
    "recover_stuck_workflows",
    "recover_stuck_workflows_async",
    "report_progress",
    "report_progress_async",
]
