"""The runner of the worker's background services (worker/services.py) and its backoff, without a
database: services here are small scripted ones; tests/integration/test_services.py runs the
real ones against PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import psycopg
import pytest

from tether import Tether
from tether.config import WorkerConfig
from tether.worker.backoff import Backoff
from tether.worker.holdings import Holdings
from tether.worker.isolation import Isolation, IsolationWatch
from tether.worker.lanes import plan_lanes
from tether.worker.services import Service, Services, run_service
from tether.worker.supervisor import Supervisor

WAIT = 10.0
LONG = 3600.0  # a wait that a test never sits through: only a wake() or a failure ends it


class Scripted(Service):
    """Plays its script, one step per tick: a number is the wait it returns, an exception is raised."""

    name = "scripted"
    log = logging.getLogger("tests.scripted")

    def __init__(self, script: list[float | Exception], journal: list[str] | None = None) -> None:
        super().__init__(Backoff(0.001, 0.004))
        self.script = list(script)
        self.journal = journal if journal is not None else []
        self.ticks = 0
        self.ticked = asyncio.Event()  # set at each tick (cleared by the test)
        self.closes = 0

    async def tick(self) -> float:
        self.ticks += 1
        self.ticked.set()
        step = self.script.pop(0) if self.script else LONG
        if isinstance(step, Exception):
            raise step
        return step

    async def close(self) -> None:
        self.closes += 1
        self.journal.append(f"close {self.name}")


async def until(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), WAIT)


async def until_ticks(service: Scripted, n: int) -> None:
    while service.ticks < n:
        service.ticked.clear()
        await until(service.ticked)


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tests.scripted" and r.levelno == level]


def test_backoff_doubles_up_to_its_most_and_starts_over_after_a_success() -> None:
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next() == 0.5
    with pytest.raises(ValueError, match="first=2"):
        Backoff(2, 1)


async def test_an_outage_is_logged_once_then_its_end(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="tests.scripted")
    down = psycopg.OperationalError("the server is down")
    service = Scripted([down] * 5 + [LONG])
    runner = asyncio.create_task(run_service(service))
    try:
        await until_ticks(service, 6)
    finally:
        runner.cancel()
    errors = messages(caplog, logging.ERROR)
    assert len(errors) == 1 and errors[0].startswith("scripted failed (the server is down); next try in")
    assert len(messages(caplog, logging.DEBUG)) == 4
    ends = messages(caplog, logging.INFO)
    assert (
        len(ends) == 1 and ends[0].startswith("scripted works again after") and "(5 failed tries)" in ends[0]
    )
    assert service.closes == 5  # each failed round let its connection go: the next opens a new one


async def test_a_second_outage_is_logged_again(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tests.scripted")
    down = psycopg.OperationalError("down")
    service = Scripted([down, down, 0.0, down, LONG])
    runner = asyncio.create_task(run_service(service))
    try:
        await until_ticks(service, 5)
    finally:
        runner.cancel()
    assert len(messages(caplog, logging.ERROR)) == 2
    ends = messages(caplog, logging.INFO)
    assert len(ends) == 2 and "(2 failed tries)" in ends[0] and "(1 failed try)" in ends[1], ends


async def test_a_bug_is_logged_with_its_traceback_and_the_service_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    service = Scripted([KeyError("oops"), LONG])
    runner = asyncio.create_task(run_service(service))
    try:
        await until_ticks(service, 2)
    finally:
        runner.cancel()
    [record] = [r for r in caplog.records if r.name == "tests.scripted" and r.levelno == logging.ERROR]
    assert record.exc_info is not None and record.exc_info[0] is KeyError


async def test_wake_cuts_a_long_wait_short() -> None:
    service = Scripted([LONG, LONG])
    runner = asyncio.create_task(run_service(service))
    try:
        await until_ticks(service, 1)
        service.wake()
        await until_ticks(service, 2)
    finally:
        runner.cancel()


async def test_a_wake_during_a_round_means_one_more_round_at_once() -> None:
    """A schedule changed while the scheduler's round was reading: it must look again."""

    class WokenDuringRound(Scripted):
        async def tick(self) -> float:
            wait = await super().tick()
            if self.ticks == 1:
                self.wake()
            return wait

    service = WokenDuringRound([LONG, LONG])
    runner = asyncio.create_task(run_service(service))
    try:
        await until_ticks(service, 2)
    finally:
        runner.cancel()


async def test_services_start_in_order_and_close_in_reverse_each_after_its_loop_stopped() -> None:
    journal: list[str] = []
    trio = [Scripted([LONG], journal) for _ in range(3)]
    for name, service in zip("abc", trio, strict=True):
        service.name = name
    services = Services(trio)
    services.start()
    for service in trio:
        await until_ticks(service, 1)
    await services.close()
    assert journal == ["close c", "close b", "close a"]
    ticks = [s.ticks for s in trio]
    for service in trio:
        service.wake()
    await asyncio.sleep(0)
    assert [s.ticks for s in trio] == ticks  # stopped: a wake starts no round


async def test_close_waits_for_a_round_running_in_a_thread() -> None:
    """A psycopg connection must not be closed under the thread that is using it."""
    journal: list[str] = []
    entered, gate = threading.Event(), threading.Event()

    class Blocking(Scripted):
        def round(self) -> float:
            entered.set()
            gate.wait(WAIT)
            journal.append("round over")
            return LONG

        async def tick(self) -> float:
            return await self.in_thread(self.round)

    service = Blocking([], journal)
    services = Services([service])
    services.start()
    await asyncio.to_thread(entered.wait, WAIT)
    closing = asyncio.create_task(services.close())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not closing.done() and journal == []
    gate.set()
    await asyncio.wait_for(closing, WAIT)
    assert journal == ["round over", "close scripted"]


async def test_the_isolation_watch_isolates_a_worker_whose_heartbeats_stopped_getting_through() -> None:
    app = Tether()

    @app.task("noop")
    def noop() -> None:
        return None

    lanes = plan_lanes(WorkerConfig(processes=1, async_processes=0), app)
    supervisor = Supervisor(
        lanes=lanes,
        app_path="tests:app",
        url="postgresql://unused",
        worker_id="w",
        log_level=logging.INFO,
        on_message=lambda slot, msg: None,
        on_exit=lambda slot, code: None,
    )
    rejoined: list[bool] = []
    isolation = Isolation("w", Holdings(), supervisor, 2.0, on_rejoin=lambda: rejoined.append(True))
    last_ok = time.monotonic()
    watch = IsolationWatch(isolation, lambda: last_ok, every=1.0)
    assert await watch.tick() == 0.1 and not isolation.isolated
    last_ok = time.monotonic() - 1.8  # within a quarter interval (0.25 s) of the 2 s threshold
    assert await watch.tick() == 0.1
    assert isolation.isolated
    isolation.rejoin(set())
    assert not isolation.isolated and rejoined == [True]
    # A threshold just above one interval (session_closed_threshold_ms): the margin shrinks to
    # half of what it leaves past the interval, so a beat on time never isolates the worker.
    assert (
        IsolationWatch(
            Isolation("w", Holdings(), supervisor, 1.25, lambda: None), lambda: 0.0, 1.0
        ).isolate_after
        == 1.125
    )
    assert (
        IsolationWatch(
            Isolation("w", Holdings(), supervisor, 1.5, lambda: None), lambda: 0.0, 1.0
        ).isolate_after
        == 1.25
    )


async def test_a_service_s_first_round_waits_for_its_event() -> None:
    """The reaper and the scheduler leave the maintenance connection to startup
    reconciliation: their first round waits for the event the start-up sets after it."""
    reconciled = asyncio.Event()
    gated, free = Scripted([0.0, LONG]), Scripted([LONG])
    gated.first_round_after = reconciled
    runners = [asyncio.create_task(run_service(s)) for s in (gated, free)]
    try:
        await until_ticks(free, 1)  # the loop has run both services' starts by now
        gated.wake()
        await asyncio.sleep(0)
        assert gated.ticks == 0
        reconciled.set()
        await until_ticks(gated, 2)  # then it runs as any other service does
    finally:
        for runner in runners:
            runner.cancel()
        await asyncio.wait(runners)
