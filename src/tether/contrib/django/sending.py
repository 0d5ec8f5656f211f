"""Writing a Django task's row: when and through which connection.

(The transaction handling arrives with tether core's ``with_options(connection=...)``;
until then the row is written and committed on tether's own pool.)
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.utils import timezone

from tether.handle import TaskHandle
from tether.task import BoundTask


def delay_until(run_after: datetime | None) -> timedelta:
    """How long from now until ``run_after`` (Django's Task.run_after), never negative."""
    if run_after is None:
        return timedelta(0)
    if timezone.is_naive(run_after):
        # Only with USE_TZ = False (validate_task refuses naive values otherwise): Django
        # reads naive datetimes in the default time zone (settings.TIME_ZONE).
        run_after = timezone.make_aware(run_after, timezone.get_default_timezone())
    return max(run_after - datetime.now(UTC), timedelta(0))


def send(
    bound: BoundTask, run_after: datetime | None, args: list[Any], kwargs: dict[str, Any], database: str
) -> TaskHandle[Any]:
    """Write the task's row (to run at ``run_after`` at the earliest); its handle."""
    del database  # used once sends join Django's transaction
    return bound.schedule(delay_until(run_after), *args, **kwargs)
