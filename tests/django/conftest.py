"""Fixtures of the Django backend's tests: the test project (tests/django_project) set up on
the run's database in this process, and real workers started as a user starts them.

Tests tell their tasks apart by a token of their own (the Run rows a task leaves), so one
worker serves a whole module and nothing is truncated under its feet.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.conftest import REPO, WorkerFactory, WorkerProcess, clean_tables, wait_until

SETTINGS = "tests.django_project.settings"
MANAGE = REPO / "tests" / "django_project" / "manage.py"
WAIT = 30.0


def tether_worker_command(*args: str) -> list[str]:
    """``tether worker --django SETTINGS ...`` as a user types it."""
    return [sys.executable, "-m", "tether", "--log-level", "INFO", "worker", "--django", SETTINGS, *args]


def manage_command(*args: str) -> list[str]:
    """``python manage.py tether_worker ...`` as a user types it."""
    return [sys.executable, str(MANAGE), "tether_worker", *args]


@pytest.fixture(scope="session")
def django_project(database_url: str) -> Iterator[None]:
    """Django set up in this process on the run's database, with the project's tables."""
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    import django
    from django.core.management import call_command
    from django.db import connections

    tz = os.environ.get("TZ")
    django.setup()
    # Django sets the process's TZ to TIME_ZONE; the rest of the suite keeps the machine's.
    if os.environ.get("TZ") != tz:
        if tz is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = tz
        time.tzset()
    call_command("migrate", run_syncdb=True, verbosity=0)
    try:
        yield
    finally:
        from tether.contrib.django import registry

        for app in registry.apps_built():
            app.close()
        connections.close_all()


@pytest.fixture(scope="module")
def module_workers(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerFactory]:
    """Workers that live as long as the test module; each killed by its pid at the end."""
    factory = WorkerFactory(database_url, tmp_path_factory.mktemp("django-workers"))
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def worker(django_project: None, module_workers: WorkerFactory, direct_url: str) -> WorkerProcess:
    """One `tether worker --django` on the default queue, shared by a module's tests.

    The tether tables are emptied first, as the db fixture does for every other test: an
    earlier module in this process may have left its state (a paused "default" queue, which
    test_health.py leaves for the next test's clean-up, made this worker claim nothing)."""
    with psycopg.connect(direct_url, autocommit=True) as conn:
        clean_tables(conn)
    return module_workers.start(
        "django", command=tether_worker_command("--processes", "2", "--queues", "default")
    )


@pytest.fixture
def backend(django_project: None) -> Any:
    from django.tasks import default_task_backend

    return default_task_backend


def token() -> str:
    return uuid.uuid4().hex


def finished(result: Any, timeout: float = WAIT) -> Any:
    """Wait for the task to end (tether's result wait: a notification, polling as fallback),
    then refresh the Django result; returns it."""
    from django.tasks import default_task_backend

    outcome = default_task_backend.app.handle(result.id).get(timeout=timeout)
    assert outcome.err is None or outcome.err.code != "WAIT_TIMEOUT", f"task {result.id} still not done"
    result.refresh()
    return result


def runs(tok: str) -> list[Any]:
    """The Run rows left by tasks carrying ``tok`` (one per execution), oldest first."""
    from tests.django_project.shop.models import Run

    return list(Run.objects.filter(token=tok).order_by("id"))


def wait_runs(tok: str, count: int = 1, timeout: float = WAIT) -> list[Any]:
    """Wait until ``count`` executions carrying ``tok`` have started (there is no event for it)."""

    def started() -> list[Any] | None:
        found = runs(tok)
        return found if len(found) >= count else None

    return wait_until(started, timeout=timeout, message=f"{count} run(s) of token {tok}")


def task_row(task_id: Any) -> dict[str, Any] | None:
    from tests.apps.support import connect

    with connect(os.environ["TETHER_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT * FROM tether_tasks WHERE id = %s", (str(task_id),)).fetchone()
    return None if row is None else dict(row)
