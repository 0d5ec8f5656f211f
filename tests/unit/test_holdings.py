"""Where the worker's main process holds each task, without a database or processes."""

from __future__ import annotations

from tether.broker.claims import TaskPayload
from tether.worker.holdings import Holdings

MAIN_PID, CHILD_PID = 100, 200


def task(task_id: str, attempt: int = 1) -> TaskPayload:
    return TaskPayload(task_id, "noop", "default", "[]", "{}", attempt, 0, 0, None)


def holding(*ids: str) -> Holdings:
    held = Holdings()
    for task_id in ids:
        assert held.take(task(task_id))
    return held


def hand_and_push(held: Holdings) -> tuple[TaskPayload, TaskPayload]:
    """Child 0 gets the first unhanded task as its current one and the next in its queue."""
    a, b = held.next_unhanded(), held.next_unhanded()
    assert a is not None and b is not None
    held.hand(0, a)
    held.push(0, b)
    return a, b


def roles(held: Holdings, children: tuple[int, ...] = (0,), fresh: bool = True) -> list[tuple[str, str, int]]:
    beat = held.beat(MAIN_PID, children, lambda slot: CHILD_PID if fresh else None)
    return list(zip(beat.task_ids, beat.roles, beat.pids, strict=True))


def test_a_claimed_task_is_held_unhanded_once_per_attempt() -> None:
    held = holding("a", "b")
    assert not held.take(task("a"))  # the same attempt again: kept once
    assert held.take(task("c"))
    assert len(held) == 3 and held.unhanded == 3 and "a" in held
    assert [t.id for t in held.unhanded_tasks()] == ["a", "b", "c"]


def test_handing_a_task_to_a_child_and_taking_it_back() -> None:
    held = holding("a", "b")
    first = held.next_unhanded()
    assert first is not None and first.id == "a"
    held.hand(0, first)
    assert held.current(0) is first and held.running(0) is None and held.unhanded == 1
    assert held.unhand(0) is first  # the RUN could not be sent
    assert held.current(0) is None and [t.id for t in held.unhanded_tasks()] == ["a", "b"]


def test_start_run_and_finish_with_the_next_task_started_in_the_same_statement() -> None:
    held = holding("a", "b", "c")
    a, b = hand_and_push(held)
    assert held.started(0) is a and held.running(0) is a
    assert held.finished(0, "a", next_started=True) is b  # b now runs
    assert held.running(0) is b and held.queued(0) == 0
    assert len(held) == 2 and "a" not in held


def test_a_next_task_found_lost_is_no_longer_held() -> None:
    held = holding("a", "b")
    hand_and_push(held)
    held.started(0)
    assert held.finished(0, "a", next_started=False) is None
    assert len(held) == 0 and held.current(0) is None


def test_a_queued_task_becomes_current_when_nothing_was_started_with_the_outcome() -> None:
    held = holding("a", "b")
    _, b = hand_and_push(held)
    held.started(0)
    assert held.finished(0, "a", next_started=None) is None  # not running yet: STARTED comes
    assert held.current(0) is b and held.running(0) is None


def test_a_lost_start_lets_the_task_go() -> None:
    held = holding("a")
    a = held.next_unhanded()
    assert a is not None
    held.hand(0, a)
    held.start_lost(0)
    assert len(held) == 0 and held.current(0) is None


def test_after_a_lost_start_the_next_pushed_task_is_the_child_s_current_one() -> None:
    """The child reads the next RUN in its pipe as a fresh task: the main process must see it
    as the current one, or it would take the child's NEXT as already answered by it."""
    held = holding("a", "b", "c")
    a, b = hand_and_push(held)
    c = held.next_unhanded()
    assert c is not None
    held.push(0, c)
    held.start_lost(0)  # a was cancelled before it ran
    assert "a" not in held and held.current(0) is b and held.queued(0) == 1
    held.start_lost(0)  # so was b
    assert held.current(0) is c and held.queued(0) == 0
    assert held.started(0) is c and held.running(0) is c
    assert held.finished(0, "c", next_started=None) is None
    assert held.current(0) is None and len(held) == 0 and a is not None


def test_a_dead_child_s_tasks_stay_held_until_recorded() -> None:
    held = holding("a", "b")
    a, b = hand_and_push(held)
    assert held.child_gone(0) == [a, b]
    assert len(held) == 2 and held.of_child(0) == []
    held.forget("a")
    held.forget("b")
    assert len(held) == 0


def test_the_beat_reports_each_task_in_the_role_it_is_held_in() -> None:
    held = holding("a", "b", "u", "c")
    hand_and_push(held)
    assert roles(held) == [
        ("u", "claimer", MAIN_PID),
        ("c", "claimer", MAIN_PID),
        ("a", "claimer", MAIN_PID),  # handed, not started: still the claimer's
        ("b", "claimer", MAIN_PID),
    ]
    held.started(0)
    assert ("a", "runner", CHILD_PID) in roles(held)
    # A child that did not stamp its slot in time gets no runner heartbeat relayed.
    assert [r for r in roles(held, fresh=False) if r[0] == "a"] == []


def test_lost_tasks_unhanded_are_dropped_and_those_children_hold_are_named() -> None:
    held = holding("a", "b", "c")
    a = held.next_unhanded()
    assert a is not None
    held.hand(0, a)
    assert sorted(held.lose({"a", "b", "x"})) == ["a"]
    assert [t.id for t in held.unhanded_tasks()] == ["c"] and len(held) == 2


def test_isolation_lets_go_of_unhanded_tasks_and_freezes_children() -> None:
    held = holding("a", "b")
    a = held.next_unhanded()
    assert a is not None
    held.hand(0, a)
    assert [t.id for t in held.let_go_unhanded()] == ["b"]
    assert len(held) == 1
    held.freeze(0)
    assert held.frozen(0)
    held.thaw(0)
    assert not held.frozen(0)


def test_an_async_child_holds_many_tasks_and_each_is_counted_by_kind() -> None:
    held = Holdings()
    for task_id in ("s1", "s2"):
        assert held.take(task(task_id), "sync")
    for task_id in ("a1", "a2", "a3", "a4"):
        assert held.take(task(task_id), "async")
    assert (held.held("sync"), held.held("async"), len(held)) == (2, 4, 6)
    assert (held.unhanded, held.unhanded_async) == (2, 4)
    batch = held.next_unhanded_async(3)
    assert [t.id for t in batch] == ["a1", "a2", "a3"] and held.unhanded_async == 1
    held.hand_many(1, batch)
    assert held.handed_count(1) == 3
    assert [t.id for t in held.started_many(1, ["a1", "a2", "gone"])] == ["a1", "a2"]
    assert sorted(t.id for t in held.running_in(1)) == ["a1", "a2"]
    # The beat: unhanded as claimer, the child's started ones as runner, its waiting one as claimer.
    beat = held.beat(MAIN_PID, (1,), lambda slot: CHILD_PID)
    got = sorted(zip(beat.task_ids, beat.roles, beat.pids, strict=True))
    assert got == [
        ("a1", "runner", CHILD_PID),
        ("a2", "runner", CHILD_PID),
        ("a3", "claimer", MAIN_PID),
        ("a4", "claimer", MAIN_PID),
        ("s1", "claimer", MAIN_PID),
        ("s2", "claimer", MAIN_PID),
    ]
    held.ended_many(1, ["a1", "a3"])  # recorded, and given back
    assert held.handed_count(1) == 1 and held.held("async") == 2 and "a1" not in held
    # A stale stamp: the running task is not vouched for; its waiting ones still are.
    beat = held.beat(MAIN_PID, (1,), lambda slot: None)
    assert "a2" not in beat.task_ids


def test_a_dead_async_child_s_tasks_stay_held_until_recorded() -> None:
    held = Holdings()
    for task_id in ("a1", "a2"):
        held.take(task(task_id), "async")
    held.hand_many(3, held.next_unhanded_async(10))
    held.started_many(3, ["a1"])
    held.freeze(3)
    assert held.frozen(3)
    gone = held.child_gone(3)
    assert sorted(t.id for t in gone) == ["a1", "a2"] and held.held("async") == 2
    for t in gone:
        held.forget(t.id)
    assert held.held("async") == 0 and len(held) == 0 and held.handed_count(3) == 0


def test_forgetting_a_given_back_attempt_keeps_the_newer_claim_of_the_same_task() -> None:
    held = holding("a")
    first = held.next_unhanded()
    assert first is not None and first.attempt == 1
    held.hand(0, first)
    assert held.child_gone(0) == [first]  # its child died before starting it: given back...
    assert held.take(task("a", attempt=2))  # ...and claimed again before the give-back is forgotten
    held.forget("a", attempt=1)
    assert len(held) == 1 and held.get("a") == task("a", attempt=2)
    held.forget("a", attempt=2)
    assert len(held) == 0
