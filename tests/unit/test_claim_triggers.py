"""The claim loop's wake-ups (tether.worker.claim_triggers) on a real asyncio loop, no database.

``maybe_more`` says whether the next turn claims; ``sleep()`` returns when something woke
the loop (or the poll interval passed). Timers are real but short: a test that expects a
wake-up awaits it with a generous ceiling, and one that expects none waits a bounded
window past every timer that could wrongly fire.
"""

from __future__ import annotations

import asyncio

import pytest

from tether.worker.claim_triggers import DUE_NOW_S, RECHECK_AFTER_NOTIFY_S, ClaimTriggers

LONG_POLL_S = 30.0  # a poll interval no test waits for: only the wake-up under test can end a sleep
CEILING_S = 5.0  # how long a test waits for a wake-up it expects (a loaded machine is slow)


async def woken_after(triggers: ClaimTriggers) -> float:
    """Seconds until sleep() returns; fails the test if it takes CEILING_S."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(triggers.sleep(), CEILING_S)
    return loop.time() - started


async def stays_asleep(triggers: ClaimTriggers, window: float) -> bool:
    """True if sleep() is still waiting after ``window`` seconds."""
    try:
        await asyncio.wait_for(triggers.sleep(), window)
    except TimeoutError:
        return True
    return False


def idle(poll_interval_s: float = LONG_POLL_S) -> ClaimTriggers:
    """A ClaimTriggers whose first claim found nothing: maybe_more is False, nothing pending."""
    triggers = ClaimTriggers(poll_interval_s)
    told = triggers.before_claim()
    triggers.after_claim(0, 10, told)
    assert (told, triggers.maybe_more) == (False, False)
    return triggers


def test_the_constants() -> None:
    assert RECHECK_AFTER_NOTIFY_S == 0.05
    assert DUE_NOW_S == 0.005


async def test_a_new_loop_claims_at_once() -> None:
    triggers = ClaimTriggers(LONG_POLL_S)
    assert triggers.maybe_more is True
    assert triggers.poll_interval_s == LONG_POLL_S
    triggers.close()


# -- notifications -----------------------------------------------------------------------------


@pytest.mark.timing
@pytest.mark.parametrize("due_in", [None, -1.0, 0.0, DUE_NOW_S])
async def test_a_notification_due_now_wakes_the_loop_to_claim(due_in: float | None) -> None:
    triggers = idle()
    triggers.on_notification(due_in)
    assert triggers.maybe_more is True
    assert await woken_after(triggers) < 1.0  # the event was set: no waiting at all
    assert triggers.before_claim() is True  # this claim follows a notification...
    assert triggers.before_claim() is False  # ...the next one does not
    triggers.close()


async def test_notifications_are_counted_once_per_claim() -> None:
    triggers = idle()
    triggers.on_notification(None)
    triggers.on_notification(None)
    assert triggers.before_claim() is True
    assert triggers.before_claim() is False
    triggers.close()


async def test_a_notification_due_later_wakes_the_loop_when_due() -> None:
    triggers = idle()
    triggers.on_notification(0.2)
    assert triggers.maybe_more is False  # nothing to claim yet
    waited = await woken_after(triggers)
    assert waited >= 0.19
    assert triggers.maybe_more is True
    assert triggers.before_claim() is False  # a timer is not a notification of work due now
    triggers.close()


async def test_a_task_that_may_be_due_by_a_doubtful_clock_is_looked_for_now_and_when_due() -> None:
    """The listener's reading of the server's clock may be behind it (work_listener.ServerClock):
    a task sent for now then looks due a little later. It is claimed at once, and if it really
    was delayed work, that claim found nothing and the timer looks again at its due time."""
    triggers = idle()
    loop = asyncio.get_running_loop()
    notified = loop.time()
    triggers.on_notification(0.2, behind_s=0.25)
    assert triggers.maybe_more is True  # at once
    assert await woken_after(triggers) < 0.1
    assert triggers.before_claim() is True  # as for a notification of work due now
    triggers.after_claim(0, 10, True)  # found nothing: it was delayed work after all
    await woken_after(triggers)  # the recheck of a notified claim that found nothing (50 ms)
    triggers.before_claim()
    triggers.after_claim(0, 10, False)
    await woken_after(triggers)  # its timer, at the due time it said
    assert loop.time() - notified >= 0.19
    assert triggers.maybe_more is True
    triggers.close()


async def test_an_exact_clock_leaves_a_task_due_later_to_its_timer() -> None:
    triggers = idle()
    triggers.on_notification(0.2, behind_s=0.001)
    assert triggers.maybe_more is False
    triggers.close()


async def test_just_over_due_now_is_due_later() -> None:
    triggers = idle()
    triggers.on_notification(DUE_NOW_S + 0.1)
    assert triggers.maybe_more is False
    assert await woken_after(triggers) >= DUE_NOW_S + 0.09
    assert triggers.maybe_more is True
    triggers.close()


@pytest.mark.timing
@pytest.mark.parametrize("dues", [(1.0, 0.1), (0.1, 1.0)], ids=["later-first", "earlier-first"])
async def test_every_delayed_task_announced_wakes_the_loop_when_it_is_due(dues: tuple[float, float]) -> None:
    """Two delayed tasks announced, in either order: the loop is woken at each one's time (a
    timer for the earliest only left the later task to the poll, a poll interval late)."""
    triggers = idle()
    for due_in in dues:
        triggers.on_notification(due_in)
    waited = await woken_after(triggers)
    assert 0.09 <= waited < 1.0  # at the earlier time
    triggers.before_claim()
    assert triggers.maybe_more is False
    waited += await woken_after(triggers)
    assert 0.99 <= waited < 2.0  # and at the later one, long before the poll
    assert triggers.maybe_more is True
    triggers.close()


# -- around a claim ----------------------------------------------------------------------------


async def test_before_claim_clears_maybe_more() -> None:
    triggers = ClaimTriggers(LONG_POLL_S)
    assert triggers.before_claim() is False
    assert triggers.maybe_more is False
    triggers.close()


async def test_a_notification_during_a_claim_makes_the_next_turn_claim() -> None:
    triggers = idle()
    told = triggers.before_claim()
    triggers.on_notification(None)  # arrives while the claim runs, for a row it may not see
    triggers.after_claim(0, 10, told)
    assert triggers.maybe_more is True
    assert triggers.before_claim() is True
    triggers.close()


@pytest.mark.parametrize(("claimed", "limit"), [(10, 10), (11, 10), (1, 1)])
async def test_a_full_claim_claims_again(claimed: int, limit: int) -> None:
    triggers = ClaimTriggers(LONG_POLL_S)
    told = triggers.before_claim()
    triggers.after_claim(claimed, limit, told)
    assert triggers.maybe_more is True
    triggers.close()


async def test_a_notified_claim_that_found_nothing_looks_again_50ms_later() -> None:
    triggers = idle()
    triggers.on_notification(None)
    await woken_after(triggers)
    told = triggers.before_claim()
    assert told is True
    triggers.after_claim(0, 10, told)
    assert triggers.maybe_more is False  # not at once: the recheck is a timer
    waited = await woken_after(triggers)
    assert waited >= RECHECK_AFTER_NOTIFY_S - 0.01
    assert triggers.maybe_more is True
    triggers.close()


@pytest.mark.parametrize(("claimed", "told"), [(0, False), (3, True), (3, False)])
async def test_no_recheck_unless_a_notified_claim_found_nothing(claimed: int, told: bool) -> None:
    triggers = idle()
    triggers.after_claim(claimed, 10, told)
    assert triggers.maybe_more is False
    assert await stays_asleep(triggers, 0.3)  # RECHECK_AFTER_NOTIFY_S six times over
    assert triggers.maybe_more is False
    triggers.close()


async def test_a_failed_claim_claims_again() -> None:
    triggers = idle()
    triggers.claim_failed()
    assert triggers.maybe_more is True
    triggers.close()


# -- sleeping ----------------------------------------------------------------------------------


async def test_the_poll_fires_after_the_poll_interval() -> None:
    triggers = idle(poll_interval_s=0.2)
    waited = await woken_after(triggers)
    assert waited >= 0.19
    # The fallback is due, apart from "there may be work": the claim loop polls only while
    # a child is idle (claimer.py), and a claim that starts clears it.
    assert triggers.poll_due is True and triggers.maybe_more is False
    triggers.before_claim()
    assert triggers.poll_due is False
    triggers.close()


async def test_a_sleep_woken_early_cancels_its_poll_timer() -> None:
    triggers = idle(poll_interval_s=0.2)
    sleeper = asyncio.create_task(triggers.sleep())
    await asyncio.sleep(0)  # asleep, its poll timer set
    triggers.poke()
    await asyncio.wait_for(sleeper, CEILING_S)
    await asyncio.sleep(0.5)  # past the poll interval, not sleeping on the wake-ups
    assert triggers.maybe_more is False and triggers.poll_due is False  # that poll timer did not fire
    triggers.close()


@pytest.mark.timing
async def test_poke_wakes_without_claiming() -> None:
    triggers = idle()
    triggers.poke()
    assert await woken_after(triggers) < 1.0
    assert triggers.maybe_more is False  # a freed slot or a stop request: no claim
    triggers.close()


@pytest.mark.timing
async def test_work_may_wait_wakes_and_claims() -> None:
    triggers = idle()
    triggers.work_may_wait()
    assert triggers.maybe_more is True
    assert await woken_after(triggers) < 1.0
    assert triggers.before_claim() is False  # not a notification
    triggers.close()


async def test_a_wake_up_is_consumed_by_one_sleep() -> None:
    triggers = idle()
    triggers.poke()
    triggers.poke()
    await woken_after(triggers)
    assert await stays_asleep(triggers, 0.2)
    triggers.close()


async def test_a_wake_up_while_asleep_ends_the_sleep() -> None:
    triggers = idle()
    sleeper = asyncio.create_task(triggers.sleep())
    await asyncio.sleep(0)  # the sleeper is now waiting
    assert not sleeper.done()
    triggers.work_may_wait()
    await asyncio.wait_for(sleeper, CEILING_S)
    assert triggers.maybe_more is True
    triggers.close()


async def test_close_cancels_the_timers() -> None:
    triggers = idle()
    triggers.on_notification(0.1)  # a delayed task's timer
    triggers.on_notification(None)
    told = triggers.before_claim()
    triggers.after_claim(0, 10, told)  # the recheck, due in 50 ms
    triggers.close()  # nothing awaited since: neither timer can have fired yet
    await woken_after(triggers)  # the notification's own wake-up, set before close
    triggers.before_claim()
    assert await stays_asleep(triggers, 0.5)
    assert triggers.maybe_more is False


async def test_close_with_nothing_pending() -> None:
    triggers = ClaimTriggers(LONG_POLL_S)
    triggers.close()
    triggers.close()
    assert triggers.maybe_more is True


@pytest.mark.timing
async def test_thousands_of_due_times_are_kept_coarser_never_dropped() -> None:
    """5,000 delayed tasks (durable sleeps) due over one second: past 2,000 distinct due times
    they are rounded up to a grain, so the loop still wakes for the last one, at most a grain
    late and long before the poll (keeping only the earliest 1,000 left it to the poll)."""
    from tether.worker import claim_triggers

    triggers = idle()
    loop = asyncio.get_running_loop()
    start = loop.time()
    n = 5_000
    for i in range(n):
        triggers.on_notification(0.2 + i / n - (loop.time() - start))
        assert len(triggers._dues) <= 2 * claim_triggers.MAX_PENDING_DUES
    last_due = start + 0.2 + (n - 1) / n
    grain = triggers._grain
    assert 0 < grain <= 0.01
    while triggers._dues:
        await woken_after(triggers)
        triggers.before_claim()
    woke = loop.time()
    assert last_due - DUE_NOW_S <= woke < last_due + grain + 0.5, (woke - last_due, grain)
    assert triggers._grain == 0.0  # exact again once the burst is over
    triggers.close()


async def test_a_due_time_timer_says_so_once() -> None:
    """The claim after a due-time timer looks everywhere delayed work may be (a limited
    queue's tasks without a key, worker/limited_claimer.py): take_timed is True once."""
    triggers = idle()
    assert triggers.take_timed() is False
    triggers.on_notification(0.05)
    await woken_after(triggers)
    assert triggers.take_timed() is True
    assert triggers.take_timed() is False
    triggers.on_notification(None)  # work due now is a notification, not a timer
    await woken_after(triggers)
    assert triggers.take_timed() is False
    triggers.close()
