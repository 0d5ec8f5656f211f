"""The claim loop's side for flow-controlled queues (docs/limits.md): which of the worker's
queues take the limited claim, and claiming from them in turn.

Which queues are limited is the database's to say (tether_queue_limits): the plain claim
skips them whatever this worker believes, so a worker that has not yet noticed a new limit
only claims nothing from that queue until its next look: at once when told (a change
notifies tether_control), else within REFRESH_S. At its first look the worker writes the
limits its app declares.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tether.broker import limited_claims
from tether.broker.claims import TaskPayload
from tether.broker.limited_claims import KeyCursor, LimitedClaim
from tether.broker.types import AsyncConn
from tether.broker.worker_pool import WorkerPool
from tether.limits import QueueLimits

log = logging.getLogger("tether.worker.limited_claimer")

# How often the worker reads which of its queues are limited, when not told: a change of
# limits notifies tether_control ('limits <queue>'), and the worker looks at once. Rare, so
# that an idle worker stays at one round trip per poll (tests/integration/test_idle_cost.py).
REFRESH_S = 60.0
UNKEYED_LOOK_S = 1.0  # a keyed queue is looked at for tasks without a key at least this often
# A claim that found no key with room in a full window looks at the next window at once, up
# to this many windows in a row; past that, the next notification or poll.
MAX_EMPTY_WINDOWS = 16
CONTENDED_RETRY_S = 0.02  # a key another claimer held: look again this soon


@dataclass(frozen=True, slots=True)
class Taken:
    tasks: list[TaskPayload]
    maybe_more: bool  # there may be work this worker could take now
    # A rate-limited queue gave less than asked: look again in this many seconds, when its
    # next token is back (no notification says so). None: nothing to wait for.
    look_again_in: float | None = None
    # No child was left idle and there was room the limits kept from prefetching: claim again
    # when a child is free, as a freed child only pokes the claim loop.
    waits_for_child: bool = False
    # The queues whose claim a slot limit held back (max_in_flight, per_key): if this claim
    # took less than it had room for, a freed slot there is worth a notification.
    slot_queues: frozenset[str] = frozenset()


class LimitedClaimer:
    def __init__(
        self,
        *,
        pool: WorkerPool,
        worker_id: str,
        queues: list[str],
        declared: dict[str, QueueLimits],
        async_names: list[str],
    ) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.queues = queues
        self.declared = {q: lim for q, lim in declared.items() if q in queues}
        self.async_names = async_names
        self.limited: list[str] = []  # the worker's queues that are flow-controlled now
        self._token_s: dict[str, float | None] = {}  # seconds a token of each one's rate takes
        self._async_set = frozenset(async_names)
        self._next_refresh = 0.0
        self._next_unkeyed_look = 0.0
        self._declared_written = False
        self._cursors: dict[str, KeyCursor] = {}
        self._turn = 0  # the limited queue looked at first, in turn
        self._empty_windows = 0

    def plain_queues(self) -> list[str]:
        """The worker's queues that the plain claim takes."""
        if not self.limited:
            return self.queues
        return [q for q in self.queues if q not in self.limited]

    def expire(self) -> None:
        """Read which queues are limited at the next claim (told of a change)."""
        self._next_refresh = 0.0

    async def refresh(self) -> None:
        """Every REFRESH_S, or when told: which queues are limited (first: write the declared
        limits)."""
        now = time.monotonic()
        if now < self._next_refresh:
            return
        if not self._declared_written and self.declared:
            changed = await self.pool.run(
                "declaring queue limits",
                lambda c: limited_claims.declare_limits(c, self.declared, f"worker:{self.worker_id}"),
            )
            for queue in changed:
                log.info("queue %s: limits set to %s", queue, self.declared[queue])
        self._declared_written = True
        found = await self.pool.run(
            "reading queue limits", lambda c: limited_claims.limited_queues(c, self.queues)
        )
        limited = [q for q in self.queues if q in found]
        if limited != self.limited:
            log.info("flow-controlled queues now: %s (docs/limits.md)", ", ".join(limited) or "none")
        self.limited = limited
        self._token_s = found
        self._next_refresh = now + REFRESH_S

    def look_unkeyed(self) -> None:
        """At the next claim, look for tasks without a key in every limited queue (not only every
        UNKEYED_LOOK_S): a due-time timer fired, and what came due (a durable sleep's end, a
        retry's backoff) may have no key; it would wait up to UNKEYED_LOOK_S otherwise."""
        self._next_unkeyed_look = 0.0

    async def claim(self, other: int, in_async: int, idle: int, skip_names: list[str]) -> Taken:
        """Claim up to ``other`` + ``in_async`` tasks from the limited queues, each in turn;
        ``idle``: how many children would start a task now (see claim_limited)."""
        if not self.limited:
            return Taken([], False)
        other, in_async, idle = max(0, other), max(0, in_async), max(0, idle)
        if other + in_async == 0:
            return Taken([], False)
        now = time.monotonic()
        if now >= self._next_unkeyed_look:
            for cursor in self._cursors.values():
                cursor.unkeyed = True
            self._next_unkeyed_look = now + UNKEYED_LOOK_S
        taken: list[TaskPayload] = []
        held: set[str] = set()
        maybe_more = contended = False
        look_again_in: float | None = None
        order = (
            self.limited[self._turn % len(self.limited) :] + self.limited[: self._turn % len(self.limited)]
        )
        self._turn += 1
        for queue in order:
            if other + in_async <= 0:
                maybe_more = True
                break
            cursor = self._cursors.setdefault(queue, KeyCursor())
            result = await self.pool.run(
                "claiming (limited)", self._claim_from(queue, cursor, other, in_async, idle, skip_names)
            )
            idle -= len(result.tasks)
            got_async = sum(1 for t in result.tasks if t.name in self._async_set) if in_async else 0
            other -= len(result.tasks) - got_async
            in_async -= got_async
            taken += result.tasks
            contended |= result.contended
            if result.held_back:
                held.add(queue)
            token_s = self._token_s.get(queue)
            if token_s is not None and other + in_async > 0:
                look_again_in = token_s if look_again_in is None else min(look_again_in, token_s)
            if result.more_keys:
                if result.tasks:
                    self._empty_windows = 0
                    maybe_more = True
                elif self._empty_windows < MAX_EMPTY_WINDOWS:
                    self._empty_windows += 1
                    maybe_more = True
        if contended and not maybe_more:
            # Another claimer holds a key for the few milliseconds of its claim; what it leaves
            # (it takes only its own room) is looked at again right after.
            await asyncio.sleep(CONTENDED_RETRY_S)
            maybe_more = True
        # With no idle child left, what this claim could not take may fit once one is free
        # (a freed child only pokes the claim loop).
        return Taken(
            taken,
            maybe_more,
            look_again_in,
            waits_for_child=idle <= 0 and other + in_async > 0,
            slot_queues=frozenset(held),
        )

    def _claim_from(
        self, queue: str, cursor: KeyCursor, other: int, in_async: int, idle: int, skip_names: list[str]
    ) -> Callable[[AsyncConn], Awaitable[LimitedClaim]]:
        async def work(conn: AsyncConn) -> LimitedClaim:
            return await limited_claims.claim_limited(
                conn,
                queue=queue,
                worker_id=self.worker_id,
                cursor=cursor,
                limit=other,
                async_limit=in_async,
                async_names=self.async_names if in_async else [],
                skip_names=skip_names,
                idle=idle,
            )

        return work
