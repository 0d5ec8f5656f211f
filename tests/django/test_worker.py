"""Starting a worker for the Django project, and how it finds tasks (and what it never imports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.apps.support import connect
from tests.conftest import REPO, WorkerFactory
from tests.django.conftest import SETTINGS, finished, manage_command, runs, tether_worker_command, token
from tether import AppConfig, PostgresConfig, TaskStatus, Tether


def test_manage_py_tether_worker_runs_the_project_s_tasks(
    django_project: None, workers: WorkerFactory, backend: Any
) -> None:
    from tests.django_project.shop import tasks

    worker = workers.start("manage.py", command=manage_command("--processes", "1", "--queues", "emails"))
    tok = token()
    result = finished(tasks.send_email.enqueue(tok))
    assert result.return_value == tok and result.worker_ids == [worker.worker_id]
    assert [run.task for run in runs(tok)] == ["send_email"]


def test_tether_worker_django_runs_the_project_s_tasks(
    django_project: None, workers: WorkerFactory, backend: Any, database_url: str
) -> None:
    from tests.django_project.shop import tasks

    worker = workers.start("django", command=tether_worker_command("--processes", "1", "--queues", "emails"))
    result = finished(tasks.send_email.enqueue(token()))
    assert str(result.status) == "SUCCESSFUL" and result.worker_ids == [worker.worker_id]
    with connect(database_url) as conn:
        row = conn.execute(
            "SELECT task_names FROM tether_workers WHERE id = %s", (worker.worker_id,)
        ).fetchone()
    assert row is not None
    # The tasks modules of installed apps are imported at start; other modules only on demand.
    assert "tests.django_project.shop.tasks.send_email" in row["task_names"]
    assert "tests.django_project.shop.jobs.lazy_job" not in row["task_names"]
    assert "Django project tests.django_project.settings, backend 'default'" in worker.log()


def test_a_task_outside_the_tasks_module_is_found_when_a_row_names_it(
    django_project: None, workers: WorkerFactory, backend: Any
) -> None:
    from tests.django_project.shop import jobs

    worker = workers.start("django", command=tether_worker_command("--processes", "1", "--queues", "default"))
    tok = token()
    result = finished(jobs.lazy_job.enqueue(tok))
    assert result.return_value == "found" and result.worker_ids == [worker.worker_id]
    assert len(runs(tok)) == 1


def test_a_row_never_makes_the_worker_import_outside_installed_apps(
    django_project: None, workers: WorkerFactory, database_url: str, tmp_path: Path
) -> None:
    mark = tmp_path / "outside-imported"
    worker = workers.start(
        "django",
        command=tether_worker_command("--processes", "1", "--queues", "default"),
        env={"TETHER_TEST_IMPORT_MARK": str(mark)},
    )
    # Rows written by a plain tether app on the same database, naming what the worker must
    # not run: a module in no installed app, a function of an app that is not a Django
    # task, and a standard library function.
    names = [
        "tests.django_project.outside.outside_task",
        "tests.django_project.shop.jobs.helper",
        "os.system",
    ]
    with Tether(AppConfig(broker=PostgresConfig(database_url=database_url))) as other:
        handles = [other.task(name)(lambda *args: None).send() for name in names]
        outcomes = [handle.get(timeout=30) for handle in handles]
        assert [handle.status() for handle in handles] == [TaskStatus.FAILED] * 3
    assert [o.err.code if o.err else None for o in outcomes] == ["TASK_NOT_REGISTERED"] * 3
    assert not mark.exists(), mark.read_text()
    log = worker.log()
    assert "module 'tests.django_project.outside' is not in an installed app's package" in log
    assert "module 'os' is not in an installed app's package" in log
    assert "tests.django_project.shop.jobs.helper is function, not a Django task" in log


def test_bad_worker_invocations_say_what_is_wrong(django_project: None, database_url: str) -> None:
    def tether_worker(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tether", "worker", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )

    neither = tether_worker()
    assert (
        neither.returncode == 2 and "give either APP_PATH (module:app) or --django SETTINGS" in neither.stderr
    )
    both = tether_worker("tests.apps.basic:app", "--django", SETTINGS)
    assert both.returncode == 2 and "give either APP_PATH" in both.stderr
    missing = tether_worker("--django", "tests.django_project.no_such_settings")
    assert missing.returncode == 1
    assert "error: Django: cannot import settings 'tests.django_project.no_such_settings'" in missing.stderr
    assert "Traceback" not in missing.stderr
    no_backend = tether_worker("--django", SETTINGS, "--django-backend", "nope")
    assert (
        no_backend.returncode == 1 and "error: Django: " in no_backend.stderr and "nope" in no_backend.stderr
    )


def test_the_worker_refuses_a_backend_that_is_not_tether(
    django_project: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.core.exceptions import ImproperlyConfigured
    from django.test import override_settings

    from tether.contrib.django.worker import load_worker_app, prepare

    monkeypatch.setenv("TETHER_DJANGO_BACKEND", "default")  # undone at the end; prepare() sets it
    immediate = {"default": {"BACKEND": "django.tasks.backends.immediate.ImmediateBackend"}}
    with override_settings(TASKS=immediate):
        prepare(SETTINGS, "default")
        with pytest.raises(ImproperlyConfigured, match=r"ImmediateBackend, not tether\.contrib\.django"):
            load_worker_app()
