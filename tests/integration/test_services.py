"""Each background service's tick on its own, against a real database; and their connection.

worker/services.py gives every service one shape: ``tick()`` does one round and says when
the next is due. Here each real service's round is called directly, in this process, and
what it did is read from the tables: the reaper requeues a stale claim and sleeps until the
next one is due, the scheduler sends a due slot once however many workers tick, the
heartbeat writes its one statement, the listener listens, hands on what it hears and
listens again after its connection was killed. tests/chaos/ runs the same services in real
worker processes through restarts, kills and network loss.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from tests.wire_counter import WireCounter
from tether import Tether, __version__
from tether.broker import workers
from tether.broker.heartbeats import Beat, BeatAnswer
from tether.broker.queries import q
from tether.config import AppConfig, PostgresConfig, RecoveryConfig
from tether.db.connection import DedicatedConnection
from tether.metrics import recovery_tally
from tether.worker.heartbeat import SNAPSHOT_EVERY, Heartbeat
from tether.worker.reaper import PRUNE_AGAIN_S, Reaper
from tether.worker.retention import Retention
from tether.worker.scheduler import Scheduler
from tether.worker.services import Services
from tether.worker.work_listener import WorkListener

Conn = psycopg.Connection[Any]
WAIT = 30.0
# The shortest thresholds RecoveryConfig allows: a claim is stale after 2 s without a beat.
QUICK = RecoveryConfig(
    claimer_heartbeat_interval_ms=1000,
    runner_heartbeat_interval_ms=1000,
    claimed_stale_threshold_ms=2000,
    running_stale_threshold_ms=2000,
    check_interval_ms=5000,
)


# No marks (worker/claim_marks.py): the claim reads each queue from its start.
NO_MARKS: dict[str, list[Any]] = {
    "mark_queues": [],
    "mark_priorities": [],
    "mark_run_ats": [],
    "mark_ids": [],
}


def app_config(url: str) -> AppConfig:
    return AppConfig(broker=PostgresConfig(database_url=url, connect_timeout_s=5), recovery=QUICK)


def claim(db: Conn, worker_id: str, limit: int = 1) -> list[str]:
    """Claim as ``worker_id`` with the worker's own statement; the ids claimed."""
    rows = db.execute(
        q("claim_tasks"),
        {
            "queues": ["default"],
            "limit": limit,
            "other_limit": limit,
            "async_limit": 0,
            "async_names": [],
            "worker_id": worker_id,
            "skip_names": [],
            **NO_MARKS,
        },
    ).fetchall()
    return [str(r["id"]) for r in rows]


def task(db: Conn, task_id: str) -> dict[str, Any]:
    row = db.execute(
        "SELECT status, attempt, claimed_by_worker_id AS owner FROM tether_tasks WHERE id = %s", (task_id,)
    ).fetchone()
    assert row is not None
    return dict(row)


def backends(db: Conn, role: str) -> list[int]:
    rows = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
        (f"tether-{role}",),
    ).fetchall()
    return [r["pid"] for r in rows]


def terminate(db: Conn, role: str) -> None:
    """Kill the backend(s) of ``role``'s connection, as a server restart or an operator would."""
    pids = backends(db, role)
    assert pids, f"no tether-{role} connection"
    db.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (pids,))
    deadline = time.monotonic() + WAIT
    while db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)).fetchone():
        assert time.monotonic() < deadline, "the terminated backends did not end"
        time.sleep(0.01)


def until_gone(db: Conn, role: str) -> None:
    """Until no backend of ``role`` is left (a closed connection's backend ends a moment later)."""
    deadline = time.monotonic() + WAIT
    while backends(db, role):
        assert time.monotonic() < deadline, f"tether-{role} still connected"
        time.sleep(0.01)


async def eventually(predicate: Any, what: str) -> None:
    """Until ``predicate()`` holds, letting the event loop (the services) run meanwhile."""
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# -- the connection every service gets -----------------------------------------------------


def test_a_reaper_behind_on_retention_prunes_again_soon_between_the_fleets_passes(
    database_url: str, db: Conn
) -> None:
    """One pass per check interval for the whole fleet must not slow pruning: the worker
    whose retention ran out of budget with rows left prunes again PRUNE_AGAIN_S later, on
    ticks where the fleet's pass is not due, until it has caught up."""
    db.execute(
        "INSERT INTO tether_heartbeats (task_id, sender_id, role, sent_at, hostname, pid) "
        "SELECT gen_random_uuid(), 'gone-1', 'runner', now() - interval '30 hours', 'h', 1 "
        "FROM generate_series(1, 2500)"
    )
    old = "SELECT count(*) AS n FROM tether_heartbeats WHERE sent_at < now() - interval '24 hours'"
    reaper = Reaper(database_url, app_config(database_url), heartbeat_interval_s=1.0, worker_id="w-1")
    reaper.retention = Retention(reaper.config, batch=1000, budget_s=0)  # one batch per tick
    try:
        done, wait = reaper.run_once()  # the fleet's pass is due: this worker does it, and prunes
        assert done is not None and reaper.retention.behind and wait == PRUNE_AGAIN_S
        assert db.execute(old).fetchone()["n"] == 1500
        done, wait = reaper.run_once()  # no pass due now, but pruning goes on
        assert done is None and reaper.retention.behind and wait == PRUNE_AGAIN_S
        assert db.execute(old).fetchone()["n"] == 500
        done, wait = reaper.run_once()  # caught up: back to the fleet's schedule
        assert done is None and not reaper.retention.behind and wait > PRUNE_AGAIN_S
        assert db.execute(old).fetchone()["n"] == 0
    finally:
        reaper.connection.close()


@pytest.mark.direct_only(
    "ends the server session under a client and expects the client to see it: behind PgBouncer "
    "the session it ends is PgBouncer's, and no client is attached to it between transactions"
)
def test_a_dedicated_connection_opens_on_first_use_and_again_after_it_was_lost(
    database_url: str, db: Conn
) -> None:
    connection = DedicatedConnection(database_url, app_config(database_url), "svc-test")
    assert backends(db, "svc-test") == []  # nothing opened until used
    try:
        first = connection.get()
        assert connection.get() is first
        assert first.execute("SELECT 1 AS one").fetchone() == {"one": 1}  # dict rows, autocommit
        terminate(db, "svc-test")
        with pytest.raises(psycopg.OperationalError):
            first.execute("SELECT 1")
        second = connection.get()
        assert second is not first and second.execute("SELECT 1 AS one").fetchone() == {"one": 1}
        assert len(backends(db, "svc-test")) == 1
    finally:
        connection.close()
    until_gone(db, "svc-test")


# -- the reaper ------------------------------------------------------------------------------


@pytest.mark.timing
async def test_a_reaper_tick_requeues_a_stale_claim_and_sleeps_until_the_next_is_due(
    basic: ModuleType, database_url: str, db: Conn
) -> None:
    ghost = f"gone-{uuid.uuid4().hex[:8]}"
    stale, fresh = (str(basic.add.send(i, i).id) for i in range(2))
    assert claim(db, ghost) == [stale]
    # Claimed a minute ago by a worker that never sent a claimer heartbeat: stale.
    db.execute("UPDATE tether_tasks SET claimed_at = now() - interval '1 minute' WHERE id = %s", (stale,))
    assert claim(db, ghost) == [fresh]  # claimed just now: stale in 2 s

    reaper = Reaper(database_url, app_config(database_url), heartbeat_interval_s=1.0)
    try:
        wait = await reaper.tick()
        assert task(db, stale) == {"status": "PENDING", "attempt": 1, "owner": None}
        assert task(db, fresh) == {"status": "CLAIMED", "attempt": 1, "owner": ghost}
        assert reaper.last is not None and [str(r.id) for r in reaper.last.requeued] == [stale]
        # Not the check interval (5 s): until the fresh claim turns stale, a little after 2 s
        # (and up to a tenth more: the jitter that spreads a fleet's wake-ups).
        assert 1.0 < wait <= 2.1 * 1.1, wait
        # The fleet's next pass is due then (tether_reaper): a tick before it does no pass.
        again = await reaper.tick()
        assert reaper.last is None and again <= wait * 1.1, again
    finally:
        await reaper.close()


@pytest.mark.direct_only(
    "ends the server session under a client and expects the client to see it: behind PgBouncer "
    "the session it ends is PgBouncer's, and no client is attached to it between transactions"
)
async def test_a_reaper_whose_connection_was_killed_fails_one_tick_logs_it_once_and_goes_on(
    basic: ModuleType, database_url: str, db: Conn, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tether.reaper")
    reaper = Reaper(database_url, app_config(database_url), heartbeat_interval_s=1.0)
    services = Services([reaper])
    services.start()
    try:
        await eventually(lambda: reaper.last is not None, "the reaper's first tick to end")
        terminate(db, "reaper")
        sent = str(basic.add.send(5, 6).id)
        assert claim(db, "gone-worker") == [sent]
        db.execute("UPDATE tether_tasks SET claimed_at = now() - interval '1 minute' WHERE id = %s", (sent,))
        db.execute("UPDATE tether_reaper SET next_pass_at = now()")  # the fleet's next pass: due now
        reaper.wake()  # the tick finds its connection dead, the next one (0.5 s later) reconnects
        await eventually(
            lambda: any(r.getMessage().startswith("reaper tick works again") for r in caplog.records),
            "the reaper's next tick to work",
        )
    finally:
        await services.close()
    assert task(db, sent)["status"] == "PENDING"
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "tether.reaper"]
    failed = [m for level, m in lines if level == "ERROR"]
    assert len(failed) == 1 and failed[0].startswith("reaper tick failed ("), lines
    until_gone(db, "reaper")  # closed with its service


# -- the scheduler ---------------------------------------------------------------------------


async def test_a_scheduler_tick_sends_a_due_slot_once_however_many_workers_tick(
    database_url: str, db: Conn
) -> None:
    config = app_config(database_url)
    app = Tether(AppConfig(broker=config.broker, recovery=QUICK))
    try:

        @app.task("services.beat")
        def beat(label: str) -> str:
            return label

        app.periodic("* * * * * *", beat, name="services-every-second", args=["s"])
        declared = list(app.schedules.values())
        one, two = (Scheduler(database_url, config, ["default"], declared) for _ in range(2))
        try:
            wait = await one.tick()  # stores the schedule; its first slot is within a second
            assert 0 < wait <= 1.01, wait
            due = db.execute("SELECT next_slot FROM tether_schedules WHERE name = 'services-every-second'")
            next_slot = due.fetchone()["next_slot"]
            await eventually(
                lambda: db.execute("SELECT now() > %s AS due", (next_slot,)).fetchone()["due"],
                "the first slot to come (database time)",
            )
            for _ in range(2):  # two workers, twice, at once
                await asyncio.gather(one.tick(), two.tick())
        finally:
            await one.close()
            await two.close()
        rows = db.execute(
            "SELECT schedule_slot AS slot, args FROM tether_tasks"
            " WHERE schedule_name = 'services-every-second'"
        ).fetchall()
        slots = [r["slot"] for r in rows]
        assert next_slot in slots and len(slots) == len(set(slots)), slots
        assert all(r["args"] == ["s"] for r in rows)
        sent = db.execute("SELECT slots_sent FROM tether_schedules WHERE name = 'services-every-second'")
        assert sent.fetchone()["slots_sent"] == len(slots)
    finally:
        app.close()


# -- the heartbeat ---------------------------------------------------------------------------


class Source:
    """What the heartbeat asks of a worker (heartbeat.BeatSource): a fixed set of held tasks."""

    def __init__(self, beat: Beat) -> None:
        self.beat = beat
        self.answers: list[BeatAnswer] = []

    @property
    def tasks_done(self) -> int:
        return 7

    def collect(self) -> Beat:
        return self.beat

    def answered(self, answer: BeatAnswer) -> None:
        self.answers.append(answer)


async def register(database_url: str, worker_id: str) -> None:
    async with await psycopg.AsyncConnection.connect(
        database_url, autocommit=True, row_factory=dict_row
    ) as c:
        await workers.register_worker(
            c,
            workers.Registration(
                worker_id=worker_id,
                hostname=socket.gethostname(),
                pid=os.getpid(),
                process_started_at=datetime.now(UTC),
                host_key="test",
                queues=["default"],
                processes=1,
                async_processes=0,
                async_concurrency=None,
                version=__version__,
                task_names=["add"],
            ),
        )


async def test_a_heartbeat_tick_is_one_statement_for_every_task_the_worker_holds(
    basic: ModuleType, database_url: str, db: Conn
) -> None:
    me = f"beating-{uuid.uuid4().hex[:8]}"
    await register(database_url, me)
    claimed, running = (str(basic.add.send(i, i).id) for i in range(2))
    assert sorted(claim(db, me, limit=2)) == sorted([claimed, running])
    db.execute("UPDATE tether_tasks SET status = 'RUNNING', started_at = now() WHERE id = %s", (running,))
    stranger = str(uuid.uuid4())  # a task this worker thinks it holds, which the database says it does not
    beat = Beat()
    beat.add(claimed, "claimer", os.getpid())
    beat.add(running, "runner", os.getpid())
    beat.add(stranger, "claimer", os.getpid())
    source = Source(beat)
    # Recoveries counted in this process by earlier tests (a reaper's pass in-process) would
    # add their statement (the next test's); a worker's process has only its own.
    recovery_tally.take()

    with WireCounter(database_url) as proxy:
        heartbeat = Heartbeat(
            proxy.url, app_config(database_url), me, socket.gethostname(), source, every=1.0
        )
        try:
            before = heartbeat.last_ok
            sent = time.monotonic()
            wait = await heartbeat.tick()
            # The next beat an interval after this one was sent (not after its answer came),
            # and the silence counted from the sending.
            assert 0.5 < wait <= 1.0
            assert before < sent <= heartbeat.last_ok
            wait = await heartbeat.tick()
            assert 0.5 < wait <= 1.0
        finally:
            await heartbeat.close()
        trips = [t for t in proxy.round_trips() if t.application_name == "tether-heartbeat"]
    assert len(trips) == 2, WireCounter.summary(trips)  # one round trip per beat, however many tasks

    rows = db.execute(
        "SELECT task_id::text AS task, role FROM tether_heartbeats WHERE sender_id = %s",
        (me,),
    ).fetchall()
    assert sorted((r["task"], r["role"]) for r in rows) == sorted(
        [(claimed, "claimer"), (running, "runner")] * 2
    )
    worker = db.execute(
        "SELECT status, last_heartbeat_at FROM tether_workers WHERE id = %s", (me,)
    ).fetchone()
    assert worker is not None and worker["status"] == "active" and worker["last_heartbeat_at"] is not None
    # A snapshot on the first beat, the next one SNAPSHOT_EVERY beats later.
    states = db.execute(
        "SELECT claimed, running, tasks_done FROM tether_worker_states WHERE worker_id = %s", (me,)
    )
    assert states.fetchall() == [{"claimed": 2, "running": 1, "tasks_done": 7}]  # as reported (collect)
    assert SNAPSHOT_EVERY > 2
    assert [set(a.lost) for a in source.answers] == [{stranger}, {stranger}]


async def test_a_heartbeat_after_recoveries_writes_their_tally_in_one_more_statement(
    basic: ModuleType, database_url: str, db: Conn
) -> None:
    me = f"beating-{uuid.uuid4().hex[:8]}"
    await register(database_url, me)
    recovery_tally.take()
    minute = datetime.now(UTC).replace(second=0, microsecond=0)
    recovery_tally.add("dead_child", 2, at=minute)
    recovery_tally.add("time_limit", 1, at=minute)
    recovery_tally.add("dead_child", 1, at=minute)
    db.execute(
        "INSERT INTO tether_recovery_minutes (minute, rule, n) VALUES (%s, 'dead_child', 5)", (minute,)
    )
    with WireCounter(database_url) as proxy:
        heartbeat = Heartbeat(
            proxy.url, app_config(database_url), me, socket.gethostname(), Source(Beat()), every=1.0
        )
        try:
            await heartbeat.tick()  # the beat, then the tally
            await heartbeat.tick()  # the beat alone: the tally was written
        finally:
            await heartbeat.close()
        trips = [t for t in proxy.round_trips() if t.application_name == "tether-heartbeat"]
    assert len(trips) == 3, WireCounter.summary(trips)
    rows = db.execute("SELECT minute, rule, n FROM tether_recovery_minutes ORDER BY rule").fetchall()
    # Added to what another worker recorded for the same minute and rule.
    assert [(r["minute"], r["rule"], r["n"]) for r in rows] == [
        (minute, "dead_child", 8),
        (minute, "time_limit", 1),
    ]
    assert recovery_tally.take() == {}


async def test_a_tally_whose_write_fails_is_kept_for_a_later_beat(
    basic: ModuleType, database_url: str, db: Conn
) -> None:
    me = f"beating-{uuid.uuid4().hex[:8]}"
    await register(database_url, me)
    recovery_tally.take()
    recovery_tally.add("hung_child", 1)
    # The table is away (renamed): the beat gets through, the tally's write does not.
    db.execute("ALTER TABLE tether_recovery_minutes RENAME TO tether_recovery_minutes_away")
    heartbeat = Heartbeat(
        database_url, app_config(database_url), me, socket.gethostname(), Source(Beat()), every=1.0
    )
    try:
        await heartbeat.tick()
        assert sum(recovery_tally.take().values()) == 1
    finally:
        db.execute("ALTER TABLE tether_recovery_minutes_away RENAME TO tether_recovery_minutes")
        await heartbeat.close()


# -- the work listener -----------------------------------------------------------------------


@pytest.mark.direct_only(
    "LISTENs on the URL it is given and ends that server session: behind a transaction pooler "
    "a worker LISTENs on listen_url, a direct URL (test_pgbouncer.py covers that)"
)
async def test_a_listener_tick_listens_hands_on_what_it_hears_and_listens_again_after_a_loss(
    database_url: str, db: Conn
) -> None:
    heard: list[tuple[str, Any]] = []
    listener = WorkListener(
        database_url,
        app_config(database_url),
        {"default"},
        on_work=lambda queue, run_at, due_in: heard.append(("work", (queue, run_at, due_in))),
        on_listening=lambda: heard.append(("listening", None)),
        on_schedules=lambda: heard.append(("schedules", None)),
        on_control=lambda verb, arguments: heard.append(("control", (verb, arguments))),
        listen_for_s=0.5,
    )
    try:
        assert await listener.tick() == 0.0
        assert heard == [("listening", None)]
        due = time.time() + 60
        db.execute("SELECT pg_notify('tether_work', 'other 1')")  # a queue it does not serve
        db.execute("SELECT pg_notify('tether_work', %s)", (f"default {due}",))
        db.execute("SELECT pg_notify('tether_schedules', 'default')")
        db.execute("SELECT pg_notify('tether_control', 'pause default')")
        del heard[:]
        while len(heard) < 3:
            assert await listener.tick() == 0.0
        assert [kind for kind, _ in heard] == ["work", "schedules", "control"]
        queue, run_at, due_in = heard[0][1]
        # due_in is counted by the listener's reading of the server's clock, which is behind
        # it by up to that reading's round trip (counted from the answer: never ahead).
        assert queue == "default" and run_at == due and 55 < due_in <= 60 + listener.clock.spread
        assert heard[2][1] == ("pause", ["default"])

        terminate(db, "listener")
        with pytest.raises(psycopg.OperationalError):
            await listener.tick()
        await listener.close()  # what the runner does after a failed round
        del heard[:]
        assert await listener.tick() == 0.0
        assert heard == [("listening", None)]  # the worker looks once for what it may have missed
        db.execute("SELECT pg_notify('tether_work', 'default 0')")
        while not heard[1:]:
            await listener.tick()
        assert heard[1][0] == "work"
    finally:
        await listener.close()
