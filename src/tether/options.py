"""Send options (queue, priority, good_until, durable, unique_key, unique_for), a task's time
limit and a send's delay or time: their types and every check on them, each error naming the option
and why.

Used by task.py (sending), app.py (registering a task) and the workflow code (nodes
carry the options of their task), and it imports none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from tether.errors import InvalidOptionError, TaskDefinitionError, UnknownQueueError
from tether.limits import check_concurrency_key
from tether.names import check_queue_name, check_storable_text

PRIORITY_MIN, PRIORITY_MAX = -100, 100
MAX_DELAY = timedelta(days=3650)
MAX_TIME_LIMIT = timedelta(days=30)
MAX_UNIQUE_FOR = timedelta(days=3650)
#: Characters in a unique key: with the task name (200) it stays far below the size of an
#: index entry PostgreSQL accepts (~2,700 bytes) even when every character takes 4 bytes.
MAX_UNIQUE_KEY_LENGTH = 500


@dataclass(frozen=True, slots=True)
class SendOptions:
    queue: str
    priority: int
    good_until: datetime | None
    durable: bool | None = None  # None: the app's PostgresConfig.durable_sends
    # Unique sends (docs/tasks.md#unique-sends): the key, and the window that also counts
    # tasks that have ended (None: only tasks not yet terminal hold the key).
    unique_key: str | None = None
    unique_for: timedelta | None = None
    # Flow control (docs/limits.md): the key the task's slots are counted under.
    concurrency_key: str | None = None


def check_send_options(options: SendOptions, declared_queues: Sequence[str]) -> SendOptions:
    """Every send option at once (the app gives its declared queues)."""
    check_queue(options.queue, declared_queues)
    check_priority(options.priority)
    if options.good_until is not None:
        check_good_until(options.good_until)
    if options.durable is not None and not isinstance(options.durable, bool):
        raise InvalidOptionError(f"durable must be True or False, got {options.durable!r}")
    if options.unique_key is not None:
        check_unique_key(options.unique_key)
    if options.concurrency_key is not None:
        check_concurrency_key(options.concurrency_key)
    if options.unique_for is not None:
        check_unique_for(options.unique_for)
        if options.unique_key is None:
            raise InvalidOptionError(
                "unique_for needs a unique_key: the window says how long a key stays taken "
                "after its task was sent (give with_options(unique_key=..., unique_for=...))"
            )
    return options


def check_unique_key(key: Any, what: str = "unique_key") -> str:
    """A unique key: a non-empty str of at most MAX_UNIQUE_KEY_LENGTH characters, storable as text."""
    if not isinstance(key, str):
        raise InvalidOptionError(f"{what} must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidOptionError(f"{what} must not be empty")
    if len(key) > MAX_UNIQUE_KEY_LENGTH:
        raise InvalidOptionError(
            f"{what} must be at most {MAX_UNIQUE_KEY_LENGTH} characters, got {len(key)}; "
            "hash a longer natural key (e.g. hashlib.sha256(...).hexdigest())"
        )
    return check_storable_text(key, what)


def check_unique_for(value: Any) -> timedelta:
    """The window of a unique send, from a timedelta or seconds: more than 0, at most 3650 days."""
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise InvalidOptionError(
            f"unique_for must be a timedelta or a number of seconds, got {type(value).__name__}"
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    # Compared as a number first: timedelta() itself fails on NaN, inf and huge values.
    if not 0 < seconds <= MAX_UNIQUE_FOR.total_seconds():
        raise InvalidOptionError(
            f"unique_for must be more than 0 and at most {MAX_UNIQUE_FOR.days} days, got {value!r}"
        )
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)


def check_good_until(value: Any) -> datetime:
    if not isinstance(value, datetime):
        raise InvalidOptionError(f"good_until must be a timezone-aware datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidOptionError(
            "good_until is a naive datetime; give it a timezone, "
            "e.g. datetime.now(timezone.utc) + timedelta(minutes=5)"
        )
    return value


def check_when(value: Any) -> tuple[timedelta, datetime | None]:
    """schedule()'s first argument: a delay (timedelta or seconds), or an aware datetime to run at.

    Returns (delay, run_at): a datetime gives run_at (the database runs the task from then on,
    at once if it has passed) and no delay.
    """
    if isinstance(value, datetime):
        return timedelta(0), check_run_at(value)
    return check_delay(value), None


def check_run_at(value: datetime) -> datetime:
    """A time to run at: aware, and not more than MAX_DELAY ahead (by this machine's clock, a
    sanity bound only; when the task is due is the database's to judge)."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidOptionError(
            "schedule() got a naive datetime to run at; give it a timezone, "
            "e.g. datetime.now(timezone.utc) + timedelta(hours=1)"
        )
    if value - datetime.now(value.tzinfo) > MAX_DELAY:
        raise InvalidOptionError(f"schedule() time must be at most {MAX_DELAY.days} days ahead, got {value}")
    return value


def check_delay(delay: Any) -> timedelta:
    if isinstance(delay, bool) or not isinstance(delay, timedelta | int | float):
        raise InvalidOptionError(
            "delay must be a timedelta, a number of seconds or an aware datetime to run at, "
            f"got {type(delay).__name__}"
        )
    if not isinstance(delay, timedelta) and not 0 <= delay <= MAX_DELAY.total_seconds():
        # Checked as a number first: timedelta() itself fails on NaN, inf and huge values.
        raise InvalidOptionError(
            f"delay must be between 0 and {MAX_DELAY.days} days ({MAX_DELAY.total_seconds():.0f} s), "
            f"got {delay!r}"
        )
    td = delay if isinstance(delay, timedelta) else timedelta(seconds=delay)
    if td < timedelta(0) or td > MAX_DELAY:
        raise InvalidOptionError(f"delay must be between 0 and {MAX_DELAY.days} days, got {td}")
    return td


def check_time_limit(task_name: str, value: Any) -> float | None:
    """A task's time limit in seconds (from seconds or a timedelta); the error names the task."""
    return _task_seconds(task_name, "time_limit", value, 0.0, MAX_TIME_LIMIT.total_seconds(), zero=False)


MAX_CANCEL_GRACE_S = 3_600.0


def check_cancel_grace(task_name: str, value: Any) -> float | None:
    """A task's cancel grace period in seconds (from seconds or a timedelta); None: the worker's."""
    return _task_seconds(task_name, "cancel_grace", value, 0.0, MAX_CANCEL_GRACE_S, zero=True)


def _task_seconds(
    task_name: str, option: str, value: Any, low: float, high: float, *, zero: bool
) -> float | None:
    """A task option in seconds, given as a number or a timedelta, within [low, high] (low
    itself allowed only if ``zero``); None stays None."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not low <= seconds <= high
        or (not zero and seconds == low)
    ):
        lowest = f"from {low:g}" if zero else f"more than {low:g}"
        highest = f"{high / 86_400:g} days" if high >= 86_400 else f"{high:g} seconds"
        raise TaskDefinitionError(
            f"task {task_name!r}: {option} must be a number of seconds or a timedelta, "
            f"{lowest} and at most {highest}, got {value!r}"
        )
    return float(seconds)


def check_priority(priority: Any) -> int:
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_MIN <= priority <= PRIORITY_MAX
    ):
        raise InvalidOptionError(
            f"priority must be an int from {PRIORITY_MIN} to {PRIORITY_MAX} (higher runs first), "
            f"got {priority!r}"
        )
    return priority


def check_queue(queue: Any, declared: Sequence[str]) -> str:
    """A queue name (tether.names' rule) that the app declares."""
    check_queue_name(queue)
    if queue not in declared:
        raise UnknownQueueError(
            f"queue {queue!r} is not declared; declared queues: {', '.join(declared)}. "
            "Add it to AppConfig(queues=[...])"
        )
    return str(queue)
