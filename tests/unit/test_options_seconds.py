"""Task options given in seconds (time_limit, cancel_grace): ranges, types, and errors that
name the task and the option. No database: the app checks them at registration."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tether import AppConfig, Tether
from tether.errors import TaskDefinitionError


def task_fn() -> None:
    return None


@pytest.mark.parametrize(
    ("given", "kept"),
    [(None, None), (0, 0.0), (1.5, 1.5), (timedelta(minutes=2), 120.0), (3_600, 3_600.0)],
)
def test_cancel_grace_is_kept_in_seconds(given: object, kept: float | None) -> None:
    app = Tether(AppConfig())
    task = app.task("t", cancel_grace=given)(task_fn)  # type: ignore[arg-type]
    assert task.cancel_grace == kept


@pytest.mark.parametrize("given", [-1, 3_600.5, True, "5", timedelta(hours=2)])
def test_a_bad_cancel_grace_is_refused_naming_the_task_and_option(given: object) -> None:
    app = Tether(AppConfig())
    with pytest.raises(
        TaskDefinitionError, match=r"task 't': cancel_grace must be .* from 0 and at most 3600 seconds"
    ):
        app.task("t", cancel_grace=given)(task_fn)  # type: ignore[arg-type]
    assert "t" not in app.tasks


@pytest.mark.parametrize("given", [0, -1, False, timedelta(0)])
def test_a_time_limit_must_be_more_than_zero(given: object) -> None:
    app = Tether(AppConfig())
    with pytest.raises(TaskDefinitionError, match=r"task 't': time_limit must be .* more than 0"):
        app.task("t", time_limit=given)(task_fn)  # type: ignore[arg-type]
