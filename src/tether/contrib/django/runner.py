"""What a worker child runs for a Django task: Django's function, wrapped as Django's own
immediate backend wraps it.

Around every run: ``close_old_connections()`` before and after (a connection the
database closed, or one past CONN_MAX_AGE, is not handed to the task; what Celery's
Django fixup does too); the ``task_started`` and ``task_finished`` signals with the
run's TaskResult; a TaskContext for ``takes_context`` tasks; and the return value
normalised to JSON as Django's backends do (a value that cannot be stored fails the
run with the exception, as on Django's immediate backend).

An exception the task raises goes on to tether's executor, which records it (class
path and traceback) and applies the task's retry policy.
"""

from __future__ import annotations

import inspect
import logging
import traceback
from collections.abc import Callable
from typing import Any

from django.db import close_old_connections
from django.tasks import TaskContext, TaskResultStatus, task_backends
from django.tasks.base import TaskError
from django.tasks.signals import task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json

from tether import codec
from tether.app import Tether
from tether.contrib.django import results
from tether.contrib.django.errors import class_path
from tether.current import RunningTask, current_task

log = logging.getLogger("tether.contrib.django")


def call_signature(task: Any) -> inspect.Signature:
    """The signature callers use: the function's, without ``context`` for takes_context tasks."""
    signature = inspect.signature(task.func)
    if task.takes_context:
        parameters = list(signature.parameters.values())[1:]
        signature = signature.replace(parameters=parameters)
    return signature


def make_runner(app: Tether, task: Any, backend_alias: str) -> Callable[..., Any]:
    """The function the tether task of Django task ``task`` runs.

    It carries the Django function's call signature, so tether binds arguments against it
    when they are sent (a wrong call is refused by enqueue), checks stored arguments still
    fit before a run, and lets workflows feed its parameters by name.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        return run_task(app, task, backend_alias, args, kwargs)

    # inspect.signature() reads __signature__ first: the documented way to give a wrapper
    # the signature of what it wraps without functools.wraps, whose __wrapped__ would
    # also hand tether the function's annotations (tether would then convert arguments,
    # and Django passes them exactly as the JSON round trip left them).
    run.__signature__ = call_signature(task)  # type: ignore[attr-defined]
    run.__qualname__ = run.__name__ = f"run_{task.func.__name__}"
    return run


def run_task(
    app: Tether, task: Any, backend_alias: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    running = current_task()
    if running is None:
        raise RuntimeError(
            f"Django task {task.module_path!r}: its tether runner runs only inside a tether worker; "
            "call the Django task itself (task.call(...)) to run it here"
        )
    close_old_connections()
    try:
        return _run(app, task, backend_alias, running, args, kwargs)
    finally:
        close_old_connections()


def _run(
    app: Tether,
    task: Any,
    backend_alias: str,
    running: RunningTask,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    backend = task_backends[backend_alias]
    stored = results.read(app, running.id)
    if stored is None:
        raise RuntimeError(f"task {running.id} ({task.module_path}) has no row, yet this worker runs it")
    result = results.running_result(stored, task, backend_alias, backend.queues, running.worker_id)
    sender = type(backend)
    task_started.send(sender=sender, task_result=result)
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
        value = normalize_json(value)
        # What tether will store: a value it refuses fails here, as the task's own error,
        # so the task_finished signal and the recorded outcome agree.
        codec.dumps(value, what=f"return value of task {task.module_path!r}")
    except KeyboardInterrupt:
        raise
    except BaseException as exc:
        error = TaskError(
            exception_class_path=class_path(type(exc)), traceback="".join(traceback.format_exception(exc))
        )
        _finish(result, TaskResultStatus.FAILED)
        result.errors.append(error)
        _send_finished(sender, result)  # inside the handler: receivers can log sys.exc_info()
        raise
    _finish(result, TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "_return_value", value)
    _send_finished(sender, result)
    return value


def _finish(result: Any, status: Any) -> None:
    object.__setattr__(result, "status", status)
    object.__setattr__(result, "finished_at", timezone.now())


def _send_finished(sender: type, result: Any) -> None:
    """task_finished; a receiver that raises is logged and does not change the task's outcome."""
    for receiver, response in task_finished.send_robust(sender=sender, task_result=result):
        if isinstance(response, Exception):
            log.error(
                "task %s (%s): task_finished receiver %r raised; the outcome stands",
                result.id,
                result.task.module_path,
                receiver,
                exc_info=response,
            )
