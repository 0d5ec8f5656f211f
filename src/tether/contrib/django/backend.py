"""TetherBackend: Django's task backend interface (django.tasks.backends.base) on tether.

Django's ``@task`` functions become tether tasks named by their ``module_path``; enqueue
writes a tether row (in Django's current transaction, see sending.py), get_result reads
it back as a Django TaskResult (results.py), and ``tether worker --django`` or
``manage.py tether_worker`` runs them (worker.py). See docs/django.md.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from django.apps import apps
from django.core import checks
from django.db import connections, transaction
from django.tasks import TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils import timezone
from django.utils.json import normalize_json

from tether.app import Tether
from tether.config import AppConfig
from tether.contrib.django import registry, results, sending
from tether.contrib.django.database import database_url
from tether.contrib.django.options import BackendSettings, parse_settings
from tether.errors import TaskDefinitionError
from tether.task import Task


class TetherBackend(BaseTaskBackend):  # type: ignore[misc]  # Django has no type hints
    """A django.tasks backend whose tasks are durable tether tasks in PostgreSQL."""

    supports_defer = True  # run_after
    supports_async_task = True  # async def tasks (run with Django's async_to_sync in the worker)
    supports_get_result = True  # from any thread or process: the row is the result
    supports_priority = True  # -100..100, higher first: tether's own range

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.settings: BackendSettings = parse_settings(alias, params)
        # Django reads QUEUES=[] as "any queue"; tether serves declared queues only.
        self.queues = set(self.settings.queues)
        where = f"TASKS[{alias!r}]['OPTIONS']['DATABASE']"
        self.app_config: AppConfig = self.settings.app_config(database_url(self.settings.database, where))

    # -- tether -----------------------------------------------------------------------

    @property
    def app(self) -> Tether:
        """This process's tether app for this backend (one per process, built on first use)."""
        return registry.shared_app(self.alias, self.app_config)

    def tether_task(self, task: Any) -> Task[Any, Any]:
        """The tether task that runs Django task ``task``: for workflows (``.node()``), unique
        sends (``.with_options(unique_key=...)``) and everything else tether adds."""
        return registry.tether_task(self.app, task, self.alias, self.settings.for_task(task.module_path))

    def django_task(self, name: str) -> Any:
        """The Django task registered as tether task ``name``, found under registry.resolve's rule."""
        return registry.django_task(name)

    # -- Django's interface -------------------------------------------------------------

    def validate_task(self, task: Any) -> None:
        if task.queue_name not in self.queues:
            raise InvalidTask(
                f"Queue {task.queue_name!r} is not valid for backend {self.alias!r}: tether serves the "
                f"queues in TASKS[{self.alias!r}]['QUEUES'] ({', '.join(sorted(self.queues))})"
            )
        super().validate_task(task)
        try:
            self.tether_task(task)
        except TaskDefinitionError as exc:
            raise InvalidTask(f"{task.module_path!r} cannot be a tether task: {exc}") from None

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        self.validate_task(task)
        if apps.get_containing_app_config(task.func.__module__) is None:
            raise InvalidTask(
                f"Task {task.module_path!r} is defined in {task.func.__module__!r}, which belongs to no "
                "installed app: a tether worker finds tasks only in INSTALLED_APPS' packages"
            )
        args = normalize_json(list(args))
        kwargs = normalize_json(dict(kwargs))
        handle = sending.send(
            self.tether_task(task),
            {"queue": task.queue_name, "priority": task.priority},
            task.run_after,
            args,
            kwargs,
            self.settings.database,
        )
        result = TaskResult(
            task=task,
            id=str(handle.id),
            status=TaskResultStatus.READY,
            enqueued_at=timezone.now(),
            started_at=None,
            finished_at=None,
            last_attempted_at=None,
            args=args,
            kwargs=kwargs,
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        self._announce(result)
        return result

    def _announce(self, result: Any) -> None:
        """task_enqueued, once the row is visible to workers: at commit when in a transaction."""
        if connections[self.settings.database].in_atomic_block:
            # robust: a receiver raising after the commit is logged by Django, and the
            # transaction that enqueued stays committed.
            announce = partial(task_enqueued.send, type(self), task_result=result)
            transaction.on_commit(announce, using=self.settings.database, robust=True)
        else:
            task_enqueued.send(type(self), task_result=result)

    def get_result(self, result_id: Any) -> Any:
        task_id = results.parse_result_id(result_id)
        if task_id is None:
            raise TaskResultDoesNotExist(result_id)
        stored = results.read(self.app, task_id)
        if stored is None:
            raise TaskResultDoesNotExist(result_id)
        task = self.django_task(stored.name)
        if task is None:
            raise TaskResultDoesNotExist(
                f"{result_id}: tether task {stored.name!r} is not a Django task of an installed app"
            )
        return results.to_django(stored, task, self.alias, self.queues)

    def check(self, **kwargs: Any) -> list[Any]:
        found = []
        for path in self.settings.per_task:
            if self.django_task(path) is None:
                found.append(
                    checks.Warning(
                        f"TASKS[{self.alias!r}]['OPTIONS']['TASK_OPTIONS'] names {path!r}, which is not "
                        "a Django task in an installed app; its options apply to nothing",
                        id="tether.W001",
                    )
                )
        return found
