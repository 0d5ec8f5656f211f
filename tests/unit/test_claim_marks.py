"""How a worker's claim marks move (tether.worker.claim_marks), with a clock the test turns.

What the claim statement does with the marks is tested against PostgreSQL in
tests/integration/test_claim_marks.py; here: which marks a claim gets, when a claim reads
everything, and what a claim, a notification or a lost listener leaves behind.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tether.broker.claims import Claimed, Place
from tether.worker.claim_marks import MAX_MARKS_PER_QUEUE, RESCAN_SHARE, ClaimMarks

T0 = datetime(2030, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def at(seconds: float, priority: int = 0, queue: str = "default", n: int = 0) -> Place:
    return Place(queue, priority, T0 + timedelta(seconds=seconds), f"00000000-0000-7000-8000-{n:012d}")


def took(*places: Place, advances: tuple[Place, ...] | None = None) -> Claimed:
    return Claimed([], list(places), list(places if advances is None else advances))


def marks_after_first_read(clock: Clock, *places: Place) -> ClaimMarks:
    marks = ClaimMarks(1.0, clock)
    assert marks.for_claim() is None  # the first claim reads everything
    marks.after_claim(took(*places), full_read=True, filled=True, spent_s=0.01, exact=True)
    return marks


def test_a_claim_moves_each_band_s_mark_to_the_last_row_it_may_pass() -> None:
    clock = Clock()
    marks = marks_after_first_read(clock, at(1), at(2), at(1, priority=5))
    assert marks.for_claim() == [at(2), at(1, priority=5)]
    left_before = at(4)  # a row after one the claim read and left: no advance
    marks.after_claim(
        took(at(3), left_before, advances=(at(3),)), full_read=False, filled=True, spent_s=0, exact=True
    )
    assert marks.marks == {("default", 0): at(3), ("default", 5): at(1, priority=5)}


def test_a_full_read_comes_once_per_rescan_interval_or_less_often_when_it_is_slow() -> None:
    clock = Clock()
    marks = marks_after_first_read(clock, at(1))
    clock.now += 0.9
    assert marks.for_claim() == [at(1)]
    clock.now += 0.1
    assert marks.for_claim() is None
    slow = 0.2  # a full read of 0.2 s: the next one 0.2 / RESCAN_SHARE later, not 1 s
    marks.after_claim(took(at(2)), full_read=True, filled=True, spent_s=slow, exact=True)
    clock.now += slow / RESCAN_SHARE - 0.01
    assert marks.for_claim() == [at(2)]
    clock.now += 0.02
    assert marks.for_claim() is None


def test_a_full_read_keeps_only_the_marks_it_read_past() -> None:
    clock = Clock()
    marks = marks_after_first_read(
        clock, at(1, priority=9), at(1, priority=5), at(1, priority=0, queue="other")
    )
    # Filled with rows of band 5: every band above was read; band 5 and below were not.
    clock.now += 2
    assert marks.for_claim() is None
    marks.after_claim(took(at(0.5, priority=5)), full_read=True, filled=True, spent_s=0.01, exact=True)
    assert marks.marks == {("default", 9): at(1, priority=9), ("default", 5): at(0.5, priority=5)}
    # Short: it read everything and found nothing more: every mark stands.
    clock.now += 2
    assert marks.for_claim() is None
    marks.after_claim(took(), full_read=True, filled=False, spent_s=0.01, exact=True)
    assert marks.marks == {("default", 9): at(1, priority=9), ("default", 5): at(0.5, priority=5)}
    # A worker with both kinds of child may have left rows anywhere it read: nothing is kept.
    clock.now += 2
    assert marks.for_claim() is None
    marks.after_claim(took(at(3)), full_read=True, filled=False, spent_s=0.01, exact=False)
    assert marks.marks == {("default", 0): at(3)}


def test_work_announced_at_or_before_a_mark_drops_that_queue_s_marks_from_there() -> None:
    clock = Clock()
    marks = marks_after_first_read(clock, at(1, priority=5), at(3), at(3, queue="other"))
    marks.rewind("default", T0 + timedelta(seconds=4))  # after every mark: nothing to drop
    assert len(marks.marks) == 3
    marks.rewind("default", T0 + timedelta(seconds=2))
    assert marks.marks == {("default", 5): at(1, priority=5), ("other", 0): at(3, queue="other")}
    marks.rewind("default", None)  # a time that could not be read: all of that queue
    assert marks.marks == {("other", 0): at(3, queue="other")}
    marks.forget()
    assert marks.marks == {}


def test_a_rewind_told_while_a_claim_runs_holds_after_it() -> None:
    clock = Clock()
    marks = marks_after_first_read(clock, at(1))
    assert marks.for_claim() == [at(1)]
    marks.rewind("default", T0 + timedelta(seconds=2))  # the claim's statement may not see that row
    marks.after_claim(took(at(5)), full_read=False, filled=True, spent_s=0, exact=True)
    assert marks.marks == {}
    assert marks.for_claim() == []
    marks.after_claim(took(at(6)), full_read=False, filled=True, spent_s=0, exact=True)
    assert marks.marks == {("default", 0): at(6)}  # told before this claim began: it read back


def test_marks_per_queue_are_bounded_dropping_the_lowest_bands() -> None:
    clock = Clock()
    many = [at(1, priority=p) for p in range(MAX_MARKS_PER_QUEUE + 3)]
    marks = marks_after_first_read(clock, *many)
    assert sorted(p for _, p in marks.marks) == list(range(3, MAX_MARKS_PER_QUEUE + 3))


def test_a_mark_moves_to_the_furthest_row_whatever_order_the_claim_returned_them_in() -> None:
    clock = Clock()
    marks = marks_after_first_read(clock, at(1))
    marks.after_claim(
        took(at(4, n=2), at(5, n=1), at(4, n=3)), full_read=False, filled=True, spent_s=0, exact=True
    )
    assert marks.marks == {("default", 0): at(5, n=1)}
    marks.after_claim(took(at(6, n=9), at(6, n=7)), full_read=False, filled=True, spent_s=0, exact=True)
    assert marks.marks == {("default", 0): at(6, n=9)}  # same run_at: the greater id


def test_rewinds_told_while_no_claim_runs_are_bounded() -> None:
    clock = Clock()
    marks = marks_after_first_read(clock, at(1), at(1, queue="other"))
    for i in range(1_000):
        marks.rewind("default", T0 + timedelta(seconds=100 + i))  # each after every mark
    assert len(marks.marks) == 2
    marks.after_claim(took(at(2)), full_read=False, filled=True, spent_s=0, exact=True)
    assert marks.marks == {}  # too many to keep: every mark dropped, which is never wrong
