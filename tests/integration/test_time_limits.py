"""Task time limits: a task still running after its time_limit is killed, recorded and maybe retried.

Real workers, real children killed by the worker: the rows, the attempts, the timing (database
time) and the worker carrying on with a fresh child are what a user relies on.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import attempt_rows, runs, task_row
from tests.conftest import WorkerFactory, WorkerProcess
from tether import ErrorCode, TaskError, TaskResult, Tether
from tether.errors import TaskDefinitionError

APP = "tests.apps.basic:app"
WAIT = 30.0
LIMIT = timedelta(seconds=0.5)


@pytest.fixture
def worker(workers: WorkerFactory) -> Iterator[WorkerProcess]:
    yield workers.start(APP, "--queues", "default", "--processes", "1")


@pytest.mark.timing
def test_a_task_past_its_time_limit_fails_and_the_worker_carries_on(
    basic: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    token = uuid.uuid4().hex
    handle = basic.limited.send(3600, token)
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TIME_LIMIT_EXCEEDED
    assert "'limited'" in err.message and "0.5s" in err.message
    assert err.data == {"time_limit_s": 0.5}

    row = task_row(db, handle.id)
    assert (row["status"], row["error_code"], row["retry_count"]) == ("FAILED", "TIME_LIMIT_EXCEEDED", 0)
    ran_for = row["failed_at"] - row["started_at"]
    assert LIMIT <= ran_for < LIMIT + timedelta(seconds=2), ran_for
    [attempt] = attempt_rows(db, handle.id)
    assert (attempt["outcome"], attempt["error_code"], attempt["will_retry"]) == (
        "FAILED",
        "TIME_LIMIT_EXCEEDED",
        False,
    )
    assert runs(db, token) == 1
    # The only child was killed; its replacement runs the next task, within the limit.
    assert basic.limited.send(0.01).get(timeout=WAIT).ok == 0.01
    assert "exceeded its time limit of 0.5s: killing sync child 0" in worker.log()


@pytest.mark.smoke
def test_a_limit_never_reaches_the_next_task_of_the_same_child(
    basic: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    """A quick limited task arms a timer; the long unlimited task after it on the same child must live."""
    quick = basic.limited.send(0.01)
    slow = basic.sleep.send(1.5)  # no limit; outlives the quick task's 0.5 s by far
    assert quick.get(timeout=WAIT).ok == 0.01
    assert slow.get(timeout=WAIT).ok == 1.5
    assert task_row(db, slow.id)["attempt"] == 1
    # Several limited tasks back to back on one child, each well within its own limit.
    handles = [basic.limited.send(0.3) for _ in range(4)]
    assert [h.get(timeout=WAIT).ok for h in handles] == [0.3] * 4


def test_time_limit_exceeded_is_retried_when_the_policy_lists_it(
    basic: ModuleType, db: psycopg.Connection[Any], worker: WorkerProcess
) -> None:
    token = uuid.uuid4().hex
    handle = basic.limited_retry.send(token)
    err = handle.get(timeout=WAIT).err
    assert err is not None and err.code == ErrorCode.TIME_LIMIT_EXCEEDED
    row = task_row(db, handle.id)
    assert (row["status"], row["retry_count"], row["attempt"]) == ("FAILED", 1, 2)
    attempts = attempt_rows(db, handle.id)
    assert [(a["attempt"], a["error_code"], a["will_retry"]) for a in attempts] == [
        (1, "TIME_LIMIT_EXCEEDED", True),
        (2, "TIME_LIMIT_EXCEEDED", False),
    ]
    assert runs(db, token) == 2


@pytest.mark.parametrize(
    "bad", [0, -1, 0.0, float("nan"), float("inf"), timedelta(0), timedelta(days=31), "5", True]
)
def test_a_bad_time_limit_is_refused_at_decoration(bad: Any) -> None:
    app = Tether()
    with pytest.raises(TaskDefinitionError, match="time_limit") as info:

        @app.task("limited", time_limit=bad)
        def limited() -> TaskResult[None, TaskError]:
            return TaskResult(ok=None)

    assert "'limited'" in str(info.value) and repr(bad) in str(info.value)
    assert "limited" not in app.tasks


@pytest.mark.parametrize(("given", "seconds"), [(2, 2.0), (0.25, 0.25), (timedelta(minutes=5), 300.0)])
def test_a_time_limit_in_seconds_or_as_a_timedelta(given: Any, seconds: float) -> None:
    app = Tether()

    @app.task("limited", time_limit=given)
    def limited() -> TaskResult[None, TaskError]:
        return TaskResult(ok=None)

    assert limited.time_limit == seconds
    assert app.task("unlimited")(lambda: TaskResult(ok=None)).time_limit is None
