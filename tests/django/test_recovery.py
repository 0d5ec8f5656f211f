"""A worker killed with kill -9 in the middle of a Django task: recovered by tether's rules,
and what happened is visible through Django's API."""

from __future__ import annotations

import os
import signal
from typing import Any

from tests.apps.support import attempt_rows, connect
from tests.conftest import WorkerFactory
from tests.django.conftest import finished, task_row, tether_worker_command, token, wait_runs


def test_a_killed_worker_s_task_is_retried_when_its_policy_lists_worker_crashed(
    django_project: None, workers: WorkerFactory, backend: Any, database_url: str
) -> None:
    """crash_once's TASK_OPTIONS retry WORKER_CRASHED once (tests/django_project/settings.py)."""
    from django.tasks import TaskResultStatus

    from tests.django_project.shop import tasks
    from tether.contrib.django.errors import WorkerCrashed

    tok = token()
    first = workers.start("django", command=tether_worker_command("--processes", "1", "--queues", "default"))
    result = tasks.crash_once.enqueue(tok)
    wait_runs(tok)  # attempt 1 is inside the task's code
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING

    first.kill()  # SIGKILL to the worker's whole process group: nothing of it records anything
    # A worker restarted on the same host finds its predecessor's process gone at startup and
    # recovers the task at once: RUNNING when it died, so WORKER_CRASHED, retried by the policy.
    second = workers.start("django", command=tether_worker_command("--processes", "1", "--queues", "default"))
    result = finished(result)
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == "attempt 2"
    assert result.worker_ids == [first.worker_id, second.worker_id] and result.attempts == 2
    [crash] = result.errors
    assert crash.exception_class is WorkerCrashed and "WORKER_CRASHED" in crash.traceback
    with connect(database_url) as conn:
        history = [
            (a["attempt"], a["outcome"], a["error_code"], a["will_retry"])
            for a in attempt_rows(conn, result.id)
        ]
    assert history == [(1, "FAILED", "WORKER_CRASHED", True), (2, "COMPLETED", None, False)]


def test_a_crash_is_final_without_a_retry_policy(
    django_project: None, workers: WorkerFactory, backend: Any, database_url: str
) -> None:
    from django.tasks import TaskResultStatus

    from tests.django_project.shop import tasks
    from tether.contrib.django.errors import WorkerCrashed

    tok = token()
    worker = workers.start("django", command=tether_worker_command("--processes", "1", "--queues", "default"))
    result = tasks.hang.enqueue(tok)
    [run] = wait_runs(tok)
    os.kill(run.pid, signal.SIGKILL)  # the child process running the task, by the pid it recorded
    result = finished(result)
    assert result.status == TaskResultStatus.FAILED
    [crash] = result.errors
    assert crash.exception_class is WorkerCrashed
    assert result.worker_ids == [worker.worker_id]
    row = task_row(result.id)
    assert row is not None and (row["status"], row["error_code"], row["retry_count"]) == (
        "FAILED",
        "WORKER_CRASHED",
        0,
    )
    # At most once: the code ran one time, and the worker goes on with a new child.
    assert len(wait_runs(tok)) == 1
    assert finished(tasks.add.enqueue(2, 2)).return_value == 4
