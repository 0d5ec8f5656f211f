"""Exception classes that stand for tether's failure codes in Django's ``TaskResult.errors``.

Django describes each failure as ``TaskError(exception_class_path, traceback)``. A task
that raised gets its own exception's class. A task that failed without raising (its
worker died, its time limit passed, no worker knew its name, it expired or was
cancelled) gets one of these classes, so ``errors[i].exception_class`` always resolves
and ``issubclass(..., WorkerCrashed)`` tells a crash apart. Nothing raises them.
"""

from __future__ import annotations

from tether.result import ErrorCode


class TetherTaskError(Exception):
    """The task failed with a tether error code, not with an exception of its own."""


class WorkerCrashed(TetherTaskError):
    """WORKER_CRASHED: the process running the task died, hung, or went silent."""


class TimeLimitExceeded(TetherTaskError):
    """TIME_LIMIT_EXCEEDED: the attempt still ran when its time limit passed, and was killed."""


class TaskNotRegistered(TetherTaskError):
    """TASK_NOT_REGISTERED: no live worker serving the queue could find the task."""


class BadArguments(TetherTaskError):
    """BAD_ARGUMENTS: the stored arguments no longer fit the task's signature."""


class ResultNotSerializable(TetherTaskError):
    """RESULT_NOT_SERIALIZABLE: the return value could not be stored."""


class TaskExpired(TetherTaskError):
    """TASK_EXPIRED: its good_until passed before a worker claimed it."""


class TaskCancelled(TetherTaskError):
    """TASK_CANCELLED: cancelled before any of its code ran."""


class ExceptionNotKept(TetherTaskError):
    """An earlier attempt raised; tether keeps only its message (the class's name is in it).

    tether stores the traceback and the class's import path of the latest attempt only;
    each earlier attempt keeps its code and message in the attempts history.
    """


#: The class each of tether's codes stands for; any other code is a TetherTaskError.
CODE_CLASSES: dict[str, type[TetherTaskError]] = {
    ErrorCode.WORKER_CRASHED: WorkerCrashed,
    ErrorCode.TIME_LIMIT_EXCEEDED: TimeLimitExceeded,
    ErrorCode.TASK_NOT_REGISTERED: TaskNotRegistered,
    ErrorCode.BAD_ARGUMENTS: BadArguments,
    ErrorCode.RESULT_NOT_SERIALIZABLE: ResultNotSerializable,
    ErrorCode.TASK_EXPIRED: TaskExpired,
    ErrorCode.TASK_CANCELLED: TaskCancelled,
    ErrorCode.UNHANDLED_EXCEPTION: ExceptionNotKept,
}


def class_path(cls: type[BaseException]) -> str:
    """The import path Django's TaskError.exception_class_path holds (module and qualified name)."""
    return f"{cls.__module__}.{cls.__qualname__}"
