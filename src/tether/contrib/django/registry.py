"""Which tether app and tasks stand for a Django backend in this process.

Django builds one backend object per thread (its handler keeps them thread-local), so
the tether app cannot live on the backend: each process keeps one app per backend alias
here, built on first use, with one pool. Each Django task becomes a tether task named
by its ``module_path``, registered on first use.

Finding a task by name (a worker claiming a row, get_result reading one) imports code
only under one rule: the module must belong to an installed Django app's package, and
the attribute found there must be a Django Task with exactly that path. A row names
a module; it must never make a process import anything else.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

from django.apps import apps
from django.tasks import Task as DjangoTask

from tether.app import Tether
from tether.config import AppConfig
from tether.contrib.django.options import TaskSettings
from tether.contrib.django.runner import make_runner
from tether.task import Task

log = logging.getLogger("tether.contrib.django")

# One lock for both tables: registering is rare (once per task and process) and quick.
_lock = threading.RLock()
_apps: dict[str, Tether] = {}  # by backend alias
_django_tasks: dict[str, Any] = {}  # every Django task registered here, by module_path


def shared_app(backend_alias: str, config: AppConfig) -> Tether:
    """This process's tether app for the backend; a new one if its settings changed (tests)."""
    with _lock:
        app = _apps.get(backend_alias)
        if app is None or app.config != config:
            app = _apps[backend_alias] = Tether(config)
        return app


def apps_built() -> list[Tether]:
    """The tether apps built in this process (to close them, e.g. at the end of tests)."""
    with _lock:
        return list(_apps.values())


def tether_task(app: Tether, task: Any, backend_alias: str, settings: TaskSettings) -> Task[Any, Any]:
    """The tether task that runs Django task ``task`` (registered on ``app`` on first use)."""
    name = task.module_path
    with _lock:
        found = app.tasks.get(name)
        if found is None:
            register = app.task(name, retry_policy=settings.retry_policy, time_limit=settings.time_limit)
            found = register(make_runner(app, task, backend_alias))
        _django_tasks.setdefault(name, task)
        return found


def django_task(name: str) -> Any:
    """The Django task named ``name``: registered here already, or found by ``resolve``."""
    with _lock:
        found = _django_tasks.get(name)
    if found is None:
        found = resolve(name)
        if found is not None:
            with _lock:
                found = _django_tasks.setdefault(name, found)
    return found


def resolve(name: str) -> Any:
    """The Django Task whose ``module_path`` is ``name``, or None (logged with the reason).

    Imports the module only when it belongs to an installed app's package.
    """
    module_name, _, attribute = name.rpartition(".")
    if not module_name or apps.get_containing_app_config(module_name) is None:
        log.warning(
            "task name %r: module %r is not in an installed app's package; not importing it "
            "(a Django task must live in an app listed in INSTALLED_APPS)",
            name,
            module_name,
        )
        return None
    try:
        module = importlib.import_module(module_name)
    except Exception:
        log.exception("task name %r: importing module %r failed", name, module_name)
        return None
    found = getattr(module, attribute, None)
    if not isinstance(found, DjangoTask) or found.module_path != name:
        log.warning(
            "task name %r: %s.%s is %s, not a Django task with that path",
            name,
            module_name,
            attribute,
            "missing" if found is None else type(found).__name__,
        )
        return None
    return found


def tasks_of(module: Any) -> list[Any]:
    """The Django tasks a module holds (defined there or imported into it)."""
    return [value for value in vars(module).values() if isinstance(value, DjangoTask)]
