"""What makes the claim loop look for work again: notifications, timers, the poll.

The claim loop claims while ``maybe_more`` says there may be work, and otherwise
sleeps until woken. Sources of "there may be work": a notification for work due
now, a timer for work due later, the listener (re)connecting, a claim that came
back full, and the fallback poll, so that nothing depends on a notification
arriving. A freed slot or a stop request only wakes the loop.

The poll is kept apart (``poll_due``): it looks for work a notification may have failed to
announce, and such work can only wait in this worker until a child is free to run it. So
the claim loop polls only while a child is idle (claimer.py), and a poll that came while
every child was busy waits, due, for the first child to free (it then claims at once).
A worker whose children all run long tasks costs no claim per poll interval for room it
has only to prefetch into (docs/operations.md, what an idle worker costs).
"""

from __future__ import annotations

import asyncio
import heapq
import math

# A claim right after a notification that finds nothing looks once more this much later:
# the new row may have been locked for a moment (a result waiter flags it with an UPDATE,
# and the claim skips locked rows), and the next poll may be far away.
RECHECK_AFTER_NOTIFY_S = 0.05

# A notification for work due within this long counts as due now.
DUE_NOW_S = 0.005
# Due times of delayed work kept: past twice this many, they are kept coarser instead (each
# rounded up to a grain, doubled from DUE_GRAIN_S until at most this many distinct ones are
# left), so that every announced task still wakes the loop, at most a grain late, and memory
# stays bounded. Coarsening only then keeps a burst of delayed sends at O(log n) a
# notification. 10,000 durable sleeps due over 30 s need a grain of 40 ms (bench/sleeps.py);
# keeping only the earliest 1,000 left the others to the poll, up to a poll interval late.
MAX_PENDING_DUES = 1_000
DUE_GRAIN_S = 0.005


class ClaimTriggers:
    def __init__(self, poll_interval_s: float) -> None:
        self.poll_interval_s = poll_interval_s
        self.maybe_more = True
        # The fallback poll's time came and no claim has looked since (see the module's doc).
        self.poll_due = False
        self._event = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None  # for the earliest of _dues
        # Every delayed task announced and not yet due (loop times), earliest first: a timer
        # for the earliest only would lose the later ones once it fired, and a task due later
        # would wait for the poll.
        self._dues: list[float] = []
        self._due_set: set[float] = set()  # the same, for dropping repeats once coarsened
        self._grain = 0.0  # 0: due times kept exact; else each rounded up to a multiple of it
        self._recheck: asyncio.TimerHandle | None = None
        self._timed = False  # a due-time timer fired since the last take_timed()
        self._notes = 0  # notifications of work due now, counted...
        self._notes_seen = 0  # ...and as of the last claim

    # -- what wakes the loop ------------------------------------------------------

    def poke(self) -> None:
        """Wake the loop to look at its state again (a slot freed, a stop was asked for)."""
        self._event.set()

    def work_may_wait(self) -> None:
        """Claim at the next turn whatever happens (the listener connected, claiming resumed)."""
        self.maybe_more = True
        self._event.set()

    def on_notification(self, due_in: float | None, behind_s: float = 0.0) -> None:
        """A tether_work notification for one of our queues; ``due_in``: seconds until its run_at,
        by a reading of the server's clock that may be up to ``behind_s`` behind it."""
        if due_in is None or due_in <= DUE_NOW_S:
            self._notes += 1
            self.work_may_wait()
            return
        if due_in - behind_s <= DUE_NOW_S:
            # It may be due already (a task sent for now, announced by a reading not yet exact,
            # work_listener.CLOCK_SLACK_S): look now, and again at the due time it says, in
            # case it really was delayed work.
            self._notes += 1
            self.work_may_wait()
        loop = asyncio.get_running_loop()
        when = self._rounded(loop.time() + due_in)
        if when not in self._due_set:
            self._due_set.add(when)
            heapq.heappush(self._dues, when)
            if len(self._dues) > 2 * MAX_PENDING_DUES:
                self._coarsen()
        self._arm(loop)

    def _rounded(self, when: float) -> float:
        return when if not self._grain else math.ceil(when / self._grain) * self._grain

    def _coarsen(self) -> None:
        """Too many distinct due times: a grain twice as coarse, until at most MAX_PENDING_DUES."""
        exact = self._dues
        while len(self._dues) > MAX_PENDING_DUES:
            self._grain = self._grain * 2 if self._grain else DUE_GRAIN_S
            self._due_set = {self._rounded(when) for when in exact}
            self._dues = sorted(self._due_set)  # sorted: a heap

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer set for the earliest pending due time (none left: no timer)."""
        if not self._dues:
            return
        earliest = self._dues[0]
        if self._timer is not None and self._timer.when() <= earliest:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(earliest, self._on_timer)

    def look_again_in(self, seconds: float) -> None:
        """Claim again after ``seconds`` (a rate-limited queue's next token) unless woken before."""
        self.on_notification(max(seconds, DUE_NOW_S * 2))

    def _on_timer(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        # A timer may fire a hair before its time (the loop's clock resolution): what is due
        # within DUE_NOW_S counts as due, as for a notification, so it is not re-armed at once.
        while self._dues and self._dues[0] <= loop.time() + DUE_NOW_S:
            self._due_set.discard(heapq.heappop(self._dues))
        if not self._dues:
            self._grain = 0.0  # the burst is over: exact again
        self._arm(loop)  # for the next delayed task announced
        self._timed = True
        self.work_may_wait()

    def take_timed(self) -> bool:
        """True once after a due-time timer fired: delayed work (a durable sleep, a retry, a
        scheduled send) is due now, and the claim should look everywhere it may be."""
        timed, self._timed = self._timed, False
        return timed

    def _on_recheck(self) -> None:
        self._recheck = None
        self.work_may_wait()

    # -- around a claim -----------------------------------------------------------

    def before_claim(self) -> bool:
        """Called as a claim starts; True if a notification came since the previous one.

        ``maybe_more`` is cleared here, not after the claim: a notification arriving while
        the claim runs (for a row it may not see) must still trigger the next one.
        """
        self.maybe_more = False
        self.poll_due = False
        told = self._notes != self._notes_seen
        self._notes_seen = self._notes
        return told

    def after_claim(self, claimed: int, limit: int, told: bool) -> None:
        if claimed >= limit:
            self.maybe_more = True  # there may be more than this claim could take
        elif told and not claimed and self._recheck is None:
            self._recheck = asyncio.get_running_loop().call_later(RECHECK_AFTER_NOTIFY_S, self._on_recheck)

    def claim_failed(self) -> None:
        self.maybe_more = True

    async def sleep(self) -> None:
        """Until woken, or until the poll interval has passed (then claim anyway).

        A timer handle rather than asyncio.wait_for, which makes a Task per call: the loop
        sleeps once per message from a child, and that showed in the profile.
        """
        if not self._event.is_set():
            timer = asyncio.get_running_loop().call_later(self.poll_interval_s, self._on_poll)
            try:
                await self._event.wait()
            finally:
                timer.cancel()
        self._event.clear()

    def _on_poll(self) -> None:
        # The fallback: nothing depends on a notification arriving. Due until a claim looks.
        self.poll_due = True
        self._event.set()

    def close(self) -> None:
        self._dues, self._due_set = [], set()
        for timer in (self._timer, self._recheck):
            if timer is not None:
                timer.cancel()
