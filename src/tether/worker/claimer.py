"""The claim loop: claim due tasks in batches, up to the free capacity, while there may be work.

It claims while ClaimTriggers says there may be work, and sleeps until woken
otherwise. With claimed tasks still waiting for a child it waits until half the
capacity is free and claims that in one statement (one commit per batch, not per
task); with nothing waiting it claims at once whatever fits. After a claim it keeps
the notify registration up to date (see notify_registration.py), and its marks, the
places in each queue its next claim reads from (see claim_marks.py).
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
from tether.metrics import hooks
from tether.worker.backoff import Backoff, Outage
from tether.worker.claim_marks import ClaimMarks
from tether.worker.claim_triggers import ClaimTriggers
from tether.worker.holdings import Holdings
from tether.worker.lanes import Lanes
from tether.worker.limited_claimer import LimitedClaimer
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
        lanes: Lanes,
        async_names: list[str],
        batch_size: int,
        holdings: Holdings,
        triggers: ClaimTriggers,
        registration: NotifyRegistration,
        accept: Callable[[list[TaskPayload]], Awaitable[None]],
        may_claim: Callable[[], bool],
        stopping: asyncio.Event,
        limited: LimitedClaimer | None = None,
    ) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.queues = queues
        self.lanes = lanes
        self.capacity = lanes.capacity
        # With both kinds of child, the names that go to async children (the claim keeps
        # each kind within its room); with one kind, every task counts alike.
        self.async_names = async_names if lanes.both else []
        self._async_set = frozenset(self.async_names)
        self._blind = (False, False)  # the last claim had no room for (other, async) tasks
        self.batch_size = batch_size
        self.holdings = holdings
        self.triggers = triggers
        self.registration = registration
        self.accept = accept  # takes what a claim returned
        self.may_claim = may_claim  # False while the worker isolates itself
        self.stopping = stopping  # set: no more claims, the loop returns at its next turn (poke it)
        self.marks = ClaimMarks(triggers.poll_interval_s)
        self._skip_names: dict[str, float] = {}
        # Flow-controlled queues (docs/limits.md) take their own claim; None: the worker
        # claims every queue with the plain one.
        self.limited = limited
        self._limited_waits_for_child = False  # the last limited claim found no idle child

    def limits_changed(self) -> None:
        """A queue of this worker got, changed or lost its limits: look at them at the next claim."""
        if self.limited is not None:
            self.limited.expire()
        self.triggers.work_may_wait()

    def skip_name(self, name: str) -> None:
        """Another live worker runs ``name`` and this one cannot (a rolling deploy): leave it to them."""
        self._skip_names[name] = time.monotonic() + SKIP_NAME_FOR_S

    async def run(self) -> None:
        """Claim until ``stopping`` is set; on a database error try again after 0.1 s, backing
        off up to 5 s (a failure is logged once per outage)."""
        backoff, outage = Backoff(0.1, 5.0), Outage("claim", log, logging.WARNING)
        while not self.stopping.is_set():
            if self._wants_to_claim():
                try:
                    await self.claim_once()
                except DatabaseError as exc:
                    hooks.claim_failed()
                    self.triggers.claim_failed()
                    delay = backoff.next()
                    outage.failed(exc, delay)
                    await asyncio.sleep(delay)
                else:
                    backoff.reset()
                    outage.over()
                continue
            await self.triggers.sleep()

    def _wanted(self) -> tuple[int, int]:
        """How many (other, async-named) tasks to claim now; see async_names.

        A kind claims once its room is worth a statement: any room while nothing of that
        kind waits for a child, else half its capacity (one commit per batch, not per task).
        """
        lanes, held = self.lanes, self.holdings
        if not lanes.both:
            waiting = held.unhanded or held.unhanded_async
            return _worth(self.capacity - len(held), self.capacity, waiting), 0
        return (
            _worth(lanes.sync_capacity - held.held("sync"), lanes.sync_capacity, held.unhanded),
            _worth(lanes.async_capacity - held.held("async"), lanes.async_capacity, held.unhanded_async),
        )

    def _wants_to_claim(self) -> bool:
        other, in_async = self._wanted()
        # A claim that found nothing says so only of the kinds it had room for: a kind that
        # had none (its children were full) may find work now that it has room.
        unseen = (self._blind[0] and other > 0) or (self._blind[1] and in_async > 0)
        idle = max(self._idle_children()) > 0
        if self._limited_waits_for_child and idle:
            unseen = True
        # The poll only while a child is idle: with every child busy, what it could find would
        # wait here for a free child anyway (prefetch). Deferred, it claims when one frees.
        polled = self.triggers.poll_due and idle
        return (other or in_async) > 0 and (self.triggers.maybe_more or unseen or polled) and self.may_claim()

    async def claim_once(self) -> int:
        """One claim statement for what fits; returns how many tasks it claimed."""
        other, in_async = (min(n, self.batch_size) for n in self._wanted())
        limit = other + in_async
        self._blind = (self.lanes.both and other == 0, self.lanes.both and in_async == 0)
        told = self.triggers.before_claim()
        skip = self._names_to_skip()
        queues = self.queues
        if self.limited is not None:
            if self.triggers.take_timed():
                self.limited.look_unkeyed()  # delayed work came due: it may have no key
            await self.limited.refresh()
            queues = self.limited.plain_queues()
        tasks: list[TaskPayload] = []
        filled = False
        slot_queues: frozenset[str] = frozenset()
        if queues:
            marks = self.marks.for_claim()
            started = time.monotonic()
            claimed = await self.pool.run(
                "claiming",
                lambda c: claims.claim_tasks(
                    c,
                    worker_id=self.worker_id,
                    queues=queues,
                    limit=other,
                    skip_names=skip,
                    async_names=self.async_names,
                    async_limit=in_async,
                    after=marks or (),
                ),
            )
            tasks = claimed.tasks
            hooks.claimed(tasks, time.monotonic() - started)
            # The claim took all the room it had when some kind filled its room: there may be
            # more work (with both kinds of child, the rows scanned beyond one kind's room are
            # left to a later claim). Triggers and registration count it as a full claim.
            filled = self._took_all(tasks, other, in_async)
            self.marks.after_claim(
                claimed,
                full_read=marks is None,
                filled=filled,
                spent_s=time.monotonic() - started,
                exact=not self.lanes.both,
            )
        took = limit if filled else len(tasks)
        if self.limited is not None and self.limited.limited and took < limit:
            # The limited queues get the room the plain claim left (the claim dispatch).
            in_async_claimed = sum(1 for t in tasks if t.name in self._async_set) if in_async else 0
            free_other, free_async = self._idle_children()
            started = time.monotonic()
            more = await self.limited.claim(
                other - (len(tasks) - in_async_claimed),
                in_async - in_async_claimed,
                free_other + free_async - len(tasks),
                skip,
            )
            hooks.claimed(more.tasks, time.monotonic() - started)
            tasks = tasks + more.tasks
            self._limited_waits_for_child = more.waits_for_child
            slot_queues = more.slot_queues
            if more.look_again_in is not None:
                self.triggers.look_again_in(more.look_again_in)
            took = limit if more.maybe_more or self._took_all(tasks, other, in_async) else len(tasks)
        self.triggers.after_claim(took, limit, told)
        await self.accept(tasks)
        if await self.registration.after_claim(took, limit, slot_queues):
            self.triggers.work_may_wait()  # just registered: look once more (see notify_registration.py)
        return len(tasks)

    def _idle_children(self) -> tuple[int, int]:
        """Room for (other, async-named) tasks in children that would start them now: a limited
        task is prefetched only while its limits are far from binding (limited_claims.sql)."""
        lanes, held = self.lanes, self.holdings
        running_room = lanes.sync_processes, lanes.async_concurrency * lanes.async_processes
        if not lanes.both:
            return sum(running_room) - len(held), 0
        return running_room[0] - held.held("sync"), running_room[1] - held.held("async")

    def _took_all(self, claimed: list[TaskPayload], other: int, in_async: int) -> bool:
        in_async_claimed = sum(1 for t in claimed if t.name in self._async_set) if in_async else 0
        other_claimed = len(claimed) - in_async_claimed
        return (other > 0 and other_claimed >= other) or (in_async > 0 and in_async_claimed >= in_async)

    def _names_to_skip(self) -> list[str]:
        now = time.monotonic()
        for name in [n for n, until in self._skip_names.items() if until <= now]:
            del self._skip_names[name]
        return list(self._skip_names)


def _worth(room: int, capacity: int, waiting: int) -> int:
    """``room`` if it is worth a claim (see Claimer._wanted), else 0."""
    enough = 1 if not waiting else max(1, capacity // 2)
    return room if room >= enough else 0
