"""Where an idle reaper pass rides on the worker's beats (tether.worker.beat_rides), no database.

The plan picks the last beat at or before the moment the pass is due, so a pass is never
later than it was due; with no beat before that moment (or none known), the pass keeps
its own moment.
"""

from __future__ import annotations

import pytest

from tether.worker.beat_rides import plan, slack


def test_the_pass_rides_on_the_next_beat_when_the_intervals_are_equal() -> None:
    # Beat at 10 (just sent), the next at 40; the pass began at 10.01, due 30 s later.
    assert plan(began=10.01, wait=30.0, next_beat_at=40.0, every=30.0, now=10.05) == 40.0


def test_the_pass_rides_on_the_last_beat_before_it_is_due() -> None:
    # Beats every 10 s from 12: 12, 22, 32 are before the pass's moment (40), 42 is not.
    assert plan(began=10.0, wait=30.0, next_beat_at=12.0, every=10.0, now=10.5) == 32.0


def test_a_pass_due_before_the_next_beat_keeps_its_own_moment() -> None:
    assert plan(began=10.0, wait=30.0, next_beat_at=45.0, every=60.0, now=10.5) is None


@pytest.mark.parametrize("next_beat_at", [None, 9.0])
def test_without_a_known_coming_beat_the_pass_keeps_its_own_moment(next_beat_at: float | None) -> None:
    # None: no beat got through yet; 9.0: the heartbeat is late (its next beat is past).
    assert plan(began=10.0, wait=30.0, next_beat_at=next_beat_at, every=30.0, now=10.5) is None


def test_the_slack_is_a_quarter_interval_and_at_most_a_second() -> None:
    assert slack(1.0) == 0.25
    assert slack(30.0) == 1.0
