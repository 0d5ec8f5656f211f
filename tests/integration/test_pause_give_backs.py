"""A worker paused and resumed many times keeps nothing of the pauses that are over.

Each pause gives back the claimed tasks of the queue that no child was handed yet, in an
asyncio task of the worker's main process. That task must be let go once it is done: a
worker runs for months, and an operator (or a deploy script) may pause a queue thousands
of times. The worker runs in this process here (its children are real processes, the
database real), so the test can look at what its main process keeps alive.
"""

from __future__ import annotations

import asyncio
import gc
import secrets
import uuid
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import ensure_ledger, load_app_module
from tether.config import WorkerConfig
from tether.worker.main import Worker

Conn = psycopg.Connection[Any]
PAUSES = 30
WAIT = 30.0


@pytest.fixture
def gates(database_url: str, db: Conn) -> ModuleType:
    ensure_ledger(db)
    return load_app_module("gates", database_url)


def finished_give_backs() -> list[asyncio.Task[Any]]:
    """Give-back tasks (Worker._release) that are done but still alive somewhere in this process."""
    gc.collect()
    return [
        task
        for task in gc.get_objects()
        # type(), not isinstance(): isinstance also asks an object's __class__, and a lazy
        # object (Django's staticfiles storage, loaded by another test of this process) then
        # runs its setup, which fails without settings.
        if issubclass(type(task), asyncio.Task)
        and task.done()
        and getattr(task.get_coro(), "__qualname__", "") == "Worker._release"
    ]


async def until(predicate: Any, what: str) -> None:
    """Poll the database (in a thread) until ``predicate()`` holds; the loop runs the worker meanwhile."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while not await asyncio.to_thread(predicate):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {WAIT}s waiting for {what}")
        await asyncio.sleep(0.02)


async def test_many_pauses_and_resumes_keep_no_finished_give_back(
    gates: ModuleType, database_url: str, db: Conn
) -> None:
    from tests.apps.gate_locks import hold_gate

    # One sync child, room for four more tasks: of those, two are pushed to the busy child
    # and two wait unhanded in the main process, which a pause gives back.
    worker = Worker(
        gates.app, "tests.apps.gates:app", WorkerConfig(processes=1, async_processes=0, prefetch=4)
    )
    running = asyncio.create_task(worker.run(install_signal_handlers=False))
    key = secrets.randbits(62)
    with hold_gate(database_url, key) as gate:
        try:
            busy = gates.gated.send(key, uuid.uuid4().hex)
            waiting = gates.record.send_many([(uuid.uuid4().hex,) for _ in range(4)])

            def statuses() -> list[str]:
                rows = db.execute(
                    "SELECT status FROM tether_tasks WHERE id = ANY(%s)", ([h.id for h in waiting],)
                ).fetchall()
                return sorted(r["status"] for r in rows)

            await until(lambda: busy.status().value == "RUNNING", "the gated task to run")
            await until(lambda: statuses() == ["CLAIMED"] * 4, "four tasks claimed behind it")
            for _ in range(PAUSES):
                assert await asyncio.to_thread(gates.app.pause_queue, "default")
                await until(lambda: statuses() == ["CLAIMED"] * 2 + ["PENDING"] * 2, "two given back")
                assert await asyncio.to_thread(gates.app.resume_queue, "default")
                await until(lambda: statuses() == ["CLAIMED"] * 4, "the two claimed again")

            # Every give-back is over: the worker keeps none of them, the set or anything else.
            await until(lambda: len(worker.give_backs) == 0, "the last give-back to end")
            assert finished_give_backs() == []
        finally:
            gate.open()
            worker.request_stop()
            await asyncio.wait_for(running, WAIT)
    # Stopped: what the child was handed ran, what waited unhanded went back.
    assert busy.status().value == "COMPLETED"
    assert statuses() == ["COMPLETED"] * 2 + ["PENDING"] * 2
    for handle in waiting:
        handle.cancel()
