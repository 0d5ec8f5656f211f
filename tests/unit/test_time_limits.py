"""Per-task time limits without a database: the timer kills the child running the task it was
armed for, and never a later task of the same child. The children are real processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Iterator

import pytest

from tether.broker.claims import TaskPayload
from tether.result import ErrorCode
from tether.worker.supervisor import ChildSlot
from tether.worker.time_limits import TimeLimits

LIMIT_S = 0.05
# Long enough for a timer of LIMIT_S to have fired, on a loaded machine too.
PAST_THE_LIMIT_S = 0.5


def task(task_id: str, name: str = "limited", attempt: int = 1) -> TaskPayload:
    return TaskPayload(task_id, name, "default", "[]", "{}", attempt, 0, 0, None)


@pytest.fixture
def slot() -> Iterator[ChildSlot]:
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    process = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    process.start()
    try:
        yield ChildSlot(0, "sync", process, parent_end)
    finally:
        if process.is_alive():
            process.kill()
        process.join(5)
        parent_end.close()
        child_end.close()


async def died(slot: ChildSlot, timeout: float = 5.0) -> bool:
    await asyncio.get_running_loop().run_in_executor(None, slot.process.join, timeout)
    return not slot.process.is_alive()


async def test_a_task_past_its_limit_has_its_child_killed_and_says_why(slot: ChildSlot) -> None:
    running = task("a")
    limits = TimeLimits(lambda name: (LIMIT_S, False), lambda index: [running], 0.0)
    limits.started(slot, running)
    assert await died(slot)
    error = slot.killed_for["a"]
    assert error.code == ErrorCode.TIME_LIMIT_EXCEEDED
    assert error.data == {"time_limit_s": LIMIT_S}
    assert "'limited'" in error.message and "0.05s" in error.message


async def test_a_task_that_finishes_in_time_is_left_alone(slot: ChildSlot) -> None:
    running = task("a")
    limits = TimeLimits(lambda name: (LIMIT_S, False), lambda index: [running], 0.0)
    limits.started(slot, running)
    limits.finished(slot)
    await asyncio.sleep(PAST_THE_LIMIT_S)  # nothing to await: the point is that nothing happens
    assert slot.process.is_alive() and not slot.killed_for


async def test_a_timer_never_reaches_the_next_task_of_the_same_child(slot: ChildSlot) -> None:
    first, second = task("a"), task("b")
    now_running = first
    limits = TimeLimits(
        lambda name: (LIMIT_S, False) if name == "limited" else None, lambda index: [now_running], 0.0
    )
    limits.started(slot, first)
    now_running = second  # the child moved on without the main process hearing of the end
    await asyncio.sleep(PAST_THE_LIMIT_S)
    assert slot.process.is_alive() and not slot.killed_for


async def test_a_new_attempt_of_the_same_task_is_not_killed_by_the_old_timer(slot: ChildSlot) -> None:
    now_running = task("a", attempt=1)
    limits = TimeLimits(lambda name: (LIMIT_S, False), lambda index: [now_running], 0.0)
    limits.started(slot, now_running)
    now_running = task("a", attempt=2)
    await asyncio.sleep(PAST_THE_LIMIT_S)
    assert slot.process.is_alive() and not slot.killed_for


async def test_a_task_without_a_limit_arms_nothing_and_starting_again_rearms(slot: ChildSlot) -> None:
    unlimited, limited = task("a", name="free"), task("b")
    now_running = unlimited
    limits = TimeLimits(
        lambda name: (LIMIT_S, False) if name == "limited" else None, lambda index: [now_running], 0.0
    )
    limits.started(slot, unlimited)
    await asyncio.sleep(PAST_THE_LIMIT_S)
    assert slot.process.is_alive()
    now_running = limited
    limits.started(slot, limited)  # the same child's next task: its own limit applies
    assert await died(slot)
    assert slot.killed_for["b"].code == ErrorCode.TIME_LIMIT_EXCEEDED


async def test_an_async_task_in_an_async_child_gets_the_cancel_grace_before_the_kill(slot: ChildSlot) -> None:
    slot.kind = "async"  # its child cancels the task at the limit; the kill waits out the grace
    running = task("a")
    grace = 0.6
    limits = TimeLimits(lambda name: (LIMIT_S, True), lambda index: [running], grace)
    started = time.monotonic()
    limits.started(slot, running)
    assert await died(slot)
    assert time.monotonic() - started >= LIMIT_S + grace
    error = slot.killed_for["a"]
    assert error.code == ErrorCode.TIME_LIMIT_EXCEEDED
    assert "did not end within 0.6s of being cancelled" in error.message
    assert slot.crash_reason is not None and "task a (limited) overran its time limit" in slot.crash_reason


async def test_an_async_childs_other_tasks_keep_their_own_timers(slot: ChildSlot) -> None:
    slot.kind = "async"
    first, second = task("a"), task("b")
    running = [first, second]
    limits = TimeLimits(lambda name: (LIMIT_S, True), lambda index: running, 0.0)
    limits.started(slot, first)
    limits.started(slot, second)  # an async child runs both: the second does not disarm the first
    limits.finished(slot, "b")
    assert await died(slot)
    assert set(slot.killed_for) == {"a"}
