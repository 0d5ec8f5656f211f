"""The structured fields of tether's log lines: which worker wrote a line, and which task it is about.

A line about one task carries ``task_id``, ``attempt``, ``worker_id``, ``queue`` and
``task_name`` as attributes of its LogRecord, so that any formatter can use them: the JSON
one (tether.log_setup) writes them as keys, a user's own format can name ``%(task_id)s``.
They get there two ways:

- explicitly, ``log.warning("...", task.id, extra=about_task(task))``, where the worker's
  main process, the recorder and the reaper speak of a task they hold as data;
- from the running task, for every line logged while a child runs a task's code (tether's
  and the task's own: ``logging.getLogger(__name__).info(...)`` in a task carries its id):
  ``TaskFieldsFilter`` reads ``tether.current_task()``, a context variable in an async child,
  so each of the many tasks one async child runs at once gets its own.

``worker_id`` is on every line of a worker's processes (``set_worker``); a line about a task
carries the worker that holds (or held) its attempt, which for a recovery is the dead one.
A line about many tasks carries ``task_ids`` (at most MAX_TASK_IDS) and ``task_count``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

from tether.current import current_task

#: The fields of a line about one task, in the order the JSON formatter writes them.
TASK_FIELDS = ("task_id", "attempt", "worker_id", "queue", "task_name")
#: A line about many tasks names at most this many of them (an async child can hold thousands).
MAX_TASK_IDS = 100

_worker_id: str | None = None


class TaskLike(Protocol):
    """What a line needs of a task: a claimed TaskPayload, a RunningTask, a recovered row."""

    @property
    def id(self) -> object: ...
    @property
    def name(self) -> str: ...
    @property
    def queue(self) -> str: ...
    @property
    def attempt(self) -> int: ...


def set_worker(worker_id: str | None) -> None:
    """This process belongs to worker ``worker_id`` (its main process or one of its children):
    every line it logs carries it."""
    global _worker_id
    _worker_id = worker_id


def about_task(task: TaskLike, worker_id: str | None = None) -> dict[str, Any]:
    """``extra=`` for a line about ``task``; ``worker_id``: the worker holding its attempt, when
    that is not this process's own (the reaper speaking of a dead worker's task)."""
    fields: dict[str, Any] = {
        "task_id": str(task.id),
        "attempt": task.attempt,
        "queue": task.queue,
        "task_name": task.name,
    }
    if worker_id is not None:
        fields["worker_id"] = worker_id
    stored = getattr(task, "trace_context", None)
    if stored:
        # The W3C traceparent "00-<trace id>-<span id>-<flags>" of its send (tracing on): a
        # log backend joins the line to the trace (OpenTelemetry's log field names).
        parts = stored.split("-", 3)
        if len(parts) == 4:
            fields["trace_id"], fields["span_id"] = parts[1], parts[2]
    return fields


def about_tasks(tasks: Sequence[TaskLike], worker_id: str | None = None) -> dict[str, Any]:
    """``extra=`` for a line about several tasks: one task's fields when there is one, else
    ``task_ids`` (the first MAX_TASK_IDS) and ``task_count``; none for none."""
    if len(tasks) == 1:
        return about_task(tasks[0], worker_id)
    fields: dict[str, Any] = {}
    if tasks:
        fields["task_ids"] = [str(t.id) for t in tasks[:MAX_TASK_IDS]]
        fields["task_count"] = len(tasks)
    if worker_id is not None:
        fields["worker_id"] = worker_id
    return fields


class TaskFieldsFilter(logging.Filter):
    """Adds the running task's fields and this process's worker to every record it sees, unless
    the line gave its own; drops nothing. tether puts it on the handler it installs
    (tether.log_setup); add it to a handler of your own to have the fields there too."""

    def filter(self, record: logging.LogRecord) -> bool:
        given = record.__dict__
        if "task_id" not in given and "task_ids" not in given:
            task = current_task()
            if task is not None:
                given.update(about_task(task, task.worker_id))
        if "worker_id" not in given and _worker_id is not None:
            given["worker_id"] = _worker_id
        return True
