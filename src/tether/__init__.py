"""tether: a durable background-task queue for Python on PostgreSQL."""

from tether.app import Tether
from tether.config import AppConfig, PostgresConfig, RecoveryConfig, RetryPolicy, WorkerConfig
from tether.handle import AttemptInfo, TaskHandle, TaskInfo
from tether.progress import report_progress
from tether.result import TASK_TERMINAL_STATES, ErrorCode, TaskError, TaskResult, TaskStatus

__version__ = "0.1.0"

__all__ = [
    "TASK_TERMINAL_STATES",
    "AppConfig",
    "AttemptInfo",
    "ErrorCode",
    "PostgresConfig",
    "RecoveryConfig",
    "RetryPolicy",
    "TaskError",
    "TaskHandle",
    "TaskInfo",
    "TaskResult",
    "TaskStatus",
    "Tether",
    "WorkerConfig",
    "__version__",
    "report_progress",
]
