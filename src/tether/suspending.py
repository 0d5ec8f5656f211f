"""Durable sleep and waits for events: ``current_task().sleep(...)`` and ``wait_for_event(...)``.

Both are steps of tether's own, counted in the attempt's StepBook like any step (the n-th
sleep of an attempt is occurrence n of ``tether.sleep``, the n-th wait occurrence n of
``tether.event``), so an attempt that resumes passes the sleeps and waits an earlier
attempt went through, as it passes completed steps:

- a sleep not yet stored ends the attempt: TaskSuspended unwinds the task's code, and the
  worker records the suspension (the step with the sleep's end, the task PENDING until
  then), fenced like an outcome. The attempt that resumes finds the step and goes on.
- a wait not yet stored first tries to take an event of its key (one fenced statement,
  under the key's lock): one sent earlier is delivered at once, without suspending. Else
  it ends the attempt the same way, waiting; a send delivers into its step and makes the
  task due at once; past its timeout, the attempt that resumes stores the timeout as its
  step and raises EventTimeoutError (and so does every later attempt at that wait).

docs/durable-steps.md says this to users.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from tether import codec
from tether.broker.suspensions import EVENT_STEP, SLEEP_STEP, Taken
from tether.errors import EventError, EventTimeoutError, StepError, StepLostError, TaskSuspended
from tether.steps import STEP_NAME_MAX_CHARS, STEP_RESULT_MAX_BYTES, StepBook, _in_event_loop

#: The longest sleep or wait timeout: 366 days (a longer one is surely a mistake of units).
MAX_DELAY_S = 366 * 86_400.0
#: The longest event key, in characters (as a step name).
EVENT_KEY_MAX_CHARS = STEP_NAME_MAX_CHARS
#: The largest event payload, in bytes of its JSON text: a step result's limit.
EVENT_PAYLOAD_MAX_BYTES = STEP_RESULT_MAX_BYTES


def seconds_of(value: Any, argument: str, *, what: str) -> float:
    """A delay given as seconds (int, float) or a timedelta, checked: 0..366 days."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise StepError(
            f"{what}: {argument} must be a number of seconds or a timedelta, got {type(value).__name__}"
        )
    if math.isnan(seconds) or seconds < 0 or seconds > MAX_DELAY_S:
        raise StepError(
            f"{what}: {argument} must be between 0 and {MAX_DELAY_S:g} seconds (366 days), got {value!r}"
        )
    return seconds


def check_key(key: Any, *, what: str) -> str:
    """An event key: a string of 1..200 printable characters."""
    if not isinstance(key, str) or not key or len(key) > EVENT_KEY_MAX_CHARS:
        shown = repr(key) if len(repr(key)) <= 60 else f"a {type(key).__name__}"
        raise EventError(
            f"{what}: key must be a non-empty string of at most {EVENT_KEY_MAX_CHARS} characters, got {shown}"
        )
    if not key.isprintable():
        raise EventError(f"{what}: key {key!r} contains control characters")
    return key


def encode_payload(payload: Any, *, what: str) -> str:
    """An event payload as JSON text (tether's codec), within EVENT_PAYLOAD_MAX_BYTES."""
    try:
        text = codec.dumps(payload, what=f"the payload of {what}")
    except ValueError as exc:  # SerializationError: name the argument
        raise EventError(f"{what}: payload is not JSON: {exc}") from None
    size = len(text.encode("utf-8"))
    if size > EVENT_PAYLOAD_MAX_BYTES:
        raise EventError(
            f"{what}: payload is {size} bytes of JSON, over the limit of {EVENT_PAYLOAD_MAX_BYTES} bytes"
        )
    return text


def _not_in_loop(call: str) -> None:
    """As step(): a sync call's database wait inside a running event loop would block every
    task of the loop."""
    if _in_event_loop():
        raise StepError(
            f"{call}() was called inside a running event loop; use `await current_task().{call}_async(...)`"
        )


def sleep(book: StepBook, seconds: float | timedelta) -> None:
    delay = seconds_of(seconds, "seconds", what="sleep")
    _not_in_loop("sleep")
    occurrence, stored = book.lookup(SLEEP_STEP)
    if stored is None:
        raise TaskSuspended(SLEEP_STEP, occurrence, delay, None)


async def sleep_async(book: StepBook, seconds: float | timedelta) -> None:
    delay = seconds_of(seconds, "seconds", what="sleep_async")
    occurrence, stored = await book.lookup_async(SLEEP_STEP)
    if stored is None:
        raise TaskSuspended(SLEEP_STEP, occurrence, delay, None)


def _timeout_of(timeout: float | timedelta | None, what: str) -> float | None:
    return None if timeout is None else seconds_of(timeout, "timeout", what=what)


def wait_for_event(book: StepBook, key: str, timeout: float | timedelta | None) -> Any:
    key = check_key(key, what="wait_for_event")
    delay = _timeout_of(timeout, "wait_for_event")
    _not_in_loop("wait_for_event")
    occurrence, stored = book.lookup(EVENT_STEP)
    if stored is None:
        stored = _taken(book, book.store.take_event(occurrence, key), occurrence, key, delay)
    return _answer(stored, key, delay)


async def wait_for_event_async(book: StepBook, key: str, timeout: float | timedelta | None) -> Any:
    key = check_key(key, what="wait_for_event_async")
    delay = _timeout_of(timeout, "wait_for_event_async")
    occurrence, stored = await book.lookup_async(EVENT_STEP)
    if stored is None:
        stored = _taken(book, await book.store.take_event_async(occurrence, key), occurrence, key, delay)
    return _answer(stored, key, delay)


def _taken(book: StepBook, taken: Taken, occurrence: int, key: str, delay: float | None) -> str:
    if not taken.held:
        raise StepLostError(
            f"{book.task_label}: wait_for_event({key!r}) could not be recorded: this attempt lost its "
            "task (it was recovered elsewhere); the attempt stops here"
        )
    if taken.stored is None:
        if taken.remaining_s is not None:  # an open wait, resumed before its timeout: wait the rest
            delay = taken.remaining_s
        raise TaskSuspended(EVENT_STEP, occurrence, delay, key)
    book.remember(EVENT_STEP, occurrence, taken.stored)
    return taken.stored


def _answer(stored: str, key: str, timeout_s: float | None) -> Any:
    found = codec.loads(stored)
    if found.get("timed_out"):
        raise EventTimeoutError(
            f"wait_for_event({found.get('key', key)!r}): no event came before the timeout"
            + (f" of {timeout_s:g}s" if timeout_s is not None else "")
            + f" (waited until {found.get('until')})",
            key=key,
            timeout_s=timeout_s,
        )
    return found.get("payload")
