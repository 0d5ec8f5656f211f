"""Receivers of Django's task signals: each one leaves a SignalEvent row."""

from __future__ import annotations

from typing import Any

from django.tasks.signals import task_finished, task_started


def _record(signal: str, task_result: Any) -> None:
    from tests.django_project.shop.models import SignalEvent

    SignalEvent.objects.create(
        result_id=task_result.id,
        signal=signal,
        status=str(task_result.status),
        attempts=task_result.attempts,
        worker_ids=list(task_result.worker_ids),
    )


def on_started(sender: Any, task_result: Any, **kwargs: Any) -> None:
    _record("started", task_result)


def on_finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
    _record("finished", task_result)


def connect() -> None:
    task_started.connect(on_started, dispatch_uid="shop-started")
    task_finished.connect(on_finished, dispatch_uid="shop-finished")
