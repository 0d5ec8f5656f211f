"""Results through Django's API: get_result, refresh, the status mapping and every field,
errors with their exception class, TaskContext, async tasks, the worker's signals."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.conftest import WorkerProcess
from tests.django.conftest import finished, runs, task_row, token, wait_runs


@pytest.fixture
def advisory_lock(database_url: str) -> Iterator[tuple[int, psycopg.Connection[Any]]]:
    """An advisory lock held by this test on its own session (a gate for the `gated` task)."""
    key = random.randrange(1, 2**62)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (key,))
        try:
            yield key, conn
        finally:
            conn.execute("SELECT pg_advisory_unlock_all()")


def test_status_and_fields_through_a_run(
    worker: WorkerProcess, backend: Any, advisory_lock: tuple[int, psycopg.Connection[Any]]
) -> None:
    from django.tasks import TaskResultStatus

    from tests.django_project.shop import tasks

    key, gate = advisory_lock
    tok = token()
    result = tasks.gated.enqueue(key, tok)
    wait_runs(tok)  # its code runs, held at the gate
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING
    assert result.started_at is not None and result.last_attempted_at == result.started_at
    assert result.finished_at is None and not result.is_finished
    assert result.worker_ids == [] and result.attempts == 0  # a run in progress is no attempt yet
    with pytest.raises(ValueError, match="Task has not finished yet"):
        _ = result.return_value

    gate.execute("SELECT pg_advisory_unlock(%s)", (key,))
    result = finished(result)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.is_finished
    assert result.return_value == "through"
    row = task_row(result.id)
    assert row is not None
    assert result.enqueued_at == row["sent_at"] and result.started_at == row["started_at"]
    assert result.finished_at == row["completed_at"] and result.last_attempted_at == row["started_at"]
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert result.worker_ids == [worker.worker_id] and result.attempts == 1 and result.errors == []
    assert (result.args, result.kwargs, result.backend) == ([key, tok], {}, "default")
    fetched = backend.get_result(result.id)
    assert fetched.task.func is tasks.gated.func and fetched.id == result.id
    assert (fetched.status, fetched.return_value) == (TaskResultStatus.SUCCESSFUL, "through")
    assert tasks.gated.get_result(result.id).return_value == "through"


def test_waiting_and_cancelled_tasks(worker: WorkerProcess, backend: Any) -> None:
    from django.tasks import TaskResultStatus

    from tests.django_project.shop import tasks
    from tether.contrib.django.errors import TaskCancelled

    tok = token()
    result = tasks.batch_item.enqueue(tok, "waits")  # queue "batch": no worker here serves it
    fetched = backend.get_result(result.id)
    assert fetched.status == TaskResultStatus.READY
    assert (fetched.started_at, fetched.finished_at) == (None, None)
    assert (fetched.worker_ids, fetched.errors) == ([], [])
    assert fetched.task.queue_name == "batch"

    assert backend.app.handle(result.id).cancel()  # tether's own API, on a Django task
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.finished_at is not None
    [error] = result.errors
    assert error.exception_class is TaskCancelled and "TASK_CANCELLED" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value
    assert runs(tok) == []


def test_a_raised_exception_comes_back_with_its_class_and_traceback(
    worker: WorkerProcess, backend: Any
) -> None:
    from django.tasks import TaskResultStatus

    from tests.django_project.shop import tasks
    from tests.django_project.shop.errors import PaymentDeclined

    tok = token()
    result = finished(tasks.decline.enqueue(tok, "card expired"))
    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors
    assert error.exception_class_path == "tests.django_project.shop.errors.PaymentDeclined"
    assert error.exception_class is PaymentDeclined
    assert error.traceback.startswith("Traceback (most recent call last)")
    assert "raise PaymentDeclined(reason)" in error.traceback
    assert "PaymentDeclined: card expired" in error.traceback
    assert result.worker_ids == [worker.worker_id] and len(runs(tok)) == 1  # no retry policy: once
    row = task_row(result.id)
    assert row is not None and (row["status"], row["error_code"]) == ("FAILED", "UNHANDLED_EXCEPTION")


def test_a_return_value_django_cannot_store_fails_the_task(worker: WorkerProcess, backend: Any) -> None:
    from tests.django_project.shop import tasks

    result = finished(tasks.unstorable.enqueue())
    assert str(result.status) == "FAILED"
    [error] = result.errors
    assert error.exception_class is TypeError and "Unsupported type" in error.traceback


def test_task_context(worker: WorkerProcess, backend: Any) -> None:
    from tests.django_project.shop import tasks

    tok = token()
    result = finished(tasks.introspect.enqueue(tok))
    assert result.return_value == {
        "attempt": 1,
        "id": result.id,
        "status": "RUNNING",
        "worker_ids": [worker.worker_id],
        "args": [tok],
    }
    assert [run.attempt for run in runs(tok)] == [1]


def test_an_async_task(worker: WorkerProcess, backend: Any) -> None:
    from tests.django_project.shop import tasks

    assert finished(tasks.async_add.enqueue(2, b=40)).return_value == 42


async def test_async_api(worker: WorkerProcess, backend: Any) -> None:
    from asgiref.sync import sync_to_async

    from tests.django_project.shop import tasks

    result = await tasks.add.aenqueue(20, 22)
    await sync_to_async(finished)(result)
    fetched = await tasks.add.aget_result(result.id)
    assert fetched.return_value == 42
    other = await backend.aget_result(result.id)
    await other.arefresh()
    assert str(other.status) == "SUCCESSFUL"


def test_results_that_do_not_exist_or_belong_to_another_task(worker: WorkerProcess, backend: Any) -> None:
    import uuid

    from django.tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch

    from tests.django_project.shop import tasks

    for missing in (str(uuid.uuid4()), "not-a-task-id", ""):
        with pytest.raises(TaskResultDoesNotExist):
            backend.get_result(missing)
    result = finished(tasks.add.enqueue(1, 1))
    with pytest.raises(TaskResultMismatch, match=r"tests\.django_project\.shop\.tasks\.add"):
        tasks.record.get_result(result.id)


def test_the_worker_sends_task_started_and_task_finished(worker: WorkerProcess, backend: Any) -> None:
    from tests.django_project.shop import tasks
    from tests.django_project.shop.models import SignalEvent

    ok = finished(tasks.record.enqueue(token()))
    failed = finished(tasks.decline.enqueue(token(), "no funds"))
    seen = {
        result.id: [
            (e.signal, e.status, e.attempts, e.worker_ids)
            for e in SignalEvent.objects.filter(result_id=result.id).order_by("id")
        ]
        for result in (ok, failed)
    }
    me = [worker.worker_id]
    assert seen[ok.id] == [("started", "RUNNING", 1, me), ("finished", "SUCCESSFUL", 1, me)]
    assert seen[failed.id] == [("started", "RUNNING", 1, me), ("finished", "FAILED", 1, me)]


def test_a_tether_workflow_of_django_tasks(worker: WorkerProcess, backend: Any) -> None:
    from tests.django_project.shop import tasks

    add = backend.tether_task(tasks.add)
    first = add.node(args=(1, 2), name="first")
    second = add.node(args=(10,), args_from={"b": first}, name="second")
    flow = backend.app.workflow("sums", [first, second]).start()
    assert flow.get(timeout=30).ok == 13
    step = backend.get_result(flow.task("second").id)
    assert str(step.status) == "SUCCESSFUL" and step.return_value == 13
    assert (step.args, step.kwargs) == ([10], {"b": 3})  # b fed from the first step's result


def test_without_use_tz_times_are_naive_in_the_default_time_zone(django_project: None, backend: Any) -> None:
    from datetime import UTC, timedelta

    from django.test import override_settings
    from django.utils import timezone

    from tests.django_project.shop import tasks

    with override_settings(USE_TZ=False):  # TIME_ZONE is UTC in the test project
        run_after = timezone.now() + timedelta(hours=1)
        assert timezone.is_naive(run_after)
        result = tasks.batch_item.using(run_after=run_after).enqueue(token(), "later")
        row = task_row(result.id)
        assert row is not None and row["run_at"] == run_after.replace(tzinfo=UTC)
        fetched = backend.get_result(result.id)
        assert timezone.is_naive(fetched.enqueued_at) and fetched.enqueued_at == row["sent_at"].replace(
            tzinfo=None
        )
    assert backend.app.handle(result.id).cancel()


def test_a_unique_send_of_a_django_task(django_project: None, backend: Any) -> None:
    from tests.django_project.shop import tasks

    key = f"invoice-{token()}"
    record = backend.tether_task(tasks.record).with_options(queue="batch", unique_key=key)
    first, again = record.send(token()), record.send(token())
    assert again.id == first.id and again.deduplicated and not first.deduplicated
    assert str(backend.get_result(str(first.id)).status) == "READY"
    assert first.cancel()
