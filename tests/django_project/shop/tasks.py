"""The test project's Django tasks. Each one that runs leaves a Run row with its token."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from django.tasks import task

from tests.django_project.shop.errors import PaymentDeclined
from tests.django_project.shop.models import Order, Run


def ran(token: str, name: str, attempt: int = 0) -> None:
    Run.objects.create(token=token, task=name, attempt=attempt, pid=os.getpid())


@task
def record(token: str) -> str:
    ran(token, "record")
    return token


@task
def add(a: int, b: int) -> int:
    return a + b


@task
def process_order(number: int, token: str) -> str:
    """Needs the order committed: it must not run before the enqueuing transaction commits."""
    order = Order.objects.get(number=number)
    order.state = "processed"
    order.save(update_fields=["state"])
    ran(token, "process_order")
    return order.state


@task
def decline(token: str, reason: str) -> None:
    ran(token, "decline")
    raise PaymentDeclined(reason)


@task
def unstorable() -> Any:
    return {"when": object()}  # not JSON: fails as on Django's own backends


@task(takes_context=True)
def introspect(context: Any, token: str) -> dict[str, Any]:
    ran(token, "introspect", context.attempt)
    result = context.task_result
    return {
        "attempt": context.attempt,
        "id": result.id,
        "status": str(result.status),
        "worker_ids": list(result.worker_ids),
        "args": list(result.args),
    }


@task
async def async_add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


@task(queue_name="emails")
def send_email(token: str) -> str:
    ran(token, "send_email")
    return token


@task(queue_name="batch")
def batch_item(token: str, label: str) -> str:
    ran(token, label)
    return label


@task(takes_context=True)
def crash_once(context: Any, token: str) -> str:
    """Blocks on its first attempt (a test kills its worker then); returns on the next."""
    ran(token, "crash_once", context.attempt)
    if context.attempt == 1:
        time.sleep(300)
    return f"attempt {context.attempt}"


@task
def hang(token: str) -> None:
    """Blocks until killed; it has no retry policy, so a crash is final."""
    ran(token, "hang")
    time.sleep(300)


@task
def gated(key: int, token: str) -> str:
    """Runs until the test releases advisory lock ``key`` (which it holds before enqueueing)."""
    from django.db import connection

    ran(token, "gated")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [key])
        cursor.execute("SELECT pg_advisory_unlock(%s)", [key])
    return "through"
