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
from tests.wire_counter import WireCounter
from tether.broker.worker_pool import WorkerPool
from tether.config import AppConfig, PostgresConfig

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
    """The worker started after ``since`` listens, and its pool has been idle for 1 s since."""
    row = db.execute(
        "WITH mine AS (SELECT * FROM pg_stat_activity"
        "   WHERE datname = current_database() AND backend_start >= %(since)s)"
        " SELECT (SELECT max(state_change) FROM mine"
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
