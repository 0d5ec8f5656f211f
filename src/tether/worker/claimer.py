"""The claim loop: claim due tasks in batches, up to the free capacity, while there may be work.

It claims while ClaimTriggers says there may be work, and sleeps until woken
otherwise. With claimed tasks still waiting for a child it waits until half the
capacity is free and claims that in one statement (one commit per batch, not per
task); with nothing waiting it claims at once whatever fits. After a claim it keeps
the notify registration up to date (see notify_registration.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from tether.broker import claims
from tether.broker.claims import TaskPayload
from tether.broker.types import DatabaseError
from tether.broker.worker_pool import WorkerPool
from tether.worker.claim_triggers import ClaimTriggers
from tether.worker.holdings import Holdings
from tether.worker.notify_registration import NotifyRegistration

log = logging.getLogger("tether.worker.claimer")

# A name this worker cannot run but another live worker can is not claimed for this long.
SKIP_NAME_FOR_S = 30.0


class Claimer:
    def __init__(
        self,
        *,
        pool: WorkerPool,
        worker_id: str,
        queues: list[str],
        capacity: int,
        batch_size: int,
        holdings: Holdings,
        triggers: ClaimTriggers,
        registration: NotifyRegistration,
        accept: Callable[[list[TaskPayload]], Awaitable[None]],
        may_claim: Callable[[], bool],
    ) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.queues = queues
        self.capacity = capacity
        self.batch_size = batch_size
        self.holdings = holdings
        self.triggers = triggers
        self.registration = registration
        self.accept = accept  # takes what a claim returned
        self.may_claim = may_claim  # False while the worker isolates itself
        self.stopping = False
        self._skip_names: dict[str, float] = {}

    def stop(self) -> None:
        """No more claims: the loop returns at its next turn."""
        self.stopping = True
        self.triggers.poke()

    def skip_name(self, name: str) -> None:
        """Another live worker runs ``name`` and this one cannot (a rolling deploy): leave it to them."""
        self._skip_names[name] = time.monotonic() + SKIP_NAME_FOR_S

    async def run(self) -> None:
        backoff = 0.1
        while not self.stopping:
            if self._wants_to_claim():
                try:
                    await self.claim_once()
                    backoff = 0.1
                except DatabaseError as exc:
                    self.triggers.claim_failed()
                    log.warning("claim failed (%s); retrying in %.1fs", exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                continue
            await self.triggers.sleep()

    def _wants_to_claim(self) -> bool:
        free = self.capacity - len(self.holdings)
        enough = 1 if not self.holdings.unhanded else max(1, self.capacity // 2)
        return free >= enough and self.triggers.maybe_more and self.may_claim()

    async def claim_once(self) -> int:
        """One claim statement for what fits; returns how many tasks it claimed."""
        limit = min(self.capacity - len(self.holdings), self.batch_size)
        told = self.triggers.before_claim()
        skip = self._names_to_skip()
        claimed = await self.pool.run(
            "claiming",
            lambda c: claims.claim_tasks(
                c, worker_id=self.worker_id, queues=self.queues, limit=limit, skip_names=skip
            ),
        )
        self.triggers.after_claim(len(claimed), limit, told)
        await self.accept(claimed)
        if await self.registration.after_claim(len(claimed), limit):
            self.triggers.work_may_wait()  # just registered: look once more (see notify_registration.py)
        return len(claimed)

    def _names_to_skip(self) -> list[str]:
        now = time.monotonic()
        for name in [n for n, until in self._skip_names.items() if until <= now]:
            del self._skip_names[name]
        return list(self._skip_names)
