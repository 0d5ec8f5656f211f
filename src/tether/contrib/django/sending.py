"""Writing a Django task's row through Django's own connection, in Django's transaction.

Inside ``transaction.atomic()`` (``connection.in_atomic_block``) the row is written in
the block's transaction, with its NOTIFY: a rollback leaves no task, and a worker can
claim the task only once the transaction commits, when every row it wrote is visible.
Outside any atomic block the send is wrapped in ``transaction.atomic(using=...)``, so
Django commits it at once, as an autocommit statement would be. Either way the row goes
through Django's connection of the backend's database alias: a web process needs no
tether connection to send (tether's pool serves reads, such as get_result).

Django 6 has no ``enqueue_on_commit``: its docs tell users to call
``transaction.on_commit(partial(task.enqueue, ...))`` so a worker cannot run a task
before the data it needs is committed. That still works here (the callback runs after
the commit, outside any block); writing in the transaction gives the same guarantee
without the window where the process dies between the commit and the callback.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import connections, transaction
from django.utils import timezone

from tether.handle import TaskHandle
from tether.task import Task


def run_at(run_after: datetime | None) -> datetime | timedelta:
    """What tether's schedule() takes for Django's Task.run_after: now, or an aware datetime."""
    if run_after is None:
        return timedelta(0)
    if timezone.is_naive(run_after):
        # Only with USE_TZ = False (validate_task refuses naive values otherwise): Django
        # reads naive datetimes in the default time zone (settings.TIME_ZONE).
        aware: datetime = timezone.make_aware(run_after, timezone.get_default_timezone())
        return aware
    return run_after


def send(
    task: Task[Any, Any],
    options: dict[str, Any],
    run_after: datetime | None,
    args: list[Any],
    kwargs: dict[str, Any],
    database: str,
) -> TaskHandle[Any]:
    """Write the task's row (``options`` for with_options) in Django's transaction on ``database``."""
    connection = connections[database]
    if connection.in_atomic_block:
        return _send_on(connection, task, options, run_after, args, kwargs)
    with transaction.atomic(using=database):
        return _send_on(connection, task, options, run_after, args, kwargs)


def _send_on(
    connection: Any,
    task: Task[Any, Any],
    options: dict[str, Any],
    run_after: datetime | None,
    args: list[Any],
    kwargs: dict[str, Any],
) -> TaskHandle[Any]:
    connection.ensure_connection()
    bound = task.with_options(connection=connection.connection, **options)
    return bound.schedule(run_at(run_after), *args, **kwargs)
