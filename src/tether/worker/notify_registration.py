"""Ask senders to NOTIFY this worker of new work only while it waits for some.

A send notifies its queue only when a worker is registered as waiting for it
(``tether_queue_waiters``, migration 0005): NOTIFY serialises commits across the
whole database, and a busy worker does not need it, since it claims again as
soon as a slot frees. So the worker registers when a claim finds its queues
drained, and unregisters once its claims have kept filling every free slot for
a while (a backlog it will work through without being told).

Registering closes the lost-wakeup race: it takes each queue's advisory lock
exclusively, which waits for sends in flight (they hold it shared until they
commit) and holds new ones back until the registration is visible to them;
then the worker claims once more, which sees every send that did not notify.
Nothing depends on this for correctness: the claim loop's poll finds any task
within ``poll_interval_ms`` in all cases.

A limited task's end notifies too (a freed slot, migration 13), but only workers that
registered for a slot of its queue (``for_slots``, migration 22): those whose last claim
took less than they had room for while a slot limit held them back. A worker that waits
only because its queues were drained is not told of every limited task's end: until it
unregisters (a second of full claims), each end of a backlog's first second was a NOTIFY,
a commit serialised on the database's notify lock (docs/limits.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from tether.broker import waiters
from tether.broker.types import AsyncConn, DatabaseError
from tether.broker.worker_pool import WorkerPool

log = logging.getLogger("tether.worker.notify_registration")

# How long claims must keep filling every free slot before the worker stops
# asking to be notified: a burst shorter than this keeps the registration, so a
# worker near saturation does not register and unregister for every task.
BUSY_FOR_S = 1.0


class NotifyRegistration:
    """This worker's row(s) in tether_queue_waiters, as far as it knows."""

    def __init__(self, pool: WorkerPool, worker_id: str, queues: list[str], *, notified: bool = True) -> None:
        self.pool = pool
        # False: nothing of this worker LISTENs (a transaction pooler with no listen_url), so a
        # registration would only make senders NOTIFY in vain: never register.
        self.notified = notified
        self.worker_id = worker_id
        self.queues = sorted(set(queues))
        self.registered = False
        self._slot_queues: frozenset[str] = frozenset()  # registered as waiting for a freed slot
        self._recheck = False
        self._full_since: float | None = None

    def forget(self) -> None:
        """Register again at the next empty claim: the listener reconnected, and the rows may
        have been removed meanwhile (the reaper does so for a worker it took for dead)."""
        self._recheck = True

    async def after_claim(self, claimed: int, limit: int, slot_queues: frozenset[str] = frozenset()) -> bool:
        """Update the registration after a claim; True if the caller should claim once more.
        ``slot_queues``: the limited queues a slot limit held back in this claim."""
        if not self.notified:
            return False
        if claimed >= limit:
            now = time.monotonic()
            if self._full_since is None:
                self._full_since = now
            elif self.registered and now - self._full_since >= BUSY_FOR_S:
                await self._unregister()
            return False
        self._full_since = None
        if self.registered and not self._recheck:
            if slot_queues <= self._slot_queues:
                if self._slot_queues and not slot_queues:
                    await self._stop_waiting_for_slots()  # no slot limit holds it back now
                return False
            # A slot limit holds it back now: waiting for freed slots too, which takes the
            # queues' locks and a claim after them, as any registration.
            slot_queues |= self._slot_queues
        return await self._register(slot_queues)

    async def _register(self, slot_queues: frozenset[str]) -> bool:
        try:
            await self.pool.run(
                "registering as waiting",
                lambda c: waiters.register_waiting(c, self.worker_id, self.queues, slot_queues),
            )
        except DatabaseError as exc:
            # Not fatal: without the row, sends do not notify and the poll finds their tasks.
            log.warning("could not register as waiting for work on %s (%s); polling", self.queues, exc)
            return False
        self.registered = True
        self._slot_queues = slot_queues
        self._recheck = False
        return True

    async def _stop_waiting_for_slots(self) -> None:
        # A failure is harmless: freed slots keep notifying a worker that would find nothing more.
        if await self._try(
            "no longer waiting for a slot",
            lambda c: waiters.stop_waiting_for_slots(c, self.worker_id),
            "could not stop waiting for freed slots (%s)",
        ):
            self._slot_queues = frozenset()

    async def _unregister(self) -> None:
        # A failure is harmless: sends keep notifying a worker that is busy anyway.
        if await self._try(
            "unregistering as waiting",
            lambda c: waiters.unregister_waiting(c, self.worker_id),
            "could not unregister as waiting for work (%s)",
        ):
            self.registered = False
            self._slot_queues = frozenset()

    async def _try(self, what: str, work: Callable[[AsyncConn], Awaitable[None]], failed: str) -> bool:
        """``work`` on the pool; a database error is logged (``failed`` % the error), not raised."""
        try:
            await self.pool.run(what, work)
        except DatabaseError as exc:
            log.warning(failed, exc)
            return False
        return True
