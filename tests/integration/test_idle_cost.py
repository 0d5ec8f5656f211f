"""What an idle worker costs the database: one round trip per poll interval, no more.

The round trips are counted on the wire (tests/wire_counter.py), each with the connection
and statement it came from, in an exact window: PostgreSQL's counters are per database and
reach ``pg_stat_database`` late (when a backend goes idle; up to 10 s later when it stays
idle). The worker runs with the default poll interval of 1 s, and with heartbeat and
reaper intervals of a minute, so that neither falls in the 10 s window: they are governed
by their own settings (docs/operations.md).

Without a pre-use check, a pooled connection that died while the worker sat idle is found
dead by the statement itself, which then runs again on another connection: tested here
with real worker processes whose connections the server terminated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.conftest import WorkerFactory, wait_until
from tests.wire_counter import Transaction, WireCounter
from tether.broker.queries import q
from tether.broker.worker_pool import WorkerPool
from tether.config import AppConfig, PostgresConfig, RecoveryConfig

APP = "tests.apps.basic:app"
POLL_S = 1.0
WINDOW_S = 10.0
#: Heartbeats and reaper ticks a minute apart: none of them in the window.
IDLE_ENV = {
    "TETHER_WORKER_POLL_INTERVAL_MS": str(int(POLL_S * 1000)),
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "60000",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "60000",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "120000",
    "TETHER_RUNNING_STALE_THRESHOLD_MS": "120000",
    "TETHER_CHECK_INTERVAL_MS": "60000",
}


@pytest.fixture
def proxy(database_url: str) -> Iterator[WireCounter]:
    with WireCounter(database_url) as counter:
        yield counter


def waiting_for_work(db: psycopg.Connection[Any], worker_id: str | None) -> bool:
    row = db.execute(
        "SELECT count(*) AS n FROM tether_queue_waiters WHERE worker_id = %s", (worker_id,)
    ).fetchone()
    return bool(row and row["n"])


def db_now(db: psycopg.Connection[Any]) -> Any:
    row = db.execute("SELECT clock_timestamp() AS now").fetchone()
    assert row is not None
    return row["now"]


def settled(db: psycopg.Connection[Any], since: Any) -> bool:
    """The worker started after ``since`` listens, and its pool has been used since its listener
    connected and idle for 1 s since. (From the listener's connecting, not its last statement:
    it sends its LISTENs again to read the server's clock anew while a reading was slow.)"""
    row = db.execute(
        "WITH mine AS (SELECT * FROM pg_stat_activity"
        "   WHERE datname = current_database() AND backend_start >= %(since)s)"
        " SELECT (SELECT max(backend_start) FROM mine"
        "          WHERE query LIKE 'LISTEN tether_work%%' AND state = 'idle') AS listening,"
        "        (SELECT max(state_change) FROM mine WHERE application_name = 'tether-worker') AS pool_used,"
        "        (SELECT count(*) FROM mine"
        "          WHERE application_name = 'tether-worker' AND state <> 'idle') AS busy,"
        "        clock_timestamp() AS now",
        {"since": since},
    ).fetchone()
    assert row is not None
    return bool(
        row["listening"] is not None
        and row["pool_used"] is not None
        and row["pool_used"] > row["listening"]
        and not row["busy"]
        and (row["now"] - row["pool_used"]).total_seconds() >= 1.0
    )


@pytest.mark.timing
# What tether sends is counted, not how the server answers: the embedded server's run is enough.
@pytest.mark.server_agnostic
@pytest.mark.direct_only(
    "counts the round trips between a worker and its server through a proxy of its own, in "
    "place of any pooler"
)
def test_idle_round_trips_of_a_worker_counted_over_10_s(
    db: psycopg.Connection[Any], proxy: WireCounter, workers: WorkerFactory
) -> None:
    # (proxy before workers: the worker is killed before the proxy stops under it)
    worker = workers.start(APP, "--processes", "1", env={**IDLE_ENV, "TETHER_DATABASE_URL": proxy.url})
    # Idle: its claims found nothing and it registered as waiting for work.
    wait_until(lambda: waiting_for_work(db, worker.worker_id), timeout=30, message="the worker to wait")

    # Its start-up is over: the heartbeat writer and the reaper each did their first round,
    # and neither has said anything for a while (both now sleep for a minute). And the claim
    # is prepared: psycopg prepares a statement on its 6th run on a connection, which costs
    # one more round trip, once (after 5 polls here).
    def steady() -> bool:
        trips = proxy.round_trips()
        names = {t.application_name for t in trips}
        quiet = all(time.monotonic() - t.at > 0.5 for t in trips if t.application_name != "tether-worker")
        prepared = any(t.prepares and t.application_name == "tether-worker" for t in trips)
        return {"tether-heartbeat", "tether-maintenance"} <= names and quiet and prepared

    wait_until(steady, timeout=30, interval=0.05, message="the worker's start-up round trips to end")

    t0 = time.monotonic()
    time.sleep(WINDOW_S)  # the measurement window itself
    trips = proxy.round_trips(t0, t0 + WINDOW_S)
    assert worker.proc.poll() is None, worker.log()

    polls = int(WINDOW_S / POLL_S)
    breakdown = f"{len(trips)} round trips in {WINDOW_S:g}s:\n{WireCounter.summary(trips)}"
    # One per poll, plus one for a poll at either edge of the window.
    assert len(trips) <= polls + 1, breakdown
    # And the poll really happens: a count that cannot fall short proves nothing.
    assert len(trips) >= polls - 2, breakdown
    print(f"\n{breakdown}")


def _starts(name: str) -> str:
    """How a transaction of tether's statement ``name`` starts on the wire (its label's head)."""
    return " ".join(q(name).split())[:40]


CLAIM, BEAT = _starts("claim_tasks"), _starts("write_heartbeats")
REAPER_PASS, REAPER_READ = _starts("claim_reaper_pass"), _starts("reaper_pass_due_in")
NEXT_SLOT = _starts("next_slot_in")
LIMITS_READ = _starts("queue_limits_of")
#: Retention's batches (worker/retention.py, once a minute): in a database with nothing old
#: enough to delete, each deletes no row, and is a read.
PRUNES = tuple(
    _starts(name)
    for name in (
        "prune_heartbeats",
        "prune_worker_states",
        "prune_workers",
        "prune_terminal_tasks",
        "prune_workflows",
        "prune_recovery_minutes",
        "prune_events",
    )
)


def _kind(tx: Transaction) -> str:
    """What a transaction of a worker is, by its first statement; a claim that updated no row
    (its command tag says so) is a read: it wrote nothing. A reaper pass that carried the
    worker's beat (worker/beat_rides.py) is one transaction, one commit."""
    label = tx.label
    if not tx.tags:  # psycopg prepares a statement on its 6th run: a Parse alone, once
        return "prepare"
    if label.startswith(CLAIM):
        return "empty claim (read)" if tx.tags == ("UPDATE 0",) else "claim"
    if label.startswith(REAPER_PASS):
        return "pass with beat" if any(t.startswith(BEAT) for t in tx.labels) else "reaper pass"
    for head, kind in ((BEAT, "heartbeat"), (REAPER_READ, "reaper read")):
        if label.startswith(head):
            return kind
    if label.startswith(NEXT_SLOT):
        return "scheduler read"
    if label.startswith(LIMITS_READ):
        return "queue limits read"
    if label.startswith(PRUNES):
        return "retention (nothing to delete)"
    return f"other: {label}"


#: What writes: every other transaction of an idle worker is a read.
WRITES = ("heartbeat", "reaper pass", "pass with beat")
BEATS = ("heartbeat", "pass with beat")


def _count(kinds: list[str], of: tuple[str, ...]) -> int:
    return sum(kinds.count(kind) for kind in of)


def _steady(proxy: WireCounter, beats: int) -> bool:
    """Start-up is over: ``beats`` heartbeats written, a reaper pass done, the claim prepared."""
    kinds = [_kind(t) for t in proxy.transactions()]
    prepared = any(t.prepares and t.application_name == "tether-worker" for t in proxy.round_trips())
    passed = "reaper pass" in kinds or "pass with beat" in kinds
    return _count(kinds, BEATS) >= beats and passed and prepared


def _idle_window(
    db: psycopg.Connection[Any],
    proxy: WireCounter,
    workers: WorkerFactory,
    env: dict[str, str],
    window: float,
    *,
    settle_s: float,
    poll_s: float,
) -> tuple[list[str], str]:
    """Start an idle worker with ``env``, let its start-up end (two beats seen), then the kinds
    of the transactions it made over ``window`` seconds and their breakdown; all committed."""
    worker = workers.start(APP, "--processes", "1", env=env)
    wait_until(lambda: waiting_for_work(db, worker.worker_id), timeout=30, message="the worker to wait")
    wait_until(
        lambda: _steady(proxy, beats=2), timeout=settle_s, interval=poll_s, message="the start-up to end"
    )
    t0 = time.monotonic()
    time.sleep(window)
    txs = proxy.transactions(t0, t0 + window)
    assert worker.proc.poll() is None, worker.log()
    breakdown = f"{len(txs)} transactions in {window:g}s:\n{WireCounter.transaction_summary(txs)}"
    assert all(t.committed for t in txs), breakdown
    return [_kind(t) for t in txs], breakdown


@pytest.mark.timing
# What tether sends is counted, not how the server answers: the embedded server's run is enough.
@pytest.mark.server_agnostic
@pytest.mark.direct_only(
    "counts the transactions between a worker and its server through a proxy of its own, in "
    "place of any pooler"
)
def test_an_idle_worker_commits_its_heartbeat_and_the_reaper_pass_and_claims_only_read(
    db: psycopg.Connection[Any], proxy: WireCounter, workers: WorkerFactory
) -> None:
    """Every transaction of an idle worker, counted on the wire (tests/wire_counter.py) and
    accounted for. The default settings' shape, scaled down so that a 10 s window holds five
    heartbeat intervals: heartbeats and the reaper's check interval equal (30 s by default,
    2 s here), the poll at its default 1 s."""
    interval = 2.0
    env = {
        "TETHER_WORKER_POLL_INTERVAL_MS": "1000",
        "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "2000",
        "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "2000",
        "TETHER_CLAIMED_STALE_THRESHOLD_MS": "120000",
        "TETHER_RUNNING_STALE_THRESHOLD_MS": "300000",
        "TETHER_CHECK_INTERVAL_MS": "2000",
        "TETHER_DATABASE_URL": proxy.url,
    }
    kinds, breakdown = _idle_window(db, proxy, workers, env, WINDOW_S, settle_s=30, poll_s=0.05)
    intervals = WINDOW_S / interval

    # Every transaction is one of these: nothing else runs while the worker idles (the
    # listener sits in LISTEN and sends nothing; the scheduler's look rides on the beat; a
    # reaper that did the last pass claims the next without reading first).
    assert set(kinds) <= {*WRITES, "empty claim (read)", "prepare"}, breakdown
    assert kinds.count("prepare") <= 2, breakdown  # the heartbeat's and the pass's, once each
    # The claims found nothing and wrote nothing: one per poll (and one at an edge).
    polls = int(WINDOW_S / 1.0)
    assert polls - 2 <= kinds.count("empty claim (read)") <= polls + 1, breakdown
    # What writes: one commit per interval (an edge may add one). The heartbeat, once per
    # interval, and (alone in its fleet, this worker does every pass) the reaper's pass, once
    # per check interval: in one transaction, the pass riding on the beat.
    assert intervals - 1 <= _count(kinds, BEATS) <= intervals + 1, breakdown
    assert intervals - 1 <= _count(kinds, WRITES) <= intervals + 1, breakdown
    assert kinds.count("pass with beat") >= intervals - 1, breakdown  # the passes still happen
    print(f"\n{breakdown}")


# Not `timing`: it counts commits on its own proxy over three 30 s intervals (2 to 4), which
# other tests' load cannot move, and in the serial phase its two idle minutes were a quarter
# of that phase's time; it runs among the parallel tests.
@pytest.mark.timeout(300)  # three intervals of 30 s, after a start-up of one
# What tether sends is counted, not how the server answers: once per CI run (2.5 minutes) is enough.
@pytest.mark.server_agnostic
@pytest.mark.direct_only(
    "counts the transactions between a worker and its server through a proxy of its own, in "
    "place of any pooler"
)
def test_an_idle_worker_at_default_settings_commits_once_per_heartbeat_interval(
    db: psycopg.Connection[Any], proxy: WireCounter, workers: WorkerFactory
) -> None:
    """The same count at tether's default settings, unscaled, over three heartbeat intervals
    (30 s each; the reaper's check interval is 30 s too, the poll 1 s): at most one commit
    per interval, the heartbeat and the fleet's pass in one transaction."""
    interval = 30.0
    window = 3 * interval
    defaults = RecoveryConfig()
    assert defaults.claimer_heartbeat_interval_ms == defaults.check_interval_ms == interval * 1000
    # Stated, so that nothing in the environment moves them: tether's defaults.
    env = {
        "TETHER_WORKER_POLL_INTERVAL_MS": "1000",
        "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": str(defaults.claimer_heartbeat_interval_ms),
        "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": str(defaults.runner_heartbeat_interval_ms),
        "TETHER_CLAIMED_STALE_THRESHOLD_MS": str(defaults.claimed_stale_threshold_ms),
        "TETHER_RUNNING_STALE_THRESHOLD_MS": str(defaults.running_stale_threshold_ms),
        "TETHER_CHECK_INTERVAL_MS": str(defaults.check_interval_ms),
        "TETHER_DATABASE_URL": proxy.url,
    }
    kinds, breakdown = _idle_window(db, proxy, workers, env, window, settle_s=75, poll_s=0.1)
    writes = _count(kinds, WRITES)
    # Three intervals: three commits, and one more for a beat at either edge of the window.
    assert 2 <= writes <= 4, breakdown
    assert kinds.count("pass with beat") >= 2, breakdown  # the fleet's passes still happen
    # Nothing else commits: the rest are reads (claims that found nothing, and once a
    # minute, the queue limits' look and retention's batches, with nothing old enough).
    reads = {"empty claim (read)", "prepare", "queue limits read", "retention (nothing to delete)"}
    assert set(kinds) <= {*WRITES, *reads}, breakdown
    print(f"\n{breakdown}")


@pytest.mark.timing
# What tether sends is counted, not how the server answers: the embedded server's run is enough.
@pytest.mark.server_agnostic
@pytest.mark.direct_only(
    "counts the transactions between a worker and its server through a proxy of its own, in "
    "place of any pooler"
)
def test_a_worker_whose_children_are_all_busy_commits_once_a_second_and_does_not_poll(
    db: psycopg.Connection[Any], proxy: WireCounter, workers: WorkerFactory, basic: Any
) -> None:
    """commits_per_second's shape (bench/README.md) on two children: every child runs a long
    task, heartbeats and the reaper's check every second, the default prefetch (room for 8
    tasks, 2 of them taken). A poll could only find tasks to hold until a child frees: it
    waits for that (claim_triggers.py). One transaction a second: the beat, with the reaper's
    pass riding on it (nothing turns stale before the check interval). Then, with nothing
    notifying (no waiter row), a task sent meanwhile is claimed as soon as a child frees: the
    deferred poll."""
    env = {
        "TETHER_WORKER_POLL_INTERVAL_MS": "1000",
        "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
        "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
        "TETHER_CLAIMED_STALE_THRESHOLD_MS": "2000",
        "TETHER_RUNNING_STALE_THRESHOLD_MS": "2000",
        "TETHER_CHECK_INTERVAL_MS": "1000",
        "TETHER_DATABASE_URL": proxy.url,
    }
    # No async child: an idle one would have room to run what a poll finds.
    worker = workers.start(APP, "--processes", "2", "--async-processes", "0", env=env)
    wait_until(lambda: waiting_for_work(db, worker.worker_id), timeout=30, message="the worker to wait")
    long_s = WINDOW_S + 8.0
    first = basic.sleep.send(long_s)
    second = basic.sleep.send(long_s + 3.0)
    wait_until(
        lambda: (
            db.execute(
                "SELECT count(*) AS n FROM tether_tasks WHERE status = 'RUNNING' AND id = ANY(%s)",
                ([first.id, second.id],),
            ).fetchone()["n"]
            == 2
        ),
        timeout=30,
        message="both tasks to run",
    )
    since = time.monotonic()
    # Steady: runner heartbeats relayed, a pass done since both started, a poll due and waiting.
    wait_until(
        lambda: sum(_kind(t) in BEATS for t in proxy.transactions(since)) >= 2,
        timeout=30,
        interval=0.05,
        message="two beats since both tasks started",
    )

    t0 = time.monotonic()
    time.sleep(WINDOW_S / 2)
    # Nobody is told of the next send: only a poll can find it.
    db.execute("DELETE FROM tether_queue_waiters")
    third = basic.add.send(1, 2)
    time.sleep(WINDOW_S / 2)
    txs = proxy.transactions(t0, t0 + WINDOW_S)
    kinds = [_kind(t) for t in txs]
    breakdown = f"{len(txs)} transactions in {WINDOW_S:g}s:\n{WireCounter.transaction_summary(txs)}"
    assert worker.proc.poll() is None, worker.log()
    assert set(kinds) <= {*WRITES, "prepare"}, breakdown  # no claim: no child was free
    assert len(txs) <= WINDOW_S + 2, breakdown
    assert _count(kinds, BEATS) >= WINDOW_S - 1, breakdown
    assert kinds.count("pass with beat") >= WINDOW_S - 2, breakdown
    assert db.execute("SELECT status FROM tether_tasks WHERE id = %s", (third.id,)).fetchone() == {
        "status": "PENDING"
    }

    # The first child frees: the poll that waited claims at once.
    assert third.get(timeout=30).ok == 3, worker.log()
    row = db.execute(
        "SELECT (SELECT claimed_at FROM tether_tasks WHERE id = %s) - completed_at AS after"
        " FROM tether_tasks WHERE id = %s",
        (third.id, first.id),
    ).fetchone()
    assert row is not None and row["after"].total_seconds() < 0.5, row
    print(f"\n{breakdown}\nclaimed {row['after'].total_seconds() * 1000:.0f} ms after the first child freed")


@pytest.mark.direct_only(
    "ends the server session under a client and expects the client to see it: behind PgBouncer "
    "the session it ends is PgBouncer's, and no client is attached to it between transactions"
)
def test_a_worker_claims_and_runs_after_its_pooled_connections_died_while_idle(
    db: psycopg.Connection[Any], workers: WorkerFactory, basic: Any
) -> None:
    # A poll a minute apart: the claim that finds the dead connection is the one the
    # send's notification triggers, the one that must still claim the task.
    env = {**IDLE_ENV, "TETHER_WORKER_POLL_INTERVAL_MS": "60000"}
    since = db_now(db)
    worker = workers.start(APP, "--processes", "1", env=env)
    wait_until(lambda: waiting_for_work(db, worker.worker_id), timeout=30, message="the worker to wait")
    # Also done with what its listener's connecting sets off: a claim, and the registration
    # written again (the listener may connect after the first one). Seen on the server: the
    # pool's connection has been idle for a second since after the listener's LISTEN.
    wait_until(lambda: settled(db, since), timeout=30, interval=0.05, message="the worker to settle")

    # The main process's pool is the only 'tether-worker' connection of an idle worker (the
    # recorders of the main process and of its child connect on their first use).
    killed = db.execute(
        "SELECT pid, pg_terminate_backend(pid) AS ok FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'tether-worker'"
        " AND backend_start >= %s",
        (since,),
    ).fetchall()
    assert killed and all(r["ok"] for r in killed), killed
    gone = [r["pid"] for r in killed]
    wait_until(
        lambda: not db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)", (gone,)).fetchone(),
        timeout=10,
        message="the terminated sessions to end",
    )

    handle = basic.add.send(2, 3)
    result = handle.get(timeout=30)
    assert result.ok == 5, (result, worker.log())
    row = db.execute("SELECT status, attempt FROM tether_tasks WHERE id = %s", (handle.id,)).fetchone()
    assert row == {"status": "COMPLETED", "attempt": 1}, (row, worker.log())
    log = worker.log()
    warnings = [line for line in log.splitlines() if "WARNING" in line and "claiming:" in line]
    assert warnings and "dead" in warnings[0], log
    assert worker.proc.poll() is None and "Traceback" not in log, log
    print(f"\n{warnings[0]}")


@pytest.mark.direct_only(
    "ends the server session under a client and expects the client to see it: behind PgBouncer "
    "the session it ends is PgBouncer's, and no client is attached to it between transactions"
)
async def test_a_statement_on_a_dead_pooled_connection_runs_again_on_another(
    db: psycopg.Connection[Any], database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every connection of the worker's pool died at once: each is tried, found dead and dropped."""
    config = AppConfig(broker=PostgresConfig(database_url=database_url))
    pool = WorkerPool(database_url, config)
    await pool.open()
    try:

        async def one(conn: psycopg.AsyncConnection[Any]) -> Any:
            cur = await conn.execute("SELECT 1 AS one")
            return await cur.fetchone()

        async def hold(conn: psycopg.AsyncConnection[Any]) -> None:
            await conn.execute("SELECT pg_sleep(0.2)")

        # Three connections in the pool (its maximum): three statements at once.
        await asyncio.gather(*(pool.run("warming up", hold) for _ in range(3)))
        terminate = (
            "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = 'tether-worker'"
        )
        killed = db.execute(terminate).fetchone()
        assert killed is not None and killed["n"] >= 2, killed
        wait_until(
            lambda: db.execute(terminate.replace("pg_terminate_backend(pid)", "*")).fetchone() == {"n": 0},
            timeout=10,
            message="the terminated sessions to end",
        )
        assert await pool.run("probe", one) == {"one": 1}
        dead = [r for r in caplog.records if r.levelname == "WARNING" and "probe" in r.getMessage()]
        assert 1 <= len(dead) <= 3, [r.getMessage() for r in caplog.records]

        # An error that leaves the connection alive is the statement's own: raised, not repeated.
        calls = 0

        async def timed_out(conn: psycopg.AsyncConnection[Any]) -> None:
            nonlocal calls
            calls += 1
            await conn.execute("SET statement_timeout = 10")
            try:
                await conn.execute("SELECT pg_sleep(1)")
            finally:
                await conn.execute("RESET statement_timeout")

        with pytest.raises(psycopg.errors.QueryCanceled):
            await pool.run("sleepy", timed_out)
        assert calls == 1
    finally:
        await pool.close()
