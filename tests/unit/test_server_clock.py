"""The work listener's reading of the server's clock (worker/work_listener.py, ServerClock).

A reading is counted from its answer, so it is behind the server's clock by up to its round
trip. A slow answer (a worker's event loop busy starting its children) made every task sent
for now look due a few milliseconds later: each pickup then waited for a timer."""

from __future__ import annotations

from tether.worker.claim_triggers import DUE_NOW_S
from tether.worker.work_listener import CLOCK_READ_EVERY_S, CLOCK_RETRY_S, CLOCK_SLACK_S, ServerClock


class FakeMonotonic:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def read(
    clock: ServerClock, mono: FakeMonotonic, server_epoch_at_ask: float, round_trip: float, **kw: bool
) -> None:
    """One clock read whose answer takes ``round_trip``; the server reads its clock as asked."""
    asked = clock.asking()
    mono.t += round_trip
    clock.read(server_epoch_at_ask, asked, **kw)


def test_a_slow_answer_is_read_again_soon_and_the_closer_reading_kept() -> None:
    mono = FakeMonotonic()
    clock = ServerClock(mono)
    offset = 5_000.0  # server epoch = monotonic + offset
    read(clock, mono, mono.t + offset, 0.020, renew=True)  # the answer waited 20 ms
    assert clock.now() - (mono.t + offset) < -0.015  # behind the server by ~20 ms
    # Behind by that much, a task sent 1 ms ago would look due 19 ms from now: a timer, not a claim.
    assert (mono.t + offset - 0.001) - clock.now() > DUE_NOW_S
    assert 0 < clock.read_in() <= CLOCK_RETRY_S + 1e-9  # not in CLOCK_READ_EVERY_S: soon
    assert not clock.due()
    mono.t += CLOCK_RETRY_S
    assert clock.due()
    read(clock, mono, mono.t + offset, 0.0005)  # a quick answer
    assert abs(clock.now() - (mono.t + offset)) <= CLOCK_SLACK_S
    assert clock.read_in() > CLOCK_READ_EVERY_S - 1  # exact: back to the long period
    read(clock, mono, mono.t + offset - 0.05, 0.05)  # a slower one later does not replace it
    assert abs(clock.now() - (mono.t + offset)) <= CLOCK_SLACK_S


def test_inexact_readings_are_retried_less_and_less_often() -> None:
    mono = FakeMonotonic()
    clock = ServerClock(mono)
    read(clock, mono, 0.0, 0.010, renew=True)
    waits = []
    for _ in range(4):
        waits.append(round(clock.read_in(), 6))
        mono.t += clock.read_in()
        read(clock, mono, 0.0, 0.010)  # never exact (a loaded machine)
    assert waits == [CLOCK_RETRY_S, 2 * CLOCK_RETRY_S, 4 * CLOCK_RETRY_S, 8 * CLOCK_RETRY_S]


def test_a_new_session_replaces_the_reading_whatever_its_round_trip() -> None:
    mono = FakeMonotonic()
    clock = ServerClock(mono)
    read(clock, mono, 100.0, 0.0005, renew=True)
    read(clock, mono, 900.0, 0.010, renew=True)  # another server (a failover), another clock
    assert 900.0 <= clock.now() < 901.0
    assert 0 < clock.read_in() <= CLOCK_RETRY_S + 1e-9
