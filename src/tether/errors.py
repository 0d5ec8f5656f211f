"""Exceptions a user can meet. Each names the argument, field or URL at fault."""

from __future__ import annotations

from tether.task_error import TaskError


class TetherError(Exception):
    """Base of every tether exception."""


class BadArgumentsError(TetherError, ValueError):
    """Arguments given to send/schedule do not bind to the task's signature."""


class SerializationError(TetherError, ValueError):
    """A value cannot be encoded to (or decoded from) tether's JSON format."""


class UnknownQueueError(TetherError, ValueError):
    """A task was sent to a queue that the app does not declare."""


class InvalidOptionError(TetherError, ValueError):
    """A send option (priority, good_until, delay, ...) is out of range or of the wrong type."""


class TaskDefinitionError(TetherError, ValueError):
    """A task function cannot be registered as written."""


class WorkflowDefinitionError(TetherError, ValueError):
    """A workflow is refused before anything is written: unknown task, cycle, bad arguments, ..."""


class ScheduleDefinitionError(TetherError, ValueError):
    """A periodic task declared with a bad expression, time zone, task or arguments."""


class ScheduleNotFoundError(TetherError, LookupError):
    """No schedule of that name (pause, resume)."""


class WorkflowNotFoundError(TetherError, LookupError):
    """No workflow with that id exists (it may have been pruned by retention)."""


class WrongDatabaseError(TetherError, ValueError):
    """A connection lent for a send in the caller's transaction is not on tether's database
    (or cannot see tether's tables). The message names both databases."""


class DatabaseUnreachableError(TetherError, ConnectionError):
    """The PostgreSQL server could not be reached. The message names the (masked) URL."""


class EmbeddedServerError(TetherError, RuntimeError):
    """The embedded PostgreSQL server could not be started or found."""


class SchemaError(TetherError, RuntimeError):
    """The database schema is missing, newer than this tether, or a migration failed."""


class TaskNotFoundError(TetherError, LookupError):
    """No task with that id exists (it may have been pruned by retention)."""


class TaskFailed(TetherError):
    """Raised by TaskResult.unwrap() on an error result."""

    def __init__(self, error: TaskError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


class TaskCancelledError(BaseException):
    """Raised inside a running task by ``tether.current_task().raise_if_cancelled()`` once a
    cancel of the task was requested (docs/tasks.md#cancelling-a-running-task).

    A BaseException, like asyncio.CancelledError, so that an ``except Exception`` in the
    task's code does not swallow it: the task ends CANCELLED when it leaves the task.
    """


class StepError(TetherError, ValueError):
    """A checkpointed step refused (docs/durable-steps.md): a bad name or function, a step called
    the wrong way (sync/async), or a result past the size limit. Nothing was stored."""


class StepLostError(BaseException):
    """Raised inside a running task by a step whose fenced write matched nothing: this attempt
    lost its task (it was recovered elsewhere while this process was frozen or cut off), so
    its step was not stored and its code must stop (docs/durable-steps.md).

    A BaseException, like TaskCancelledError, so that an ``except Exception`` in the task's
    code does not carry a zombie attempt on; its outcome will not be recorded either.
    """


class EventError(TetherError, ValueError):
    """An event refused before anything was written or waited for (docs/durable-steps.md#events):
    a bad key, a payload that is not JSON or too large, a bad timeout. The message names the
    argument."""


class EventTimeoutError(TetherError, TimeoutError):
    """Raised by ``current_task().wait_for_event(key, timeout=...)`` when the timeout passed
    before an event of ``key`` was delivered. The task may catch it; if it leaves the task,
    the task fails with the code ``ErrorCode.EVENT_TIMEOUT`` (``code`` here), which its retry
    policy may list. Every later attempt of the task gets the same answer at the same wait."""

    code = "EVENT_TIMEOUT"

    def __init__(self, message: str, *, key: str, timeout_s: float | None) -> None:
        super().__init__(message)
        self.key = key
        self.timeout_s = timeout_s


class TaskSuspended(BaseException):
    """How ``current_task().sleep(...)`` and ``wait_for_event(...)`` end the attempt: raised in
    the task's code, it unwinds the task (its ``finally`` blocks run) and the worker records
    the suspension (the task PENDING until its due time), fenced like an outcome.

    A BaseException, like TaskCancelledError, so that an ``except Exception`` does not stop
    it; code that catches BaseException must raise it again. Not a failure: the task resumes.
    """

    def __init__(self, name: str, occurrence: int, delay_s: float | None, key: str | None) -> None:
        what = f"waiting for event {key!r}" if key is not None else f"sleeping {delay_s:g}s"
        super().__init__(f"the task is suspended ({what}); this attempt ends here")
        self.name = name
        self.occurrence = occurrence
        self.delay_s = delay_s  # None: a wait with no timeout
        self.key = key  # None: a sleep
