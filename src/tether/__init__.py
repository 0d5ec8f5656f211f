"""tether: a durable background-task queue and workflow engine for Python on PostgreSQL."""

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
