"""TaskSet (worker/task_set.py): short tasks held while they run, and only then."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tether.worker.task_set import TaskSet


async def test_a_task_is_held_while_it_runs_and_let_go_when_done() -> None:
    tasks = TaskSet("testing")
    gate = asyncio.Event()

    async def work() -> None:
        await gate.wait()

    for _ in range(100):
        tasks.start(work())
    assert len(tasks) == 100
    gate.set()
    await tasks.wait()
    assert len(tasks) == 0


async def test_wait_also_waits_for_tasks_started_meanwhile() -> None:
    tasks = TaskSet("testing")
    done: list[str] = []

    async def second() -> None:
        await asyncio.sleep(0)
        done.append("second")

    async def first() -> None:
        tasks.start(second())  # started while wait() waits for this one
        done.append("first")

    tasks.start(first())
    await tasks.wait()
    assert done == ["first", "second"] and len(tasks) == 0


async def test_a_failure_is_logged_when_the_task_ends(caplog: pytest.LogCaptureFixture) -> None:
    tasks = TaskSet("giving back tasks")

    async def fails() -> None:
        raise RuntimeError("database gone")

    with caplog.at_level(logging.ERROR, logger="tether.worker.task_set"):
        tasks.start(fails())
        await tasks.wait()
    assert [r.getMessage() for r in caplog.records] == [
        "giving back tasks failed: RuntimeError: database gone"
    ]
    assert len(tasks) == 0
