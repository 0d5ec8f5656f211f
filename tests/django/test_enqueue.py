"""Enqueueing Django tasks: in Django's transaction (rollback, commit, savepoints, on_commit,
autocommit), the task_enqueued signal, queues, priorities, run_after, refused input."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest

from tests.conftest import WorkerFactory, WorkerProcess
from tests.django.conftest import finished, runs, task_row, tether_worker_command, token, wait_runs


class Rollback(Exception):
    pass


def order_number() -> int:
    return random.randrange(1, 2**31)


@pytest.fixture
def enqueued_signals(django_project: None) -> Iterator[list[str]]:
    """The result ids task_enqueued announced in this process while the test ran."""
    from django.tasks.signals import task_enqueued

    seen: list[str] = []

    def receiver(sender: Any, task_result: Any, **kwargs: Any) -> None:
        seen.append(task_result.id)

    task_enqueued.connect(receiver, weak=False)
    try:
        yield seen
    finally:
        task_enqueued.disconnect(receiver)


def test_rolled_back_transaction_leaves_no_task_and_nothing_runs(
    worker: WorkerProcess, backend: Any, enqueued_signals: list[str]
) -> None:
    from django.db import transaction
    from django.tasks.exceptions import TaskResultDoesNotExist

    from tests.django_project.shop import tasks
    from tests.django_project.shop.models import Order

    tok, number = token(), order_number()
    with pytest.raises(Rollback), transaction.atomic():
        Order.objects.create(number=number)
        result = tasks.process_order.enqueue(number, tok)
        assert task_row(result.id) is None  # another session cannot see it before the commit
        raise Rollback
    assert task_row(result.id) is None
    assert not Order.objects.filter(number=number).exists()
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result(result.id)
    assert result.id not in enqueued_signals  # announced at commit only
    # The worker is alive and serving the queue: a task committed after it runs, this one never did.
    assert finished(tasks.record.enqueue(tok)).return_value == tok
    assert [run.task for run in runs(tok)] == ["record"]


def test_committed_transaction_runs_the_task_once_with_its_data(
    worker: WorkerProcess, backend: Any, enqueued_signals: list[str]
) -> None:
    from django.db import connection, transaction

    from tests.django_project.shop import tasks
    from tests.django_project.shop.models import Order

    tok, number = token(), order_number()
    with transaction.atomic():
        Order.objects.create(number=number)
        result = tasks.process_order.enqueue(number, tok)
        assert task_row(result.id) is None  # invisible to workers until the commit
        assert result.id not in enqueued_signals
    assert enqueued_signals.count(result.id) == 1
    assert connection.get_autocommit() and not connection.in_atomic_block  # Django's state is its own
    result = finished(result)
    assert str(result.status) == "SUCCESSFUL", result.errors
    assert result.return_value == "processed"  # the worker read the order committed with the task
    assert Order.objects.get(number=number).state == "processed"
    assert len(runs(tok)) == 1
    row = task_row(result.id)
    assert row is not None and (row["status"], row["attempt"], row["retry_count"]) == ("COMPLETED", 1, 0)
    assert result.attempts == 1 and result.worker_ids == [worker.worker_id]


def test_a_rolled_back_savepoint_takes_its_task_with_it(worker: WorkerProcess, backend: Any) -> None:
    from django.db import transaction

    from tests.django_project.shop import tasks

    kept, dropped = token(), token()
    with transaction.atomic():
        first = tasks.record.enqueue(kept)
        with pytest.raises(Rollback), transaction.atomic():  # a savepoint
            second = tasks.record.enqueue(dropped)
            raise Rollback
    assert task_row(second.id) is None
    assert finished(first).return_value == kept
    assert len(runs(kept)) == 1 and runs(dropped) == []


def test_enqueue_outside_atomic_commits_at_once(
    worker: WorkerProcess, backend: Any, enqueued_signals: list[str]
) -> None:
    from django.db import connection

    from tests.django_project.shop import tasks

    tok = token()
    result = tasks.record.enqueue(tok)
    row = task_row(result.id)  # committed by the time enqueue returned
    assert row is not None and row["name"] == "tests.django_project.shop.tasks.record"
    assert (row["queue"], row["priority"]) == ("default", 0)
    assert enqueued_signals == [result.id]
    assert connection.get_autocommit() and not connection.in_atomic_block
    assert str(result.status) == "READY" and result.enqueued_at is not None
    assert finished(result).return_value == tok


def test_with_autocommit_off_the_task_joins_the_open_transaction(worker: WorkerProcess, backend: Any) -> None:
    from django.db import transaction

    from tests.django_project.shop import tasks

    dropped, kept = token(), token()
    transaction.set_autocommit(False)
    try:
        rolled_back = tasks.record.enqueue(dropped)
        transaction.rollback()
        committed = tasks.record.enqueue(kept)
        assert task_row(committed.id) is None  # not before the commit
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert task_row(rolled_back.id) is None
    assert finished(committed).return_value == kept and runs(dropped) == []


def test_django_on_commit_pattern_still_works(worker: WorkerProcess, backend: Any) -> None:
    """What Django's docs recommend for other backends: enqueue in on_commit."""
    from django.db import transaction

    from tests.django_project.shop import tasks
    from tests.django_project.shop.models import Order

    tok, number = token(), order_number()
    with transaction.atomic():
        Order.objects.create(number=number)
        transaction.on_commit(partial(tasks.process_order.enqueue, number, tok))
    # Enqueued after the commit (outside any block), so the worker finds the order.
    assert [run.task for run in wait_runs(tok)] == ["process_order"]
    assert Order.objects.get(number=number).state == "processed"  # saved before the Run row


def test_bad_calls_are_refused_before_anything_is_written(worker: WorkerProcess, backend: Any) -> None:
    from django.db import transaction
    from django.tasks.exceptions import InvalidTask

    from tests.django_project import outside
    from tests.django_project.shop import tasks
    from tests.django_project.shop.models import Order
    from tether.errors import BadArgumentsError

    number = order_number()
    with transaction.atomic():
        with pytest.raises(BadArgumentsError, match=r"add.*missing a required argument: 'b'"):
            tasks.add.enqueue(1)
        with pytest.raises(TypeError, match="Unsupported type"):  # Django's own JSON rule
            tasks.record.enqueue(object())
        with pytest.raises(InvalidTask, match="Queue 'nowhere' is not valid for backend 'default'"):
            tasks.record.using(queue_name="nowhere")
        with pytest.raises(InvalidTask, match="belongs to no installed app"):
            outside.outside_task.enqueue()
        # Nothing reached the database, so the transaction is still usable.
        Order.objects.create(number=number)
    assert Order.objects.filter(number=number).exists()


def test_queues_route_tasks_to_the_workers_that_serve_them(
    worker: WorkerProcess, workers: WorkerFactory, backend: Any
) -> None:
    from tests.django_project.shop import tasks

    tok = token()
    email = tasks.send_email.enqueue(tok)  # @task(queue_name="emails")
    moved = tasks.record.using(queue_name="emails").enqueue(tok)
    assert [task_row(r.id)["queue"] for r in (email, moved)] == ["emails", "emails"]  # type: ignore[index]
    # The shared worker serves only "default": both wait while it runs a default task.
    assert finished(tasks.add.enqueue(1, 2)).return_value == 3
    email.refresh()
    assert str(email.status) == "READY" and runs(tok) == []

    emails = workers.start("django", command=tether_worker_command("--processes", "1", "--queues", "emails"))
    assert finished(email).return_value == tok and finished(moved).return_value == tok
    assert email.worker_ids == [emails.worker_id] and moved.worker_ids == [emails.worker_id]
    assert sorted(run.task for run in runs(tok)) == ["record", "send_email"]


def test_higher_priority_runs_first(worker: WorkerProcess, workers: WorkerFactory, backend: Any) -> None:
    from tests.django_project.shop import tasks

    tok = token()
    sent = [
        tasks.batch_item.using(priority=priority).enqueue(tok, label)
        for label, priority in (("low", -10), ("high", 50), ("middle", 0), ("top", 100))
    ]
    assert [task_row(r.id)["priority"] for r in sent] == [-10, 50, 0, 100]  # type: ignore[index]
    # One process, nothing prefetched: it claims one task at a time, the best first.
    workers.start(
        "django", command=tether_worker_command("--processes", "1", "--prefetch", "0", "--queues", "batch")
    )
    for result in sent:
        finished(result)
    assert [run.task for run in runs(tok)] == ["top", "high", "middle", "low"]


def test_run_after_delays_the_task_until_then(worker: WorkerProcess, backend: Any) -> None:
    from django.utils import timezone

    from tests.django_project.shop import tasks

    tok = token()
    run_after = timezone.now() + timedelta(seconds=1.5)
    result = tasks.record.using(run_after=run_after).enqueue(tok)
    assert result.task.run_after == run_after
    row = task_row(result.id)
    assert row is not None and row["run_at"] == run_after  # the database runs it from then on
    result.refresh()
    assert str(result.status) == "READY" and runs(tok) == []
    result = finished(result)
    assert result.started_at >= run_after
    assert [run.at >= run_after for run in runs(tok)] == [True]
