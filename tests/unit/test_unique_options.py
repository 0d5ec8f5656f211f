"""Unique-send options refused at the door: each error names the argument, nothing is sent.

The app points at a port where no server listens: a check that let a bad value through to
the database would fail with a connection error instead of InvalidOptionError.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from tether import AppConfig, PostgresConfig, Tether
from tether.errors import InvalidOptionError
from tether.options import MAX_UNIQUE_KEY_LENGTH, SendOptions, check_send_options, check_unique_for


@pytest.fixture
def task() -> Any:
    app = Tether(AppConfig(broker=PostgresConfig(database_url="postgresql://nobody@127.0.0.1:1/nowhere")))

    @app.task("invoice")
    def invoice(number: int) -> int:
        return number

    return invoice


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (42, "unique_key must be a str, got int"),
        (b"bytes", "unique_key must be a str, got bytes"),
        ("", "unique_key must not be empty"),
        ("x" * (MAX_UNIQUE_KEY_LENGTH + 1), f"unique_key must be at most {MAX_UNIQUE_KEY_LENGTH} characters"),
        ("a\x00b", "unique_key must not contain a NUL character"),
        ("a\ud800", "unique_key must be valid Unicode text"),
    ],
)
def test_a_bad_unique_key_is_refused(task: Any, key: Any, message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        task.with_options(unique_key=key)


def test_the_longest_key_is_accepted(task: Any) -> None:
    bound = task.with_options(unique_key="k" * MAX_UNIQUE_KEY_LENGTH)
    assert bound.options.unique_key == "k" * MAX_UNIQUE_KEY_LENGTH


@pytest.mark.parametrize(
    ("window", "message"),
    [
        (-1, "unique_for must be more than 0"),
        (0, "unique_for must be more than 0"),
        (timedelta(seconds=-5), "unique_for must be more than 0"),
        (float("nan"), "unique_for must be more than 0"),
        (float("inf"), "unique_for must be more than 0"),
        (timedelta(days=3651), "at most 3650 days"),
        (True, "unique_for must be a timedelta or a number of seconds, got bool"),
        ("60", "unique_for must be a timedelta or a number of seconds, got str"),
    ],
)
def test_a_bad_window_is_refused(task: Any, window: Any, message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        task.with_options(unique_key="k", unique_for=window)


def test_a_window_needs_a_key(task: Any) -> None:
    with pytest.raises(InvalidOptionError, match="unique_for needs a unique_key"):
        task.with_options(unique_for=60)
    with pytest.raises(InvalidOptionError, match="unique_for needs a unique_key"):
        check_send_options(SendOptions("default", 0, None, unique_for=timedelta(seconds=1)), ["default"])


def test_seconds_and_timedeltas_are_the_same_window(task: Any) -> None:
    assert task.with_options(unique_key="k", unique_for=90).options.unique_for == timedelta(seconds=90)
    assert task.with_options(unique_key="k", unique_for=1.5).options.unique_for == timedelta(seconds=1.5)
    assert check_unique_for(timedelta(hours=1)) == timedelta(hours=1)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ("abc", "unique_keys must be a list of str, one per item, got str"),
        (["a"], "unique_keys must have one key per item: 2 item"),
        (["a", 7], r"unique_keys\[1\] must be a str, got int"),
        (["", "b"], r"unique_keys\[0\] must not be empty"),
    ],
)
def test_bad_unique_keys_of_send_many_are_refused(task: Any, keys: Any, message: str) -> None:
    with pytest.raises(InvalidOptionError, match=message):
        task.send_many([(1,), (2,)], unique_keys=keys)


def test_send_many_refuses_ambiguous_or_keyless_windows(task: Any) -> None:
    with pytest.raises(InvalidOptionError, match="unique_for without unique_keys"):
        task.send_many([(1,)], unique_for=10)
    with pytest.raises(InvalidOptionError, match="already has a unique_key"):
        task.with_options(unique_key="k").send_many([(1,)], unique_keys=["x"])
    with pytest.raises(InvalidOptionError, match="unique_for must be more than 0"):
        task.send_many([(1,)], unique_keys=["x"], unique_for=-1)


def test_the_task_itself_is_unchanged(task: Any) -> None:
    task.with_options(unique_key="k", unique_for=5)
    assert task.options.unique_key is None and task.options.unique_for is None
