"""send_async() on its loop's own connection (broker/loop_connections.py): durable, one per
loop, the pool for sends in flight together, a lost connection survived, closed with the app.

The producer's connections are told apart in pg_stat_activity by backend pid: the pool's
one connection (pool_max_size=1) runs every sync send, so its pid is known first.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import psycopg
import pytest

from tests.conftest import wait_until
from tests.integration.test_durable_sends import SENDS, producer
from tests.integration.test_durable_sends import app as app  # the fixture: producer() with one connection
from tether import Tether

_started: list[Any] = []


@pytest.fixture(autouse=True)
def since(db: psycopg.Connection[Any]) -> None:
    """This test's start (database time): connections opened before it are others' (a
    producer another test left open on the shared test database)."""
    row = db.execute("SELECT clock_timestamp() AS at").fetchone()
    assert row is not None
    _started[:] = [row["at"]]


def backends(db: psycopg.Connection[Any]) -> set[int]:
    """The producer's connections (application_name 'tether') opened during this test."""
    rows = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'tether'"
        " AND backend_start >= %s",
        (_started[0],),
    ).fetchall()
    return {r["pid"] for r in rows}


def pool_pid(app: Tether) -> int:
    with app.broker.connection() as conn:
        return int(conn.info.backend_pid)


def last_query(db: psycopg.Connection[Any], pid: int) -> dict[str, Any]:
    row = db.execute("SELECT query, query_start FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert row is not None
    return dict(row)


def stored(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) AS n FROM tether_tasks").fetchone()
    assert row is not None
    return int(row["n"])


def wal_syncs(db: psycopg.Connection[Any]) -> int:
    if db.info.server_version >= 180000:
        row = db.execute("SELECT sum(fsyncs) AS n FROM pg_stat_io WHERE object = 'wal'").fetchone()
    else:
        row = db.execute("SELECT wal_sync AS n FROM pg_stat_wal").fetchone()
    assert row is not None
    return int(row["n"])


@pytest.mark.timing
@pytest.mark.direct_only(
    "tells the loop's connection from the pool's by their server sessions; behind PgBouncer's "
    "transaction mode the server sessions are PgBouncer's, shared by every client"
)
def test_sequential_async_sends_run_durably_on_the_loops_own_connection(
    app: Tether, db: psycopg.Connection[Any]
) -> None:
    add = app.tasks["add"]
    pooled = pool_pid(app)

    async def main() -> int:
        await add.send_async(1, 1)  # a loop's first send takes the pool
        assert backends(db) == {pooled}
        await add.send_async(1, 1)  # its second opens the loop's connection
        (mine,) = backends(db) - {pooled}
        pool_started = last_query(db, pooled)["query_start"]
        before = wal_syncs(db)
        for _ in range(SENDS):
            await add.send_async(1, 2)
        # The loop's backend reports its WAL syncs lazily: made to report them now.
        done = await app.broker.loop_connections.run(lambda c: c.execute("SELECT pg_stat_force_next_flush()"))
        assert done[0].value == "written"
        # On the loop's connection: its backend ran the last statement, and the pool's ran
        # nothing since before the hundred sends.
        assert "pg_stat_force_next_flush" in last_query(db, mine)["query"]
        assert last_query(db, pooled)["query_start"] == pool_started
        return wal_syncs(db) - before

    syncs = asyncio.run(main())
    # Every send committed durably, each its own WAL sync (other backends only add to it).
    assert syncs >= SENDS
    assert stored(db) == SENDS + 2


def test_async_sends_in_flight_together_share_the_loops_connection_with_the_pool(
    database_url: str, db: psycopg.Connection[Any]
) -> None:
    app = producer(database_url, pool_max_size=2)
    try:
        add = app.tasks["add"]

        async def main() -> None:
            await add.send_async(0, 0)
            await add.send_async(0, 0)
            handles = await asyncio.gather(*(add.send_async(i, i) for i in range(40)))
            assert len({h.id for h in handles}) == 40

        asyncio.run(main())
        assert stored(db) == 42
        # The loop's one connection and at most the pool's two.
        assert len(backends(db)) <= 3
    finally:
        app.close()
        db.execute("DELETE FROM tether_tasks")


@pytest.mark.direct_only(
    "tells the loop's connection from the pool's by their server sessions; behind PgBouncer's "
    "transaction mode the server sessions are PgBouncer's, shared by every client"
)
def test_a_loop_connection_that_died_is_dropped_and_the_send_still_stored_once(
    app: Tether, db: psycopg.Connection[Any]
) -> None:
    add = app.tasks["add"]
    pooled = pool_pid(app)

    async def main() -> None:
        await add.send_async(1, 1)
        await add.send_async(1, 1)
        (mine,) = backends(db) - {pooled}
        db.execute("SELECT pg_terminate_backend(%s)", (mine,))
        wait_until(lambda: mine not in backends(db), timeout=10, message="the loop's backend to end")
        # Found dead by the statement itself: run by the pool instead, stored once.
        handle = await add.send_async(2, 2)
        row = db.execute("SELECT count(*) AS n FROM tether_tasks WHERE id = %s", (handle.id,)).fetchone()
        assert row == {"n": 1}
        await add.send_async(3, 3)  # and the loop gets a new connection of its own
        assert len(backends(db) - {pooled}) == 1 and mine not in backends(db)

    asyncio.run(main())
    assert stored(db) == 4


@pytest.mark.direct_only(
    "tells the loop's connection from the pool's by their server sessions; behind PgBouncer's "
    "transaction mode the server sessions are PgBouncer's, shared by every client"
)
def test_one_send_per_loop_opens_no_connection_and_a_loops_connection_goes_with_it(
    app: Tether, db: psycopg.Connection[Any]
) -> None:
    add = app.tasks["add"]
    pooled = pool_pid(app)
    for _ in range(10):  # asyncio.run(send_async()) in a sync program: a new loop each time
        asyncio.run(add.send_async(1, 1))
    assert backends(db) == {pooled}

    async def twice() -> None:
        await add.send_async(1, 1)
        await add.send_async(1, 1)

    asyncio.run(twice())
    gc.collect()  # the loop is gone: its connection is closed with it
    wait_until(lambda: backends(db) == {pooled}, timeout=10, message="the loop's connection to close")
    asyncio.run(twice())
    app.close()
    wait_until(lambda: backends(db) == set(), timeout=10, message="the app's connections to close")
    assert stored(db) == 14
