"""A tether worker for a Django project: Django set up in its main process and in every child.

``tether worker --django mysite.settings`` and ``python manage.py tether_worker`` both come
here. The worker's children are started with multiprocessing's *spawn*, so nothing of
the main process's Django setup reaches them: each child imports the app path
``tether.contrib.django.worker_app:app``, whose import does it all again (settings from
DJANGO_SETTINGS_MODULE, the backend alias from TETHER_DJANGO_BACKEND, both set here in
the environment the children inherit).

Finding tasks: at start, every installed app's ``tasks`` module is imported (Django's
autodiscover_modules) and the Django tasks in it are registered. A row naming any other
task is resolved on demand by registry.resolve: only modules inside an installed app's
package are ever imported, and only a Django Task with exactly that path is run.
"""

from __future__ import annotations

import logging
import os
import sys
from functools import partial
from typing import Any

import django
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.tasks import DEFAULT_TASK_BACKEND_ALIAS, task_backends
from django.utils.module_loading import autodiscover_modules

from tether.app import Tether
from tether.contrib.django import registry
from tether.contrib.django.backend import TetherBackend
from tether.task import Task

log = logging.getLogger("tether.contrib.django")

BACKEND_ENV = "TETHER_DJANGO_BACKEND"
WORKER_APP_PATH = "tether.contrib.django.worker_app:app"


def prepare(settings_module: str | None, backend_alias: str) -> str:
    """Set the environment every process of the worker reads; returns the app path to load.

    ``settings_module`` None: DJANGO_SETTINGS_MODULE must be set already (manage.py does).
    """
    if settings_module:
        os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    elif not os.environ.get("DJANGO_SETTINGS_MODULE"):
        raise ImproperlyConfigured(
            "no Django settings: give --django mysite.settings or set DJANGO_SETTINGS_MODULE"
        )
    if not backend_alias:
        raise ImproperlyConfigured("the backend alias (a key of settings.TASKS) must not be empty")
    os.environ[BACKEND_ENV] = backend_alias
    return WORKER_APP_PATH


def load_worker_app() -> Tether:
    """In any process of a Django worker: set Django up, register its tasks, return the app."""
    settings_module = os.environ.get("DJANGO_SETTINGS_MODULE")
    if not settings_module:
        raise ImproperlyConfigured(
            f"{WORKER_APP_PATH} needs DJANGO_SETTINGS_MODULE (tether worker --django sets it)"
        )
    # Like `python -m` (and tether's app loader): the project's modules are found from here.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    if not apps.ready:
        django.setup()
    alias = os.environ.get(BACKEND_ENV) or DEFAULT_TASK_BACKEND_ALIAS
    backend = task_backends[alias]
    if not isinstance(backend, TetherBackend):
        raise ImproperlyConfigured(
            f"TASKS[{alias!r}] uses {type(backend).__module__}.{type(backend).__qualname__}, not "
            "tether.contrib.django.TetherBackend: a tether worker runs a TetherBackend's tasks"
        )
    names = discover(backend)
    log.info(
        "Django project %s, backend %r: %d task(s) found in installed apps' tasks modules",
        settings_module,
        alias,
        len(names),
    )
    return backend.app


def discover(backend: TetherBackend) -> list[str]:
    """Import every installed app's ``tasks`` module and register the Django tasks found there;
    let the app resolve other names (registry.resolve's rule). Returns the names registered."""
    autodiscover_modules("tasks")  # re-raises an error inside a tasks module that exists
    names = []
    for app_config in apps.get_app_configs():
        module = sys.modules.get(f"{app_config.name}.tasks")
        if module is None:
            continue
        for task in registry.tasks_of(module):
            names.append(backend.tether_task(task).name)
    backend.app.task_resolver = partial(_resolve, backend)
    return sorted(set(names))


def _resolve(backend: TetherBackend, name: str) -> Task[Any, Any] | None:
    task = backend.django_task(name)
    return None if task is None else backend.tether_task(task)


def cli_worker_app(settings_module: str, backend_alias: str) -> tuple[Tether, str]:
    """For ``tether worker --django``: the app and the path its children load. A bad setup is
    a ValueError, which the tether command prints as one line (not a traceback)."""
    path = prepare(settings_module, backend_alias)
    try:
        return load_worker_app(), path
    except ImproperlyConfigured as exc:
        raise ValueError(f"Django: {exc}") from exc
    except ImportError as exc:
        if exc.name is None or not settings_module.startswith(exc.name):
            raise  # an import inside the project failed: its traceback says where
        raise ValueError(f"Django: cannot import settings {settings_module!r}: {exc}") from exc
