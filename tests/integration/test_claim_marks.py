"""Claim marks (worker/claim_marks.py, claims.sql claim_tasks): a claim reads each marked
priority band of a queue from just after its mark, and a mark can delay a task behind it,
never lose it.

The first tests drive the claim statement itself, so what it reads and what it says a mark
may move over are checked row by row. The others run real workers while a transaction
holds back the vacuum (the case marks exist for), with the fallback poll, and so the full
read without marks, an hour or a minute away: every task that lands behind a mark must
be found by what announces it, or by the full read.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import runs, task_row
from tests.conftest import WorkerFactory, wait_until
from tether.broker.queries import q

Conn = psycopg.Connection[Any]
APP = "tests.apps.basic:app"
# The fallback poll, and so the full read without marks, far beyond every wait of a test:
# what a test sees claimed was found through its marks and what announced it.
NO_POLL = ("--poll-interval-ms", "60000")


def claim(
    db: Conn,
    marks: list[tuple[int, datetime, Any]],
    *,
    limit: int = 50,
    other_limit: int | None = None,
    async_limit: int = 0,
    async_names: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """The claim statement as worker "w-1" runs it, with ``marks`` (priority, run_at, id) on
    "default"; the rows it took, in claim order (an UPDATE returns them in any order)."""
    rows = db.execute(
        q("claim_tasks"),
        {
            "queues": ["default"],
            "limit": limit,
            "other_limit": limit - async_limit if other_limit is None else other_limit,
            "async_limit": async_limit,
            "async_names": list(async_names),
            "worker_id": "w-1",
            "skip_names": [],
            "mark_queues": ["default"] * len(marks),
            "mark_priorities": [m[0] for m in marks],
            "mark_run_ats": [m[1] for m in marks],
            "mark_ids": [m[2] for m in marks],
        },
    ).fetchall()
    return sorted(rows, key=lambda r: (-r["priority"], r["run_at"], r["id"]))


# send_many's rows share run_at; within a priority the claim takes them by id (UUIDv7,
# random below the millisecond), so each group below is sorted by id.


def finished(db: Conn) -> int:
    return int(db.execute("SELECT count(*) AS n FROM tether_task_attempts").fetchone()["n"])


def place(db: Conn, task_id: Any) -> tuple[int, datetime, Any]:
    row = task_row(db, task_id)
    return row["priority"], row["run_at"], row["id"]


@pytest.fixture
def held(database_url: str) -> Iterator[Conn]:
    """A REPEATABLE READ transaction that read something and stays open: the vacuum is held back.

    It reads tether_schema_version, which no test empties: the TRUNCATE of the next test's
    clean-up would wait for a transaction that read a table it empties.
    """
    conn = psycopg.connect(database_url)
    try:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT count(*) FROM tether_schema_version").fetchone()
        yield conn
    finally:
        conn.close()


def test_a_marked_band_is_read_after_its_mark_and_the_other_bands_from_their_start(
    basic: ModuleType, db: Conn
) -> None:
    normal = sorted(h.id for h in basic.noop.send_many([()] * 10))
    high = sorted(h.id for h in basic.noop.with_options(priority=5).send_many([()] * 3))
    low = sorted(h.id for h in basic.noop.with_options(priority=-5).send_many([()] * 3))

    taken = claim(db, [place(db, normal[4])])

    # The band above every mark and the band below it are read from their start; the marked
    # band from just after its mark; all in claim order.
    assert [r["id"] for r in taken] == [*high, *normal[5:], *low]
    assert all(r["advance"] for r in taken)
    assert [(r["priority"], r["run_at"]) for r in taken] == [
        (task_row(db, r["id"])["priority"], task_row(db, r["id"])["run_at"]) for r in taken
    ]
    # Behind the mark: delayed, not lost. A claim without marks finds them.
    assert {task_row(db, i)["status"] for i in normal[:5]} == {"PENDING"}
    assert [r["id"] for r in claim(db, [])] == normal[:5]


def test_marks_in_two_bands_read_each_band_after_its_own_mark(basic: ModuleType, db: Conn) -> None:
    high = sorted(h.id for h in basic.noop.with_options(priority=5).send_many([()] * 4))
    normal = sorted(h.id for h in basic.noop.send_many([()] * 4))
    middle = sorted(h.id for h in basic.noop.with_options(priority=2).send_many([()] * 2))
    lowest = sorted(h.id for h in basic.noop.with_options(priority=-100).send_many([()] * 2))
    highest = sorted(h.id for h in basic.noop.with_options(priority=100).send_many([()] * 2))

    taken = claim(db, [place(db, high[1]), place(db, normal[2])])

    assert [r["id"] for r in taken] == [*highest, *high[2:], *middle, *normal[3:], *lowest]


def test_a_mark_moves_only_over_rows_the_claim_took(basic: ModuleType, db: Conn) -> None:
    """A worker with both kinds of child reads rows of a kind it has no room for and leaves
    them: no mark may pass them, so only the rows taken before the first one left advance."""
    first = basic.noop.send().id
    second = basic.noop.send().id  # read, but the claim has room for one sync task only
    later = basic.echo_async.send("x").id

    taken = claim(db, [], limit=3, other_limit=1, async_limit=2, async_names=("echo_async",))

    assert {r["id"]: r["advance"] for r in taken} == {first: True, later: False}
    assert task_row(db, second)["status"] == "PENDING"


def test_a_paused_queue_is_not_read_whatever_its_marks(basic: ModuleType, db: Conn) -> None:
    ids = sorted(h.id for h in basic.noop.send_many([()] * 3))
    assert basic.app.pause_queue("default")
    assert claim(db, [place(db, ids[0])]) == []
    assert claim(db, []) == []
    assert basic.app.resume_queue("default")
    assert [r["id"] for r in claim(db, [place(db, ids[0])])] == ids[1:]


def buffers_read(db: Conn, marks: list[tuple[int, datetime, Any]]) -> int:
    """Buffers the claim statement reads (hit or read) with ``marks``, its changes rolled back."""
    statement = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + q("claim_tasks")
    params = {
        "queues": ["default"], "limit": 10, "other_limit": 10, "async_limit": 0, "async_names": [],
        "worker_id": "w-1", "skip_names": [],
        "mark_queues": ["default"] * len(marks), "mark_priorities": [m[0] for m in marks],
        "mark_run_ats": [m[1] for m in marks], "mark_ids": [m[2] for m in marks],
    }  # fmt: skip
    with db.transaction(force_rollback=True):
        plan = psycopg.ClientCursor(db).execute(statement, params).fetchone()
    assert plan is not None
    top = (plan["QUERY PLAN"] if isinstance(plan, dict) else plan[0])[0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def test_under_a_held_vacuum_a_drained_priority_with_a_mark_costs_no_walk_through_its_past(
    basic: ModuleType, db: Conn, held: Conn
) -> None:
    """A priority whose tasks were all claimed while the vacuum is held back keeps an index
    entry (and a row version) per task. A claim with a mark there reads neither, whether the
    queue is empty or another priority has work: neither the mark's range nor the probes
    for the other priorities walk them. Without marks, the claim reads them all."""
    ids = sorted(h.id for h in basic.noop.send_many([()] * 3000))
    mark: list[tuple[int, datetime, Any]] = []
    while taken := claim(db, mark, limit=500):
        mark = [(0, taken[-1]["run_at"], taken[-1]["id"])]
    assert mark == [place(db, ids[-1])]

    assert buffers_read(db, []) > 2000  # the hold works: from the start, its entries and rows
    assert buffers_read(db, mark) < 60  # empty queue, from the mark
    low = basic.noop.with_options(priority=-5).send().id
    high = basic.noop.with_options(priority=5).send().id
    assert buffers_read(db, mark) < 80  # a priority on each side, probed around the mark
    assert [r["id"] for r in claim(db, mark)] == [high, low]


def test_under_a_held_vacuum_work_behind_a_mark_is_announced_and_run_once(
    basic: ModuleType, db: Conn, workers: WorkerFactory, held: Conn, database_url: str
) -> None:
    """Higher priorities, delayed tasks coming due, give-backs of a paused queue and a send
    whose transaction started before the worker's claims passed its place, while the worker
    drains a backlog: each runs once, long before a full read could have found it."""
    early = psycopg.connect(database_url)  # its transaction starts now: its send's run_at is now()
    early.execute("BEGIN")
    early.execute("SELECT 1").fetchone()
    backlog = [uuid.uuid4().hex for _ in range(100)]
    backlog_ids = [h.id for h in basic.sleep.send_many([(0.05, t) for t in backlog])]
    worker = workers.start(APP, "--processes", "1", "--async-processes", "0", "--prefetch", "4", *NO_POLL)
    # The worker's first claim is a full read; the next comes a poll interval (60 s) later.
    # Everything must have run before then, found through marks and what announced it.
    full_read_due = time.monotonic() + 60.0
    wait_until(lambda: finished(db) >= 10, message="the backlog to be under way")

    urgent = [uuid.uuid4().hex for _ in range(5)]
    urgent_ids = [h.id for h in basic.record.with_options(priority=10).send_many([(t,) for t in urgent])]
    retried = uuid.uuid4().hex
    retried_id = basic.flaky.send(retried, 1).id  # fails once, retried 0.2 s later
    # Two delayed tasks announced: the retry (0.2 s) and due_soon (1 s), then sends due now and
    # give-backs: the worker keeps a timer for each (claim_triggers.py), none replaces another.
    due_soon = uuid.uuid4().hex
    due_soon_id = basic.record.schedule(1.0, due_soon).id
    late = uuid.uuid4().hex
    late_id = basic.record.with_options(connection=early).send(late).id
    early.commit()  # after the worker's claims passed the place its run_at gives it
    assert task_row(db, late_id)["run_at"] < task_row(db, backlog_ids[0])["run_at"]
    assert basic.app.pause_queue("default")  # gives back the claimed tasks no child has yet
    wait_until(
        lambda: (
            not db.execute(
                "SELECT 1 FROM tether_tasks WHERE status = 'CLAIMED' AND claimed_by_worker_id = %s",
                (worker.worker_id,),
            ).fetchall()
        ),
        message="the paused queue's claimed tasks to be given back",
    )
    assert basic.app.resume_queue("default")

    everything = [*backlog, *urgent, late, due_soon]
    names = {late: "late", retried: "retried", due_soon: "due_soon", **{t: "urgent" for t in urgent}}
    try:
        wait_until(
            lambda: all(runs(db, t) == 1 for t in everything) and runs(db, retried) == 2,
            timeout=max(1.0, full_read_due - time.monotonic() - 2.0),
            message="every task to run before the next full read",
        )
    except AssertionError as exc:
        missing = [names.get(t, "backlog") for t in [*everything, retried] if runs(db, t) == 0]
        raise AssertionError(f"{exc}; not run: {missing}; worker log: {worker.log()[-6000:]}") from None
    ids = [*backlog_ids, *urgent_ids, due_soon_id, late_id, retried_id]
    assert {task_row(db, i)["status"] for i in ids} == {"COMPLETED"}
    # The urgent ones were not held back behind the backlog's mark.
    last_backlog_start = max(task_row(db, i)["started_at"] for i in backlog_ids)
    assert max(task_row(db, i)["started_at"] for i in urgent_ids) < last_backlog_start
    assert task_row(db, due_soon_id)["started_at"] >= task_row(db, due_soon_id)["run_at"]
    worker.stop()


def test_a_task_behind_every_mark_that_nothing_announces_is_found_by_the_full_read(
    basic: ModuleType, db: Conn, workers: WorkerFactory, held: Conn
) -> None:
    """A row made PENDING at an early place without a notification (here by hand; in life a
    send that committed late while every worker was busy) waits at most for the next full
    read, once per poll interval: delayed, never lost."""
    backlog = [uuid.uuid4().hex for _ in range(200)]
    basic.sleep.send_many([(0.05, t) for t in backlog])
    worker = workers.start(APP, "--processes", "1", "--poll-interval-ms", "1000")
    wait_until(lambda: finished(db) >= 10, message="the backlog to be under way")
    hidden = uuid.uuid4().hex
    hidden_id = db.execute(
        "INSERT INTO tether_tasks (id, name, queue, args, run_at, enqueued_at)"
        " VALUES (gen_random_uuid(), 'record', 'default', %s::jsonb, now() - interval '1 hour',"
        " now() - interval '1 hour') RETURNING id",
        (f'["{hidden}"]',),
    ).fetchone()["id"]

    wait_until(
        lambda: task_row(db, hidden_id)["status"] == "COMPLETED",
        timeout=20,
        message="the unannounced task to run",
    )
    assert runs(db, hidden) == 1
    left = db.execute("SELECT count(*) AS n FROM tether_tasks WHERE status = 'PENDING'").fetchone()["n"]
    assert left > 0  # found while the backlog was still waiting: by the full read, not by running dry
    wait_until(lambda: all(runs(db, t) == 1 for t in backlog), timeout=40, message="the backlog to finish")
    worker.stop()
