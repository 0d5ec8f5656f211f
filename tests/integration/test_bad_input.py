"""Bad input is refused at the door, with the right exception, a message that names the
culprit, and nothing written to the database."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import ModuleType
from typing import Any
from uuid import uuid4

import psycopg
import pytest

from tests.apps.support import count_tasks, load_app_module, task_row
from tether import AppConfig, PostgresConfig, RetryFilter, TaskError, TaskResult, Tether
from tether.errors import (
    BadArgumentsError,
    DatabaseUnreachableError,
    InvalidOptionError,
    SerializationError,
    TaskDefinitionError,
    UnknownQueueError,
)


@pytest.fixture
def basic(database_url: str) -> ModuleType:
    return load_app_module("basic", database_url)


@pytest.fixture
def refused(db: psycopg.Connection[Any]) -> Iterator[Callable[..., str]]:
    """refused(exc_type, fn, *args, **kwargs): fn raises exc_type; returns its message."""

    def check(exc_type: type[Exception], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
        with pytest.raises(exc_type) as info:
            fn(*args, **kwargs)
        assert type(info.value) is exc_type, f"{type(info.value).__name__}: {info.value}"
        return str(info.value)

    yield check
    assert count_tasks(db) == 0, "a refused send wrote something"


def test_arguments_that_do_not_bind(basic: ModuleType, refused: Callable[..., str]) -> None:
    message = refused(BadArgumentsError, basic.add.send, 1)
    assert "'add'" in message and "missing a required argument: 'b'" in message
    message = refused(BadArgumentsError, basic.add.send, 1, 2, 3)
    assert "'add'" in message and "too many positional arguments" in message
    message = refused(BadArgumentsError, basic.add.send, 1, 2, c=3)
    assert "unexpected keyword argument 'c'" in message
    message = refused(BadArgumentsError, basic.add.send, 1, a=2)
    assert "multiple values for argument 'a'" in message
    # The signature is in the message, so the caller sees what was expected.
    assert "(signature: add(a:" in message and "b:" in message
    refused(BadArgumentsError, basic.add.schedule, 5, 1)
    refused(BadArgumentsError, basic.add.with_options(priority=5).send, b=1)


def test_values_that_cannot_be_serialised(basic: ModuleType, refused: Callable[..., str]) -> None:
    message = refused(SerializationError, basic.add.send, 1, object())
    assert "argument 'b' of task 'add'" in message and "object is not supported" in message
    message = refused(SerializationError, basic.add.send, 1, b=lambda: 0)
    assert "argument 'b'" in message and "never sends code" in message
    message = refused(SerializationError, basic.record.send, {"nested": [1, {2, 3}, object()]})
    assert "argument 'token'" in message and "['nested'][2]" in message
    message = refused(SerializationError, basic.add.send, float("nan"), 1)
    assert "argument 'a'" in message and "NaN" in message
    message = refused(SerializationError, basic.add.send, {1: "x"}, 1)
    assert "argument 'a'" in message and "dict key 1" in message
    # Strings PostgreSQL cannot store must be refused here, not by the database.
    message = refused(SerializationError, basic.record.send, "a\x00b")
    assert "argument 'token'" in message and "NUL" in message
    message = refused(SerializationError, basic.record.send, "\ud800")
    assert "argument 'token'" in message and "surrogate" in message


def test_naive_datetimes(basic: ModuleType, refused: Callable[..., str]) -> None:
    point = basic.Point(1, 2)
    order = basic.Order(id=uuid4(), total=Decimal("1.5"), placed_at=datetime.now().astimezone())
    message = refused(SerializationError, basic.typed.send, point, order, datetime.now())
    assert "argument 'when'" in message and "naive datetime" in message
    naive_order = basic.Order(id=uuid4(), total=Decimal("1.5"), placed_at=datetime(2024, 1, 1))
    message = refused(SerializationError, basic.typed.send, point, naive_order, datetime.now().astimezone())
    assert "argument 'order'" in message and "naive datetime" in message

    in_an_hour = datetime.now() + timedelta(hours=1)
    message = refused(InvalidOptionError, basic.add.send, 1, 2, good_until=in_an_hour)
    assert "good_until" in message and "naive" in message
    message = refused(InvalidOptionError, basic.add.with_options, good_until=datetime(2030, 1, 1))
    assert "good_until" in message and "naive" in message
    message = refused(InvalidOptionError, basic.add.send, 1, 2, good_until="tomorrow")
    assert "good_until" in message and "str" in message
    message = refused(InvalidOptionError, basic.add.send_many, [(1, 2)], good_until=datetime(2030, 1, 1))
    assert "good_until" in message


def test_unknown_queue(basic: ModuleType, refused: Callable[..., str]) -> None:
    message = refused(UnknownQueueError, basic.add.with_options, queue="videos")
    assert "'videos'" in message and "default, images, low" in message
    app = Tether(AppConfig(queues=["default"]))
    message = refused(UnknownQueueError, app.task("in_videos", queue="videos"), lambda: None)
    assert "'videos'" in message and "declared queues: default" in message
    assert "in_videos" not in app.tasks


@pytest.mark.parametrize("priority", [101, -101, True, 1.5, "5"])
def test_priority_out_of_range(basic: ModuleType, refused: Callable[..., str], priority: Any) -> None:
    message = refused(InvalidOptionError, basic.add.with_options, priority=priority)
    assert "priority" in message and repr(priority) in message and "-100 to 100" in message


@pytest.mark.parametrize("durable", ["no", 0, 1, 1.0])
def test_durable_must_be_a_bool(basic: ModuleType, refused: Callable[..., str], durable: Any) -> None:
    message = refused(InvalidOptionError, basic.add.with_options, durable=durable)
    assert "durable must be True or False" in message and repr(durable) in message


def test_priority_limits_are_accepted(basic: ModuleType, db: psycopg.Connection[Any]) -> None:
    low = basic.add.with_options(priority=-100, queue="low").send(1, 1)
    high = basic.add.with_options(priority=100, queue="low").send(1, 1)
    rows = db.execute("SELECT id, priority FROM tether_tasks").fetchall()
    assert {r["id"]: r["priority"] for r in rows} == {low.id: -100, high.id: 100}
    db.execute("DELETE FROM tether_tasks")


@pytest.mark.parametrize(
    "delay",
    [-1, -0.001, timedelta(seconds=-1), timedelta(days=3651), 1e20, float("inf"), float("nan"), "5", True],
)
def test_bad_delay(basic: ModuleType, refused: Callable[..., str], delay: Any) -> None:
    message = refused(InvalidOptionError, basic.add.schedule, delay, 1, 2)
    assert "delay" in message


def test_a_time_to_run_at_must_be_aware_and_within_3650_days(
    basic: ModuleType, refused: Callable[..., str]
) -> None:
    message = refused(InvalidOptionError, basic.add.schedule, datetime(2030, 1, 1), 1, 2)
    assert "naive datetime" in message
    far = datetime.now(UTC) + timedelta(days=3651)
    message = refused(InvalidOptionError, basic.add.schedule, far, 1, 2)
    assert "at most 3650 days ahead" in message


def test_send_many_with_one_bad_item_enqueues_nothing(basic: ModuleType, refused: Callable[..., str]) -> None:
    good = [(i, i) for i in range(50)]
    message = refused(BadArgumentsError, basic.add.send_many, [*good, (1,), *good])
    assert "send_many item 50" in message and "'b'" in message
    message = refused(SerializationError, basic.add.send_many, [*good, {"a": 1, "b": object()}])
    assert "send_many item 50" in message and "argument 'b'" in message
    message = refused(BadArgumentsError, basic.add.send_many, [*good, "12"])
    assert "item 50" in message and "str" in message
    message = refused(BadArgumentsError, basic.add.send_many, good, c=1)
    assert "item 0" in message and "'c'" in message


def test_send_many_async_with_a_bad_item_enqueues_nothing(
    basic: ModuleType, refused: Callable[..., str]
) -> None:
    def run() -> Any:
        return asyncio.run(basic.add.send_many_async([(1, 2), (3, "x", 5)]))

    message = refused(BadArgumentsError, run)
    assert "send_many item 1" in message


def test_task_definitions_refused_at_decoration(database_url: str) -> None:
    app = Tether(AppConfig(broker=PostgresConfig(database_url=database_url)))

    with pytest.raises(TaskDefinitionError, match="'good_until' is reserved"):

        @app.task("with_deadline")
        def with_deadline(good_until: datetime) -> None: ...

    assert "with_deadline" not in app.tasks

    @app.task("unique")
    def first() -> None: ...

    with pytest.raises(TaskDefinitionError, match="'unique' is already registered"):

        @app.task("unique")
        def second() -> None: ...

    assert app.tasks["unique"] is first  # the first registration stands

    for bad in ["", "9lives", "has space", "semi;colon", "x" * 201, "ünïcode", "ends_in_newline\n"]:
        with pytest.raises(TaskDefinitionError, match=r"^task name must be a task name: 1 to 200 characters"):
            app.task(bad)
        assert bad not in app.tasks
    with pytest.raises(TaskDefinitionError, match=r"^task name must be a task name: .*; got 42 \(int\)$"):
        app.task(42)  # type: ignore[arg-type]
    app.task("x" * 200)(lambda: None)  # the longest name allowed

    with pytest.raises(TaskDefinitionError, match="retry_policy must be a RetryPolicy"):
        app.task("bad_policy", retry_policy={"max_retries": 3})  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="priority"):
        app.task("too_important", priority=1000)(lambda: None)
    assert "too_important" not in app.tasks


def test_unreachable_database_names_the_masked_url() -> None:
    app = Tether(
        AppConfig(
            broker=PostgresConfig(
                database_url="postgresql://bob:secret@127.0.0.1:1/nope", connect_timeout_s=1
            )
        )
    )

    @app.task("ping")
    def ping() -> TaskResult[None, TaskError]:
        return TaskResult(ok=None)

    try:
        for attempt in (lambda: ping.send(), lambda: app.handle(uuid4()).status()):
            with pytest.raises(DatabaseUnreachableError) as info:
                attempt()
            message = str(info.value)
            assert "127.0.0.1:1" in message and "***" in message and "bob" in message
            assert "secret" not in message
            assert "secret" not in repr(info.value)
    finally:
        app.close()


# -- names: who asks (by), queues, tasks: one rule each, everywhere (tether.names) ---------------

BAD_BY: list[Any] = [
    42,
    b"ops",
    "",
    "   ",
    "x" * 201,
    "ops\nINFO forged log line",
    "ops\r",
    "a\tb",
    "nul\x00",
    "\x1b[31mred",
    "line\u2028separator",
    "right-to-left\u202eoverride",
]


@pytest.mark.parametrize("by", BAD_BY, ids=repr)
def test_a_bad_by_is_refused_and_changes_nothing(
    basic: ModuleType, db: psycopg.Connection[Any], by: Any
) -> None:
    pending = basic.add.send(1, 2)
    failed = basic.fail.send("BOOM")
    db.execute("UPDATE tether_tasks SET status = 'FAILED', failed_at = now() WHERE id = %s", (failed.id,))
    before = {t: task_row(db, t) for t in (pending.id, failed.id)}
    calls: list[Callable[[], object]] = [
        lambda: pending.cancel(by=by),
        lambda: asyncio.run(pending.cancel_async(by=by)),
        lambda: failed.retry(by=by),
        lambda: basic.app.retry_tasks(RetryFilter(), by=by),
        lambda: basic.app.retry_tasks(RetryFilter(), by=by, dry_run=True),
        lambda: basic.app.pause_queue("low", by=by),
        lambda: basic.app.resume_queue("low", by=by),
    ]
    for call in calls:
        with pytest.raises(InvalidOptionError) as info:
            call()
        message = str(info.value)
        assert message.startswith("by must be who asks: 1 to 200 printable characters"), message
        assert "\n" not in message and "\x00" not in message  # the value is shown escaped
    assert {t: task_row(db, t) for t in before} == before
    assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}


def test_a_good_by_is_kept_as_given(basic: ModuleType, db: psycopg.Connection[Any]) -> None:
    longest = "Zoë ☃ " + "x" * 194
    handle = basic.add.send(1, 2)
    assert handle.cancel(by=longest)
    assert task_row(db, handle.id)["cancel_requested_by"] == longest
    assert basic.app.pause_queue("low", by="alice@ops-1")
    row = db.execute("SELECT paused_by FROM tether_paused_queues WHERE queue = 'low'").fetchone()
    assert row == {"paused_by": "alice@ops-1"}
    assert basic.app.resume_queue("low")  # None: not said


BAD_QUEUE_NAMES: list[Any] = ["", "has space", "images\n", "a/b", "x" * 65, "ünï", 5, None]


@pytest.mark.parametrize("queue", BAD_QUEUE_NAMES, ids=repr)
def test_a_malformed_queue_name_is_refused_everywhere(
    basic: ModuleType, db: psycopg.Connection[Any], queue: Any
) -> None:
    failed = basic.fail.send("BOOM")
    db.execute("UPDATE tether_tasks SET status = 'FAILED', failed_at = now() WHERE id = %s", (failed.id,))
    calls: list[tuple[str, Callable[[], object]]] = [
        ("queue", lambda: basic.app.pause_queue(queue)),
        ("queue", lambda: basic.app.resume_queue(queue)),
    ]
    if queue is not None:  # None is "the task's queue" to with_options, "any queue" to a filter
        calls += [
            ("filter.queue", lambda: basic.app.retry_tasks(RetryFilter(queue=queue))),
            ("queue", lambda: basic.add.with_options(queue=queue)),
            ("queue", lambda: basic.app.task(f"in_{uuid4().hex}", queue=queue)(lambda: None)),
        ]
    for what, call in calls:
        with pytest.raises(InvalidOptionError) as info:
            call()
        assert str(info.value).startswith(
            f"{what} must be a queue name: 1 to 64 characters from A-Z a-z 0-9 _ . : -; got "
        ), str(info.value)
    assert task_row(db, failed.id)["status"] == "FAILED"
    assert count_tasks(db) == 1
    assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}
    if isinstance(queue, str):  # the configuration takes the same rule
        with pytest.raises(ValueError, match="invalid queue name"):
            AppConfig(queues=["default", queue])


@pytest.mark.parametrize("name", ["", "9lives", "has space", "add\n", "x" * 201, "semi;colon", 7])
def test_a_malformed_task_name_is_refused_everywhere(
    basic: ModuleType, db: psycopg.Connection[Any], name: Any
) -> None:
    failed = basic.fail.send("BOOM")
    db.execute("UPDATE tether_tasks SET status = 'FAILED', failed_at = now() WHERE id = %s", (failed.id,))
    for call in (
        lambda: basic.app.retry_tasks(RetryFilter(name=name)),
        lambda: basic.app.retry_tasks(RetryFilter(name=name), dry_run=True),
    ):
        with pytest.raises(
            InvalidOptionError, match=r"^filter\.name must be a task name: 1 to 200 characters"
        ):
            call()
    with pytest.raises(TaskDefinitionError, match=r"^task name must be a task name: 1 to 200 characters"):
        basic.app.task(name)
    assert name not in basic.app.tasks
    assert task_row(db, failed.id)["status"] == "FAILED"
