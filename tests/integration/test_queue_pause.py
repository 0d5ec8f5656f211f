"""Pausing and resuming queues (docs/queues.md), with real workers on a real database.

Proving that nothing is claimed takes watching for a while. Each such window here ends
on an event rather than a sleep: a task of another queue the same worker serves, sent
after the moment of interest, is claimed and completed. Its claim statement scanned
the paused queue too (a worker claims from all its queues in one statement), so had
the pause not held, the paused queue's older tasks would have been claimed with it.

The workers poll only every 5 s here, so a claim within 1 s of a resume can only come
from the notifications the resume sends, not from the fallback poll.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from rich.console import Console

import tether.cli
import tether.cli.common
from tests.apps.support import db_now, machinery_url, task_row
from tests.cli_support import run, run_json, tether_command
from tests.conftest import WorkerFactory, WorkerProcess, wait_until
from tether import QueueInfo, TaskStatus
from tether.broker import PostgresBroker
from tether.errors import InvalidOptionError, UnknownQueueError
from tether.queue_control import list_queues, pause_queue, resume_queue

Conn = psycopg.Connection[Any]
APP = "tests.apps.basic:app"
WAIT = 30.0
SLOW_POLL = ("--poll-interval-ms", "5000")


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables wide enough that no cell is cut (the commands print through tether.cli.common.console)."""
    monkeypatch.setattr(tether.cli.common, "console", Console(width=200))


@pytest.fixture(autouse=True)
def close_brokers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close the pool each in-process command opens (see test_cli.py)."""
    opened: list[PostgresBroker] = []
    original = tether.cli.common.open_broker

    def tracking(*args: Any, **kwargs: Any) -> PostgresBroker:
        broker = original(*args, **kwargs)
        opened.append(broker)
        return broker

    monkeypatch.setattr(tether.cli.common, "open_broker", tracking)
    yield
    for broker in opened:
        broker.close()


def rows_of(db: Conn, handles: list[Any]) -> list[dict[str, Any]]:
    ids = [h.id for h in handles]
    rows = db.execute(
        "SELECT id, status, attempt, claimed_at, completed_at FROM tether_tasks WHERE id = ANY(%s)", (ids,)
    ).fetchall()
    return [dict(r) for r in rows]


def statuses(db: Conn, handles: list[Any]) -> list[str]:
    return sorted(r["status"] for r in rows_of(db, handles))


def paused_row(db: Conn, queue: str) -> dict[str, Any] | None:
    row = db.execute("SELECT * FROM tether_paused_queues WHERE queue = %s", (queue,)).fetchone()
    return None if row is None else dict(row)


def other_queue_completes(basic: ModuleType) -> None:
    """The closing event of a watch window: a `default` task sent now is claimed and done."""
    assert basic.add.send(1, 2).get(timeout=WAIT).ok == 3


def stop_cleanly(worker: WorkerProcess) -> None:
    assert worker.stop() == 0, worker.log()
    assert "Traceback" not in worker.log(), worker.log()


# -- pause and resume with a worker ---------------------------------------------------


@pytest.mark.timing
def test_pause_holds_new_sends_lets_the_running_task_finish_and_resume_claims_within_1s(
    basic: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--queues", "images,default", "--processes", "2", *SLOW_POLL)
    images = basic.sleep.with_options(queue="images")
    running = images.send(1.0, token=uuid.uuid4().hex)
    wait_until(lambda: running.status() == TaskStatus.RUNNING, WAIT, message="the images task running")

    assert basic.app.pause_queue("images", by="test-ops") is True
    assert task_row(db, running.id)["status"] == "RUNNING"  # paused under it (it runs 1 s)
    assert basic.app.pause_queue("images", by="someone else") is False  # already paused: kept as it was
    pause = paused_row(db, "images")
    assert pause is not None and pause["paused_by"] == "test-ops"

    # Sends are still accepted while paused; they wait.
    held = [basic.record.with_options(queue="images").send(uuid.uuid4().hex) for _ in range(3)]
    assert statuses(db, held) == ["PENDING"] * 3

    # The task that was running goes on to the end.
    assert running.get(timeout=WAIT).ok == 1.0
    assert task_row(db, running.id)["status"] == "COMPLETED"
    # Its child is free now, and the worker claimed (the other queue's task is done): the
    # paused queue's tasks were scanned past, not claimed.
    other_queue_completes(basic)
    assert [(r["status"], r["attempt"], r["claimed_at"]) for r in rows_of(db, held)] == [
        ("PENDING", 0, None)
    ] * 3

    before_resume = db_now(db)  # the resume's own now() is later still
    assert basic.app.resume_queue("images", by="test-ops") is True
    assert basic.app.resume_queue("images") is False
    assert paused_row(db, "images") is None
    # Watched through the rows, not handle.get(): a waiter flags its row with an UPDATE,
    # and a claim running at that moment skips the locked row until the next poll (a
    # known race of get() right after a send, not of the resume).
    wait_until(
        lambda: all(r["claimed_at"] for r in rows_of(db, held)), WAIT, message="the held tasks claimed"
    )
    latency = max(r["claimed_at"] for r in rows_of(db, held)) - before_resume
    for handle in held:
        assert handle.get(timeout=WAIT).err is None
    print(f"resume -> last held task claimed: {latency.total_seconds() * 1000:.1f} ms")
    assert latency < timedelta(seconds=1), latency
    stop_cleanly(worker)


def test_a_paused_queue_leaves_the_other_queues_of_the_same_worker_alone(
    basic: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--queues", "images,default", "--processes", "2", *SLOW_POLL)
    assert basic.app.pause_queue("images") is True
    waiting = basic.add.with_options(queue="images").send_many([(i, i) for i in range(5)])
    served = basic.add.send_many([(i, 1) for i in range(20)])
    assert [h.get(timeout=WAIT).ok for h in served] == [i + 1 for i in range(20)]
    assert statuses(db, waiting) == ["PENDING"] * 5
    assert basic.app.resume_queue("images") is True
    assert [h.get(timeout=WAIT).ok for h in waiting] == [2 * i for i in range(5)]
    stop_cleanly(worker)


@pytest.mark.timing
def test_claims_stop_within_1s_of_a_pause_under_a_steady_stream_of_sends(
    basic: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--queues", "images,default", "--processes", "4", *SLOW_POLL)
    noop = basic.noop.with_options(queue="images")
    sent: list[Any] = []
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            sent.append(noop.send())
            time.sleep(0.005)

    sender = threading.Thread(target=stream, daemon=True)
    sender.start()
    try:
        wait_until(
            lambda: (
                db.execute(
                    "SELECT count(*) AS n FROM tether_tasks WHERE queue = 'images' AND status = 'COMPLETED'"
                ).fetchone()["n"]  # type: ignore[index]
                >= 50
            ),
            WAIT,
            message="the stream being worked off",
        )
        assert pause_queue(basic.app.broker, "images", by="test") is True
        pause = paused_row(db, "images")
        assert pause is not None
        sent_before_pause_returned = len(sent)
        # The window: the stream goes on for 200 more sends (over 1 s); each one notifies
        # the waiting worker, which claims: every one of those claims must skip the queue.
        wait_until(
            lambda: len(sent) >= sent_before_pause_returned + 200, WAIT, message="sends after the pause"
        )
    finally:
        stop.set()
        sender.join(10)
    other_queue_completes(basic)
    # Whatever was claimed before the pause ends; nothing of the queue is held any more.
    wait_until(
        lambda: (
            not db.execute(
                "SELECT 1 FROM tether_tasks WHERE queue = 'images' AND status IN ('CLAIMED', 'RUNNING')"
            ).fetchone()
        ),
        WAIT,
        message="the tasks claimed before the pause to finish",
    )
    last = db.execute("SELECT max(claimed_at) AS at FROM tether_tasks WHERE queue = 'images'").fetchone()
    assert last is not None
    after_pause = (last["at"] - pause["paused_at"]).total_seconds()
    print(f"pause -> last claim of the queue: {after_pause * 1000:+.1f} ms (sent {len(sent)} tasks)")
    assert after_pause < 1.0
    rows = rows_of(db, sent)
    assert len(rows) == len(sent)  # every send was accepted
    by_status: dict[str, int] = {}
    for r in rows:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    assert set(by_status) == {"COMPLETED", "PENDING"}, by_status
    # The tasks sent after pause_queue returned are all still waiting, never claimed.
    late = rows_of(db, sent[sent_before_pause_returned:])
    assert len(late) >= 200 and all(r["status"] == "PENDING" and r["attempt"] == 0 for r in late)
    stop_cleanly(worker)


@pytest.mark.timing
def test_a_pause_gives_back_claimed_tasks_no_child_was_handed(
    basic: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    # One child and room for four more claimed tasks: of five long tasks, the child runs
    # one, two are pushed to it ahead of time (dispatch.PUSH_AHEAD) and two wait in the
    # worker's main process, unhanded.
    worker = workers.start(
        APP, "--queues", "images,default", "--processes", "1", "--prefetch", "4", *SLOW_POLL
    )
    assert basic.add.with_options(queue="images").send(0, 0).get(timeout=WAIT).ok == 0  # child ready
    tasks = basic.sleep.with_options(queue="images").send_many([(0.8,)] * 5)
    wait_until(
        lambda: statuses(db, tasks) == ["CLAIMED"] * 4 + ["RUNNING"], WAIT, message="1 running, 4 claimed"
    )

    assert basic.app.pause_queue("images") is True
    wait_until(lambda: "PENDING" in statuses(db, tasks), WAIT, message="the unhanded tasks given back")
    given_back = [r for r in rows_of(db, tasks) if r["status"] == "PENDING"]
    # Both in one statement: once one is back, both are.
    assert len(given_back) == 2, rows_of(db, tasks)
    # Claimed once and given back: the claim's attempt number stays bumped.
    assert all(r["attempt"] == 1 and r["claimed_at"] is None for r in given_back)
    assert "queue images paused: giving back 2 claimed task(s)" in worker.log()

    # What the child was handed still runs, the running one and the two pushed to it.
    wait_until(
        lambda: statuses(db, tasks) == ["COMPLETED"] * 3 + ["PENDING"] * 2,
        WAIT,
        message="the handed tasks to finish",
    )
    other_queue_completes(basic)  # the child is free and the worker claimed: not from images
    assert statuses(db, tasks) == ["COMPLETED"] * 3 + ["PENDING"] * 2

    before_resume = db_now(db)
    assert basic.app.resume_queue("images") is True
    for handle in tasks:
        assert handle.get(timeout=WAIT).ok == 0.8
    first_claim = min(r["claimed_at"] for r in rows_of(db, tasks) if r["attempt"] == 2)
    latency = first_claim - before_resume
    print(f"resume -> first given-back task claimed again: {latency.total_seconds() * 1000:.1f} ms")
    assert latency < timedelta(seconds=1), latency
    stop_cleanly(worker)


# -- without a worker: the rows, the notifications, the refusals --------------------------


def test_pause_and_resume_notify_the_workers_channels(basic: ModuleType, database_url: str, db: Conn) -> None:
    with psycopg.connect(machinery_url(database_url), autocommit=True) as listener:
        listener.execute("LISTEN tether_control; LISTEN tether_work")
        assert basic.app.pause_queue("low", by="me") is True
        assert basic.app.pause_queue("low", by="me") is False  # no change, no notification
        before = db_now(db).timestamp()
        assert basic.app.resume_queue("low", by="me") is True
        assert basic.app.resume_queue("low", by="me") is False
        notes = [(n.channel, n.payload) for n in listener.notifies(timeout=0.5, stop_after=3)]
    assert notes[:2] == [("tether_control", "pause low"), ("tether_control", "resume low")]
    channel, payload = notes[2]
    queue, epoch = payload.split(" ")
    assert (channel, queue) == ("tether_work", "low")
    assert before <= float(epoch) <= before + 5


def test_bad_input_is_refused_and_changes_nothing(basic: ModuleType, database_url: str, db: Conn) -> None:
    broker = basic.app.broker
    with psycopg.connect(machinery_url(database_url), autocommit=True) as listener:
        listener.execute("LISTEN tether_control; LISTEN tether_work")
        for bad in ["", " ", "images\n", "a/b", "x" * 65]:
            with pytest.raises(InvalidOptionError, match=r"^queue must be a queue name: .*; got "):
                pause_queue(broker, bad)
            with pytest.raises(InvalidOptionError, match=r"^queue must be a queue name: .*; got "):
                resume_queue(broker, bad)
        with pytest.raises(InvalidOptionError, match=r"^queue must be a queue name: .*; got 5 \(int\)"):
            pause_queue(broker, 5)  # type: ignore[arg-type]
        with pytest.raises(InvalidOptionError, match=r"^by must be who asks: 1 to 200 printable"):
            pause_queue(broker, "images", by="x" * 201)
        with pytest.raises(InvalidOptionError, match=r"^also must be a queue name: .*; got 'bad name'"):
            list_queues(broker, also=["images", "bad name"])
        with pytest.raises(InvalidOptionError, match=r"^also must be a sequence of queue names"):
            list_queues(broker, also="images")

        # The app refuses a queue it does not declare, even a well-formed one.
        with pytest.raises(UnknownQueueError, match=r"queue 'video' is not declared"):
            basic.app.pause_queue("video")
        with pytest.raises(UnknownQueueError, match=r"queue 'video' is not declared"):
            basic.app.resume_queue("video")
        with pytest.raises(InvalidOptionError, match=r"^queue must be a queue name: .*; got ''"):
            basic.app.pause_queue("")

        assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}
        assert list(listener.notifies(timeout=0.3)) == []


# -- the overview -----------------------------------------------------------------------


def test_queues_overview_api_cli_table_and_json(basic: ModuleType, database_url: str, db: Conn) -> None:
    low = basic.add.with_options(queue="low")
    waiting = low.send_many([(1, 1), (2, 2)])
    assert low.send(3, 3).cancel()
    basic.add.schedule(timedelta(hours=1), 0, 0)  # default: PENDING, not due yet
    db.execute(
        "UPDATE tether_tasks SET run_at = run_at - interval '90 seconds' WHERE id = %s", (waiting[0].id,)
    )
    assert basic.app.pause_queue("images", by="ops") is True

    infos = {i.queue: i for i in basic.app.queues()}
    # Every declared queue is listed, with or without tasks.
    assert set(infos) == {"default", "images", "low"}
    assert isinstance(infos["low"], QueueInfo)
    assert infos["low"].counts == {
        "PENDING": 2,
        "CLAIMED": 0,
        "RUNNING": 0,
        "COMPLETED": 0,
        "FAILED": 0,
        "CANCELLED": 1,
        "EXPIRED": 0,
    }
    age = infos["low"].oldest_pending_age_s
    assert age is not None and 90 <= age < 90 + WAIT
    assert infos["default"].counts["PENDING"] == 1 and infos["default"].oldest_pending_age_s is None
    images = infos["images"]
    assert images.paused and images.paused_by == "ops" and images.paused_at is not None
    assert sum(images.counts.values()) == 0 and images.oldest_pending_age_s is None
    assert not infos["low"].paused and infos["low"].paused_at is None and infos["low"].paused_by is None

    # Without an app, the CLI lists the queues with tasks and the paused ones.
    listed = run_json(database_url, "queues")
    assert [q["queue"] for q in listed] == ["default", "images", "low"]
    by_name = {q["queue"]: q for q in listed}
    assert by_name["low"]["counts"] == infos["low"].counts
    assert by_name["images"]["paused"] is True and by_name["images"]["paused_by"] == "ops"
    assert by_name["low"]["oldest_pending_age_s"] >= 90
    # A paused queue nothing ever used is listed too; with --app, so is every declared queue.
    assert basic.app.resume_queue("images") is True
    pause_queue(basic.app.broker, "nobody-uses-this", by="ops")
    assert [q["queue"] for q in run_json(database_url, "queues")] == ["default", "low", "nobody-uses-this"]
    with_app = run_json(database_url, "queues", "--app", APP)
    assert [q["queue"] for q in with_app] == ["default", "images", "low", "nobody-uses-this"]

    table = run(database_url, "queues").stdout
    header = next(line for line in table.splitlines() if "PENDING" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")] == [
        "queue",
        "state",
        *[s.value for s in TaskStatus],
        "oldest due",
    ]
    low_row = next(line for line in table.splitlines() if line.startswith("│ low "))
    cells = [c.strip() for c in low_row.strip("│ ").split("│")]
    assert cells[:9] == ["low", "active", "2", "0", "0", "0", "0", "1", "0"]
    assert cells[9].startswith("1m 3")  # 90 s and a little: "1m 30s"
    assert "│ nobody-uses-this │ paused" in table
    assert "queue nobody-uses-this paused since " in table and " by ops" in table


# -- the commands that change a queue ---------------------------------------------------------


def test_queue_pause_and_resume_commands(basic: ModuleType, database_url: str, db: Conn) -> None:
    basic.add.with_options(queue="images").send(1, 1)

    paused = run(database_url, "queue", "pause", "images")
    assert paused.stdout.strip() == (
        "queue images paused; workers stop claiming from it within 1 s; running tasks go on; "
        "sends are still accepted"
    )
    assert "warning" not in paused.output
    row = paused_row(db, "images")
    assert row is not None and row["paused_by"].startswith("cli:") and "@" in row["paused_by"]

    again = run(database_url, "queue", "pause", "images", "--by", "someone-else")
    assert again.stdout.startswith("queue images was already paused (since ")
    assert again.stdout.strip().endswith(f", by {row['paused_by']}); nothing changed")
    assert paused_row(db, "images") == row  # unchanged

    resumed = run(database_url, "queue", "resume", "images", "--by", "ops")
    assert resumed.stdout.startswith("queue images resumed (it was paused since ")
    assert resumed.stdout.strip().endswith(f"by {row['paused_by']}); workers claim from it at once")
    assert paused_row(db, "images") is None
    not_paused = run(database_url, "queue", "resume", "images")
    assert not_paused.stdout.strip() == "queue images was not paused; nothing changed"

    # A name no task, worker or schedule ever used is accepted (the CLI has no app), with a warning.
    typo = run(database_url, "queue", "pause", "imgaes", "--by", "ops")
    assert typo.stdout.startswith("queue imgaes paused;")
    assert "warning: no task of queue imgaes is known" in typo.stderr
    assert paused_row(db, "imgaes") is not None
    assert (
        "warning: no task of queue imgaes is known"
        not in run(database_url, "queue", "resume", "imgaes").stderr
    )

    # A bad name: a usage error (exit code 2), nothing changed.
    bad = CliRunner().invoke(tether.cli.cli, ["queue", "pause", "", "--database-url", database_url])
    assert bad.exit_code == 2, bad.output
    assert "Invalid value for 'NAME': queue must be a queue name: 1 to 64 characters" in bad.output
    assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}


def test_queue_commands_as_a_user_runs_them(basic: ModuleType, database_url: str, db: Conn) -> None:
    """The real entry point, in a process of its own: exit codes and streams."""
    ok = tether_command(database_url, "queue", "pause", "low", "--by", "alice")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("queue low paused;")
    assert "INFO tether.queue_control: queue low paused by alice" in ok.stderr  # logged, with who asked
    assert paused_row(db, "low") is not None

    bad = tether_command(database_url, "queue", "resume", "bad/name")
    assert bad.returncode == 2
    assert "queue must be a queue name" in bad.stderr and "got 'bad/name'" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert paused_row(db, "low") is not None  # untouched

    again = tether_command(database_url, "queue", "resume", "low")
    assert again.returncode == 0 and again.stdout.startswith("queue low resumed (it was paused since ")
    assert paused_row(db, "low") is None
