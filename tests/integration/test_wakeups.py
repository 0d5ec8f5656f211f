"""Sends NOTIFY only when a worker waits for their queue, and no wake-up is lost.

A worker registers in tether_queue_waiters when a claim finds its queues drained, and
unregisters after its claims have filled every free slot for a while. A send due now
notifies only if its queue has a registered worker (migration 0005). The race between a
registration and a send is closed by a per-queue advisory lock: both orderings are tested
here with two real connections, each blocked on the other's lock as PostgreSQL reports it
(pg_stat_activity), never with a sleep.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from tests.apps.support import connect, load_app_module, machinery_url, prepared_insert
from tests.conftest import WorkerFactory, wait_until
from tether.broker.queries import q
from tether.broker.worker_pool import WorkerPool
from tether.config import AppConfig, PostgresConfig
from tether.worker import notify_registration

# The claim's parameters for a worker with one kind of child (worker/lanes.py).
NO_ASYNC_LANE = {"async_limit": 0, "async_names": []}
# No marks (worker/claim_marks.py): the claim reads each queue from its start.
NO_MARKS: dict[str, list[Any]] = {
    "mark_queues": [],
    "mark_priorities": [],
    "mark_run_ats": [],
    "mark_ids": [],
}

APP = "tests.apps.basic:app"


@pytest.fixture
def basic(database_url: str, db: psycopg.Connection[Any]) -> Any:
    return load_app_module("basic", database_url)


@pytest.fixture
def listener(database_url: str, db: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    # The test's own LISTEN: directly, also when tether goes through PgBouncer.
    with psycopg.connect(machinery_url(database_url), autocommit=True) as conn:
        conn.execute("LISTEN tether_work")
        yield conn


def fake_worker(db: psycopg.Connection[Any], queues: list[str]) -> str:
    """A registry row, so that waiter rows can point at it (no process behind it)."""
    worker_id = f"test-{uuid.uuid4().hex[:8]}"
    db.execute(
        q("register_worker"),
        {
            "id": worker_id,
            "hostname": "test-host",
            "pid": 1,
            "process_started_at": None,
            "queues": queues,
            "processes": 1,
            "async_processes": 0,
            "async_concurrency": None,
            "version": "test",
            "task_names": [],
            "host_key": None,
        },
    )
    return worker_id


def register(conn: psycopg.Connection[Any], worker_id: str, queues: list[str]) -> None:
    """What a worker does when its claim finds nothing (worker/notify_registration.py), in one transaction."""
    with conn.transaction():
        conn.execute(q("lock_queues_for_waiting"), {"queues": queues})
        conn.execute(q("register_waiting"), {"worker_id": worker_id, "queues": queues, "slot_queues": []})


def waiters(db: psycopg.Connection[Any]) -> set[tuple[str, str]]:
    rows = db.execute("SELECT queue, worker_id FROM tether_queue_waiters").fetchall()
    return {(r["queue"], r["worker_id"]) for r in rows}


def notified_queues(listener: psycopg.Connection[Any], db: psycopg.Connection[Any]) -> list[str]:
    """The queues named by tether_work notifications so far, in commit order.

    A sentinel notification, sent last, marks the end: everything committed before it has
    been delivered before it, so no wait is needed to know that nothing else came.
    """
    db.execute("SELECT pg_notify('tether_work', 'end-of-test 0')")
    seen: list[str] = []
    for note in listener.notifies(timeout=10):
        queue = note.payload.partition(" ")[0]
        if queue == "end-of-test":
            return seen
        seen.append(queue)
    raise AssertionError(f"the sentinel notification did not arrive within 10 s; got {seen}")


def blocked_on_advisory_lock(db: psycopg.Connection[Any], pid: int) -> bool:
    row = db.execute(
        "SELECT wait_event_type, wait_event FROM pg_stat_activity WHERE pid = %s", (pid,)
    ).fetchone()
    return row is not None and (row["wait_event_type"], row["wait_event"]) == ("Lock", "advisory")


def test_a_send_notifies_only_a_queue_someone_waits_for(
    basic: Any, db: psycopg.Connection[Any], listener: psycopg.Connection[Any]
) -> None:
    basic.noop.with_options(queue="images").send()  # nobody waits: no notification
    worker_id = fake_worker(db, ["default"])
    register(db, worker_id, ["default"])
    basic.noop.with_options(queue="images").send()  # still nobody waits on images
    basic.noop.send_many([(), ()])  # default: one notification for the batch
    basic.noop.send()
    assert notified_queues(listener, db) == ["default", "default"]

    db.execute(q("unregister_waiting"), {"worker_id": worker_id})
    basic.noop.send()  # nobody waits any more
    basic.noop.with_options(queue="images").schedule(timedelta(seconds=30))  # due later: always told
    assert notified_queues(listener, db) == ["images"]  # a worker sets a timer for it
    pending = db.execute("SELECT count(*) AS n FROM tether_tasks WHERE status = 'PENDING'").fetchone()
    assert pending is not None and pending["n"] == 7  # skipping the notification lost no task


def test_a_send_in_flight_holds_a_registration_back_until_it_commits(
    basic: Any, database_url: str, db: psycopg.Connection[Any]
) -> None:
    """Send first: the worker's registration waits for it, so its next claim sees the task."""
    worker_id = fake_worker(db, ["default"])
    with connect(database_url) as sender, connect(database_url) as registrar:
        sender.execute("BEGIN")
        task_id, insert = prepared_insert(basic.noop.with_options())
        insert(sender)  # no waiter yet: no notification
        thread = threading.Thread(target=register, args=(registrar, worker_id, ["default"]))
        thread.start()
        try:
            wait_until(
                lambda: blocked_on_advisory_lock(db, registrar.info.backend_pid),
                message="the registration to wait for the send's lock",
            )
            assert waiters(db) == set()
        finally:
            sender.execute("COMMIT")
            thread.join(timeout=30)
        assert waiters(db) == {("default", worker_id)}
        claimed = registrar.execute(
            q("claim_tasks"),
            {
                "queues": ["default"],
                "limit": 10,
                "other_limit": 10,
                **NO_ASYNC_LANE,
                "worker_id": worker_id,
                "skip_names": [],
                **NO_MARKS,
            },
        ).fetchall()
    assert [r["id"] for r in claimed] == [task_id]


def test_a_registration_in_flight_makes_a_send_wait_and_then_notify(
    basic: Any, database_url: str, db: psycopg.Connection[Any], listener: psycopg.Connection[Any]
) -> None:
    """Register first: a send that meets the lock waits, then sees the worker and notifies."""
    worker_id = fake_worker(db, ["default"])
    with connect(database_url) as registrar, connect(database_url) as sender:
        registrar.execute("BEGIN")
        registrar.execute(q("lock_queues_for_waiting"), {"queues": ["default"]})
        registrar.execute(
            q("register_waiting"), {"worker_id": worker_id, "queues": ["default"], "slot_queues": []}
        )
        _, insert = prepared_insert(basic.noop.with_options())
        thread = threading.Thread(target=insert, args=(sender,))
        thread.start()
        try:
            wait_until(
                lambda: blocked_on_advisory_lock(db, sender.info.backend_pid),
                message="the send to wait for the registration's lock",
            )
        finally:
            registrar.execute("COMMIT")
            thread.join(timeout=30)
    assert notified_queues(listener, db) == ["default"]


def test_a_worker_found_dead_or_stopped_waits_for_nothing(db: psycopg.Connection[Any]) -> None:
    gone, silent, stopped = (fake_worker(db, ["default"]) for _ in range(3))
    for worker_id in (gone, silent, stopped):
        register(db, worker_id, ["default", "images"])
    db.execute(q("deactivate_worker"), {"id": gone})
    db.execute(
        "UPDATE tether_workers SET last_heartbeat_at = now() - interval '1 hour' WHERE id = %s", (silent,)
    )
    db.execute(q("deactivate_stale_workers"), {"threshold": timedelta(minutes=5), "limit": 10})
    assert {w for _, w in waiters(db)} == {stopped}
    db.execute(q("stop_worker"), {"id": stopped})
    assert waiters(db) == set()


@pytest.mark.timeout(120)
def test_a_worker_waits_when_idle_and_stops_waiting_through_a_backlog(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    # No fallback poll within the test's time: only a notification or a freed slot wakes it.
    # One kind of child only: an idle async child would have room, and so wait for work.
    worker = workers.start(
        APP,
        "--queues",
        "default,images",
        "--processes",
        "1",
        "--async-processes",
        "0",
        env={"TETHER_WORKER_POLL_INTERVAL_MS": "60000"},
    )
    wid = worker.worker_id
    assert wid is not None
    both = {("default", wid), ("images", wid)}
    wait_until(lambda: waiters(db) == both, message="the idle worker to register for its queues")

    # ~4 s of work for one process: its claims fill every free slot for longer than a
    # second, so it stops asking to be told about new work...
    handles = basic.sleep.send_many([(0.02,)] * 200)
    wait_until(lambda: waiters(db) == set(), timeout=30, message="the busy worker to unregister")
    # ...and finds the tasks sent meanwhile all the same, then waits again once drained.
    handles += [basic.sleep.send(0.02) for _ in range(5)]
    ids = [h.id for h in handles]

    def all_done() -> bool:
        row = db.execute(
            "SELECT count(*) AS n FROM tether_tasks WHERE id = ANY(%s) AND status = 'COMPLETED'", (ids,)
        ).fetchone()
        return row is not None and row["n"] == len(ids)

    wait_until(all_done, timeout=60, message="every task to complete")
    wait_until(lambda: waiters(db) == both, message="the drained worker to register again")
    assert basic.noop.send().get(timeout=30).is_ok  # told: the poll would take 60 s
    assert worker.stop() == 0, worker.log()
    assert waiters(db) == set()


async def test_a_registration_survives_a_listener_reconnect_in_both_directions(
    database_url: str, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's own bookkeeping, on a real pool: after its listener reconnects it registers
    again at the next empty claim (the reaper may have removed its rows meanwhile), and a
    reconnect during a backlog does not keep it from unregistering."""
    monkeypatch.setattr(notify_registration, "BUSY_FOR_S", 0.0)  # "busy for a while" = two full claims
    worker_id = fake_worker(db, ["default", "images"])
    both = {("default", worker_id), ("images", worker_id)}
    pool = WorkerPool(database_url, AppConfig(broker=PostgresConfig(database_url=database_url)))
    await pool.open()
    try:
        registration = notify_registration.NotifyRegistration(pool, worker_id, ["images", "default"])
        assert await registration.after_claim(0, 4) is True  # drained: registered, claim again
        assert waiters(db) == both
        assert await registration.after_claim(1, 4) is False  # still drained: nothing to write

        db.execute(q("deactivate_worker"), {"id": worker_id})  # taken for dead meanwhile
        assert waiters(db) == set()
        registration.forget()  # the listener reconnected
        assert await registration.after_claim(0, 4) is True
        assert waiters(db) == both

        registration.forget()  # reconnected again, now in the middle of a backlog
        for _ in range(2):
            assert await registration.after_claim(4, 4) is False
        assert waiters(db) == set()
    finally:
        await pool.close()


async def test_only_a_worker_held_back_by_a_slot_limit_waits_for_freed_slots(
    database_url: str, db: psycopg.Connection[Any]
) -> None:
    """A drained worker waits for new work, not for every limited task's end (each would be a
    NOTIFY); a claim that a slot limit held back registers for that queue's freed slots too,
    and a later short claim that nothing held back stops waiting for them (migration 22)."""
    worker_id = fake_worker(db, ["default", "images"])
    pool = WorkerPool(database_url, AppConfig(broker=PostgresConfig(database_url=database_url)))
    await pool.open()

    def for_slots() -> set[str]:
        rows = db.execute(
            "SELECT queue FROM tether_queue_waiters WHERE worker_id = %s AND for_slots", (worker_id,)
        ).fetchall()
        return {r["queue"] for r in rows}

    try:
        registration = notify_registration.NotifyRegistration(pool, worker_id, ["images", "default"])
        assert await registration.after_claim(0, 4) is True  # drained
        assert len(waiters(db)) == 2 and for_slots() == set()
        assert await registration.after_claim(1, 4, frozenset({"images"})) is True  # held back: claim again
        assert for_slots() == {"images"}
        assert await registration.after_claim(2, 4, frozenset({"images"})) is False  # nothing new to write
        assert await registration.after_claim(1, 4) is False  # short, but no slot limit held it back
        assert len(waiters(db)) == 2 and for_slots() == set()
        assert await registration.after_claim(0, 4, frozenset({"default"})) is True
        assert for_slots() == {"default"}
    finally:
        await pool.close()


@pytest.mark.timeout(120)
def test_send_then_get_at_once_is_picked_up_without_waiting_for_the_poll(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    """get() flags the new row for a notification with an UPDATE, which locks it for a moment;
    a claim running just then skips it. The worker must look again soon, not at the next poll."""
    worker = workers.start(APP, "--processes", "1", env={"TETHER_WORKER_POLL_INTERVAL_MS": "60000"})
    wait_until(lambda: waiters(db), message="the idle worker to register")
    for i in range(30):
        result = basic.add.send(i, 1).get(timeout=10)
        assert result.ok == i + 1, f"send {i}: {result}"
    assert worker.stop() == 0, worker.log()


@pytest.mark.timeout(120)
def test_every_delayed_task_announced_to_an_idle_worker_starts_before_the_poll(
    basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    """Delayed tasks announced one after another, the later ones first and then an earlier
    one (which used to replace the worker's only timer): each starts when due, not at the
    next poll (60 s away). Run in database time: started_at against run_at."""
    worker = workers.start(APP, "--processes", "1", env={"TETHER_WORKER_POLL_INTERVAL_MS": "60000"})
    wait_until(lambda: waiters(db), message="the idle worker to register")
    handles = [basic.record.schedule(delay, uuid.uuid4().hex) for delay in (2.0, 1.5, 0.5)]
    wait_until(
        lambda: all(h.status().value == "COMPLETED" for h in handles),
        timeout=20,
        message="the three delayed tasks to run (the poll is 60 s away)",
    )
    for h in handles:
        row = db.execute("SELECT run_at, started_at FROM tether_tasks WHERE id = %s", (h.id,)).fetchone()
        assert row is not None and row["started_at"] >= row["run_at"], row
    assert worker.stop() == 0, worker.log()


# -- a waiting get() never delays a claim ---------------------------------------------------------
# get() flags the task's row for a notification (tasks.sql watch_task), and that UPDATE holds
# the row's lock until it commits. A claim running meanwhile skips the row (FOR UPDATE SKIP
# LOCKED). The tests below hold that lock on purpose, from a connection of their own running
# the same statement, until PostgreSQL shows that a claim ran while it was held
# (pg_stat_activity); then they let it go and time the task's start in database time. The
# worker's fallback poll is 60 s: only a wake-up can start the task sooner.

SKIPPED_START_BOUND_S = 5.0


def claim_ran_since(db: psycopg.Connection[Any], since: Any) -> bool:
    """A claim statement (claims.sql claim_tasks) started at or after ``since`` (database time)
    and has finished: it ran while the test held its lock."""
    row = db.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()"
        " AND query LIKE %s AND state = 'idle' AND query_start >= %s",
        ("WITH marks AS (%", since),
    ).fetchone()
    return row is not None and row["n"] > 0


def watch_held(database_url: str, task_id: Any) -> tuple[psycopg.Connection[Any], Any]:
    """A connection in a transaction that ran get()'s watch statement on ``task_id`` (so it
    holds the row lock, as a get() whose commit is slow would), and the database time after."""
    from tether.broker import tasks

    holder = connect(database_url)
    holder.execute("BEGIN")
    state = tasks.watch_task(holder, task_id)
    assert state is not None and state.status == "PENDING"
    row = holder.execute("SELECT clock_timestamp() AS at").fetchone()
    assert row is not None
    return holder, row["at"]


def start_delay(db: psycopg.Connection[Any], task_id: Any, released_at: Any) -> tuple[float, float]:
    """Seconds from when the task could first be taken (due and unlocked) to its claim, and
    to its start."""
    row = db.execute(
        "SELECT extract(epoch FROM claimed_at - greatest(run_at, %s))::float8 AS claimed,"
        " extract(epoch FROM started_at - greatest(run_at, %s))::float8 AS started"
        " FROM tether_tasks WHERE id = %s",
        (released_at, released_at, task_id),
    ).fetchone()
    assert row is not None and row["started"] is not None, f"task {task_id} never started"
    return float(row["claimed"]), float(row["started"])


@pytest.fixture
def idle_worker(basic: Any, db: psycopg.Connection[Any], workers: WorkerFactory) -> Iterator[Any]:
    """One worker, two sync children, a 60 s fallback poll, idle and waiting for work."""
    worker = workers.start(
        APP,
        "--processes",
        "2",
        "--async-processes",
        "0",
        "--poll-interval-ms",
        "60000",
    )
    # Both children run a task first: a child connects to the database on its first task,
    # which on a loaded machine can take seconds that have nothing to do with waking up.
    warm = basic.sleep.send_many([(0.5,), (0.5,)])
    assert all(h.get(timeout=60).is_ok for h in warm)
    ran = db.execute(
        "SELECT count(DISTINCT pid) AS n FROM tether_task_attempts WHERE task_id = ANY(%s)",
        ([h.id for h in warm],),
    ).fetchone()
    assert ran == {"n": 2}, "each child must have run one"
    wait_until(lambda: waiters(db), message="the idle worker to register as waiting")
    yield worker
    assert worker.stop() == 0, worker.log()


@pytest.mark.timing
@pytest.mark.timeout(300)
@pytest.mark.parametrize("alongside", [0, 1], ids=["claim-took-nothing", "claim-took-one-of-two"])
def test_a_claim_that_skipped_a_row_a_waiting_get_held_is_woken_when_the_lock_goes(
    basic: Any, database_url: str, db: psycopg.Connection[Any], idle_worker: Any, alongside: int
) -> None:
    """Tasks due in a moment, and a get() that flags the last of them just then: the worker
    sets a timer for their run_at, and the claim at that time finds the flagged row locked.
    Its claim took fewer tasks than it had room for (none, or the one sent alongside), and
    it answered no notification: before the fix, nothing looked again before the 60 s poll.
    A due time, rather than a task due now, makes the order certain: the lock is taken
    before any claim can see the row."""
    for i in range(10):
        at = datetime.now(UTC) + timedelta(milliseconds=300)
        others = [basic.add.schedule(at, i, 0) for _ in range(alongside)]
        handle = basic.add.schedule(at, i, 1)
        holder, held_at = watch_held(database_url, handle.id)
        try:
            due = db.execute("SELECT run_at FROM tether_tasks WHERE id = %s", (handle.id,)).fetchone()
            assert due is not None and due["run_at"] > held_at, "the lock must be taken before run_at"
            wait_until(
                lambda at=due["run_at"]: claim_ran_since(db, at),
                timeout=30,
                message="the worker's claim at run_at, while the row is locked",
            )
            holder.execute("COMMIT")
            released = db.execute("SELECT clock_timestamp() AS at").fetchone()
        finally:
            holder.close()
        assert released is not None
        assert all(other.get(timeout=30).ok == i for other in others)
        # Far below the 60 s poll: a task left to the poll times out here.
        result = handle.get(timeout=3 * SKIPPED_START_BOUND_S)
        assert result.is_ok and result.ok == i + 1, f"round {i}: {result}"
        claimed, started = start_delay(db, handle.id, released["at"])
        assert started < SKIPPED_START_BOUND_S, (
            f"round {i}: claimed {claimed:.1f} s and started {started:.1f} s after the lock went"
        )
