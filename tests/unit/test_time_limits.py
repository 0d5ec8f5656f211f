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
        yield ChildSlot(0, process, parent_end)
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
    limits = TimeLimits(lambda name: LIMIT_S, lambda index: running)
    limits.started(slot, running)
    assert await died(slot)
    assert slot.killed_for is not None
    assert slot.killed_for.code == ErrorCode.TIME_LIMIT_EXCEEDED
    assert slot.killed_for.data == {"time_limit_s": LIMIT_S}
    assert "'limited'" in slot.killed_for.message and "0.05s" in slot.killed_for.message


async def test_a_task_that_finishes_in_time_is_left_alone(slot: ChildSlot) -> None:
    running = task("a")
    limits = TimeLimits(lambda name: LIMIT_S, lambda index: running)
    limits.started(slot, running)
    limits.finished(slot)
    await asyncio.sleep(PAST_THE_LIMIT_S)  # nothing to await: the point is that nothing happens
    assert slot.process.is_alive() and slot.killed_for is None


async def test_a_timer_never_reaches_the_next_task_of_the_same_child(slot: ChildSlot) -> None:
    first, second = task("a"), task("b")
    now_running = first
    limits = TimeLimits(lambda name: LIMIT_S if name == "limited" else None, lambda index: now_running)
    limits.started(slot, first)
    now_running = second  # the child moved on without the main process hearing of the end
    await asyncio.sleep(PAST_THE_LIMIT_S)
    assert slot.process.is_alive() and slot.killed_for is None


async def test_a_new_attempt_of_the_same_task_is_not_killed_by_the_old_timer(slot: ChildSlot) -> None:
    now_running = task("a", attempt=1)
    limits = TimeLimits(lambda name: LIMIT_S, lambda index: now_running)
    limits.started(slot, now_running)
    now_running = task("a", attempt=2)
    await asyncio.sleep(PAST_THE_LIMIT_S)
    assert slot.process.is_alive() and slot.killed_for is None


async def test_a_task_without_a_limit_arms_nothing_and_starting_again_rearms(slot: ChildSlot) -> None:
    unlimited, limited = task("a", name="free"), task("b")
    now_running = unlimited
    limits = TimeLimits(lambda name: LIMIT_S if name == "limited" else None, lambda index: now_running)
    limits.started(slot, unlimited)
    await asyncio.sleep(PAST_THE_LIMIT_S)
    assert slot.process.is_alive()
    now_running = limited
    limits.started(slot, limited)  # the same child's next task: its own limit applies
    assert await died(slot)
    assert slot.killed_for is not None and slot.killed_for.code == ErrorCode.TIME_LIMIT_EXCEEDED
