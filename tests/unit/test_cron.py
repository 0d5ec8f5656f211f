"""Cron expressions in a time zone (tether.cron) and the catch-up rules (periodic.plan_slots).

Daylight-saving changes are checked by the time zone rules themselves, at the dates they
happen (Europe/Berlin: clocks forward 2026-03-29 02:00 -> 03:00, back 2026-10-25 03:00 -> 02:00),
without waiting for real time.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest

from tether.cron import Cron, CronError
from tether.periodic import CATCH_UP_LIMIT, plan_slots

BERLIN = "Europe/Berlin"


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


def local(cron: Cron, slots: list[datetime]) -> list[str]:
    return [s.astimezone(cron.tz).strftime("%m-%d %H:%M:%S%z") for s in slots]


def test_five_six_fields_and_aliases() -> None:
    assert list(Cron("*/2 * * * * *").slots(utc(2026, 1, 1), utc(2026, 1, 1, 0, 0, 7))) == [
        utc(2026, 1, 1, 0, 0, s) for s in (2, 4, 6)
    ]
    assert Cron("*/15 * * * *").next_after(utc(2026, 1, 1, 10, 7)) == utc(2026, 1, 1, 10, 15)
    assert Cron("@hourly").next_after(utc(2026, 1, 1, 10, 7)) == utc(2026, 1, 1, 11)
    assert Cron("@daily", "America/New_York").next_after(utc(2026, 1, 1, 10)) == utc(2026, 1, 2, 5)
    assert Cron("0 9 * * MON-FRI").next_after(utc(2026, 11, 27, 10)) == utc(2026, 11, 30, 9)  # Fri -> Mon
    assert Cron("  0   9 * * *  ").expression == "0 9 * * *"


@pytest.mark.parametrize(
    ("expression", "timezone", "message"),
    [
        ("* * *", "UTC", "has 3 field(s)"),
        ("61 * * * *", "UTC", "is invalid: Bad minute"),
        ("@often", "UTC", "has 1 field(s)"),
        ("0 0 30 2 *", "UTC", "Bad day-of-month"),
        ("* * * * *", "Mars/Olympus", "not a known IANA time zone"),
        ("* * * * *", "", "not a known IANA time zone"),
    ],
)
def test_bad_expressions_and_zones_are_refused(expression: str, timezone: str, message: str) -> None:
    with pytest.raises(CronError, match=re.escape(message)):
        Cron(expression, timezone)


def test_a_wall_clock_time_skipped_by_clocks_going_forward_fires_not_at_all() -> None:
    cron = Cron("30 2 * * *", BERLIN)
    slots = list(cron.slots(utc(2026, 3, 27), utc(2026, 3, 31)))
    assert local(cron, slots) == ["03-27 02:30:00+0100", "03-28 02:30:00+0100", "03-30 02:30:00+0200"]


def test_a_repeated_wall_clock_time_fires_once() -> None:
    cron = Cron("30 2 * * *", BERLIN)
    slots = list(cron.slots(utc(2026, 10, 24), utc(2026, 10, 27)))
    assert local(cron, slots) == ["10-24 02:30:00+0200", "10-25 02:30:00+0200", "10-26 02:30:00+0100"]


def test_an_hourly_or_faster_schedule_follows_elapsed_time_through_the_changes() -> None:
    every_20 = Cron("*/20 * * * *", BERLIN)
    back = list(every_20.slots(utc(2026, 10, 24, 23, 30), utc(2026, 10, 25, 2, 10)))
    assert [s.minute for s in back] == [40, 0, 20, 40, 0, 20, 40, 0]  # UTC: every 20 minutes, no gap
    assert local(every_20, back)[1:7] == [
        "10-25 02:00:00+0200",
        "10-25 02:20:00+0200",
        "10-25 02:40:00+0200",
        "10-25 02:00:00+0100",  # the repeated hour, second pass
        "10-25 02:20:00+0100",
        "10-25 02:40:00+0100",
    ]
    forward = list(every_20.slots(utc(2026, 3, 29, 0, 30), utc(2026, 3, 29, 1, 30)))
    assert local(every_20, forward) == ["03-29 01:40:00+0100", "03-29 03:00:00+0200", "03-29 03:20:00+0200"]
    hourly = Cron("0 * * * *", BERLIN)
    assert len(list(hourly.slots(utc(2026, 10, 24, 22), utc(2026, 10, 25, 3)))) == 5  # 2:00 twice


def test_next_after_from_inside_the_repeated_hour() -> None:
    cron = Cron("*/20 * * * *", BERLIN)
    # 02:50 in the first pass (00:50 UTC): next is 02:00 of the second pass (01:00 UTC).
    assert cron.next_after(utc(2026, 10, 25, 0, 50)) == utc(2026, 10, 25, 1, 0)
    daily = Cron("30 2 * * *", BERLIN)
    # 02:10 in the second pass: the day's 02:30 already fired in the first, so tomorrow.
    assert daily.next_after(utc(2026, 10, 25, 1, 10)) == utc(2026, 10, 26, 1, 30)


def test_catch_up_latest_sends_the_most_recent_missed_slot() -> None:
    cron = Cron("*/2 * * * * *")
    plan = plan_slots(cron, utc(2026, 1, 1, 0, 0, 0), utc(2026, 1, 1, 0, 0, 11), "latest")
    assert plan.send == [utc(2026, 1, 1, 0, 0, 10)]
    assert (plan.skipped, plan.more_skipped) == (4, False)
    assert plan.last_slot == utc(2026, 1, 1, 0, 0, 10) and plan.next_slot == utc(2026, 1, 1, 0, 0, 12)


def test_catch_up_all_sends_every_missed_slot_up_to_the_limit() -> None:
    cron = Cron("*/2 * * * * *")
    plan = plan_slots(cron, utc(2026, 1, 1), utc(2026, 1, 1, 0, 0, 11), "all")
    assert plan.send == [utc(2026, 1, 1, 0, 0, s) for s in (2, 4, 6, 8, 10)] and plan.skipped == 0
    long = plan_slots(cron, utc(2026, 1, 1), utc(2026, 1, 1, 1), "all")  # 1800 missed
    assert len(long.send) == CATCH_UP_LIMIT and long.send[-1] == utc(2026, 1, 1, 1)
    # Counted from the 10 minutes before: "at least" 200 more were missed, and the log says so.
    assert long.more_skipped and long.skipped == 300 - CATCH_UP_LIMIT


def test_catch_up_none_sends_only_a_slot_still_on_time() -> None:
    cron = Cron("*/2 * * * * *")
    late = plan_slots(cron, utc(2026, 1, 1), utc(2026, 1, 1, 0, 0, 11, 500_000), "none")
    assert late.send == [] and late.skipped == 5 and late.last_slot == utc(2026, 1, 1, 0, 0, 10)
    on_time = plan_slots(cron, utc(2026, 1, 1), utc(2026, 1, 1, 0, 0, 10, 300_000), "none")
    assert on_time.send == [utc(2026, 1, 1, 0, 0, 10)] and on_time.skipped == 4
    hourly = Cron("@hourly")
    assert plan_slots(hourly, utc(2026, 1, 1), utc(2026, 1, 1, 5, 0, 9), "none").send == [utc(2026, 1, 1, 5)]
    assert plan_slots(hourly, utc(2026, 1, 1), utc(2026, 1, 1, 5, 0, 11), "none").send == []


def test_a_long_outage_is_not_walked_second_by_second() -> None:
    cron = Cron("* * * * * *")
    plan = plan_slots(cron, utc(2026, 1, 1), utc(2026, 1, 8), "latest")  # a week of seconds
    assert plan.send == [utc(2026, 1, 8)] and plan.more_skipped and plan.skipped >= 599


def test_nothing_due_moves_only_the_next_slot() -> None:
    plan = plan_slots(Cron("@hourly"), utc(2026, 1, 1, 5), utc(2026, 1, 1, 5, 30), "latest")
    assert plan.send == [] and plan.last_slot is None and plan.next_slot == utc(2026, 1, 1, 6)
