"""The worker's background services, in one shape (as River keeps its maintenance services).

A service is a job the main process does again and again beside the claim loop: the work
listener, the heartbeat, the isolation watch, the reaper, the scheduler. Each is a module
with one class whose ``tick()`` does one round and returns how long until the next; its
``wake()`` asks for the next round now, its ``close()`` lets its connection go (after a
failed round, and at the end). Each tick can be called on its own, as the tests do.

``run_service`` is the one loop around a tick. It sleeps until the next round is due or
the service is woken; when a round fails it closes the service's connection (the next
round opens a new one), waits by the service's ``Backoff`` and logs the failure once per
outage (backoff.py). A bug (an error that is not the database's or the network's) is
logged with its traceback and retried the same way: a service never dies silently.
``Services`` starts a list of services in order and closes them in reverse.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tether.broker.types import DatabaseError
from tether.worker.backoff import Backoff, Outage

T = TypeVar("T")

#: What a lost or unreachable database looks like: a round that fails with one of these
#: is tried again after the service's backoff. OSError covers the network; TimeoutError a
#: round that took longer than the service allows it (the heartbeat's).
DATABASE_ERRORS = (DatabaseError, OSError, TimeoutError)


class Service(abc.ABC):
    """One background service. Subclasses set ``name`` and ``log`` and implement ``tick()``."""

    #: What the logs call it: "<name> failed (...)", "<name> works again after ...".
    name: str
    log: logging.Logger
    #: The level of the first failure of an outage.
    failure_level = logging.ERROR

    def __init__(self, backoff: Backoff) -> None:
        self.backoff = backoff
        self.woken = asyncio.Event()  # set by wake(); cleared by the runner as each round starts
        self._round: asyncio.Future[Any] | None = None  # a round running in a thread (in_thread)
        # Set by its owner: the first round waits for this event (the reaper and the scheduler
        # leave the maintenance connection to startup reconciliation, which comes first).
        self.first_round_after: asyncio.Event | None = None

    @abc.abstractmethod
    async def tick(self) -> float:
        """Do one round; return the seconds until the next (0: at once). Raises on failure."""

    def wake(self) -> None:
        """Do the next round now (call it from the event loop's thread)."""
        self.woken.set()

    async def close(self) -> None:  # noqa: B027 (a service without a connection has nothing to close)
        """Let the connection go: the next round opens a new one. Called after a failed round,
        and once the service is stopped."""

    async def in_thread(self, work: Callable[[], T]) -> T:
        """Run a blocking round in a thread.

        If the tick is cancelled meanwhile (the worker stops), the thread still ends its
        round, and ``round_over()`` waits for that before the connection is closed: a
        psycopg connection must not be closed under a thread that is using it.
        """
        self._round = round_ = asyncio.ensure_future(asyncio.to_thread(work))
        return await asyncio.shield(round_)

    async def round_over(self) -> None:
        """Until the round running in a thread (if any) has ended."""
        round_ = self._round
        if round_ is not None and not round_.done():
            await asyncio.wait({round_})
        if round_ is not None and not round_.cancelled():
            round_.exception()  # retrieved: the runner has logged it, or nobody waits for it any more


async def run_service(service: Service) -> None:
    """Run ``service`` round after round until cancelled."""
    outage = Outage(service.name, service.log, service.failure_level)
    if service.first_round_after is not None:
        await service.first_round_after.wait()
    while True:
        service.woken.clear()  # a wake() from now on, during the round included, means "again"
        try:
            wait = await service.tick()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await service.close()
            wait = service.backoff.next()
            outage.failed(exc, wait, unexpected=not isinstance(exc, DATABASE_ERRORS))
        else:
            service.backoff.reset()
            outage.over()
        await _sleep(service.woken, wait)


async def _sleep(woken: asyncio.Event, seconds: float) -> None:
    """Until ``seconds`` have passed or ``woken`` is set.

    A timer handle, not asyncio.wait_for, which makes a Task per call; the isolation watch
    sleeps ten times a second.
    """
    if seconds <= 0 or woken.is_set():
        await asyncio.sleep(0)  # a round at once still lets the rest of the loop run first
        return
    timer = asyncio.get_running_loop().call_later(seconds, woken.set)
    try:
        await woken.wait()
    finally:
        timer.cancel()


class Services:
    """Services run together: started in the order given, closed in reverse."""

    def __init__(self, services: Sequence[Service]) -> None:
        self.services = list(services)
        self._running: list[tuple[Service, asyncio.Task[None]]] = []

    def start(self) -> None:
        for service in self.services:
            task = asyncio.create_task(run_service(service), name=f"tether {service.name}")
            self._running.append((service, task))

    async def close(self) -> None:
        """Stop each started service, last started first, and close its connection."""
        while self._running:
            service, task = self._running.pop()
            task.cancel()
            await asyncio.wait({task})
            await service.round_over()
            await service.close()
            if not task.cancelled() and task.exception() is not None:
                service.log.error("%s ended with an error", service.name, exc_info=task.exception())
