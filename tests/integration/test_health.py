"""`tether health` against the test database: what it reports is what the server and the rows
say, and its exit code is 0 ok, 1 warning, 2 critical by the thresholds it is given.

A REPEATABLE READ transaction left open by the test holds the MVCC horizon; a worker stopped
with SIGSTOP goes silent (its listener's connection cut while it cannot reconnect); tasks
backdated in the queue show lag; rows deleted from a table with autovacuum off for it stay
dead until the test vacuums it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

import tether.cli
from tests.apps.support import machinery_url
from tests.cli_support import tether_command
from tests.conftest import WorkerFactory, wait_until
from tether.broker.queries import q

APP = "tests.apps.basic:app"
#: Heartbeats every second, stale after two (RecoveryConfig reads TETHER_* from the environment).
FAST = {
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "2000",
    "TETHER_RUNNING_STALE_THRESHOLD_MS": "2000",
    "TETHER_CHECK_INTERVAL_MS": "1000",
}
#: Every threshold far away, so that a test moves only the one it means to.
CALM = (
    "--transaction-warning-s", "3600", "--transaction-critical-s", "7200",
    "--horizon-warning-xids", "1000000000", "--horizon-critical-xids", "2000000000",
)  # fmt: skip

Conn = psycopg.Connection[Any]


def health(database_url: str, *args: str) -> tuple[int, dict[str, Any]]:
    """`tether health --json ARGS` in-process: (exit code, the parsed report)."""
    result = CliRunner().invoke(tether.cli.cli, ["health", *args, "--json", "--database-url", database_url])
    assert result.exit_code in (0, 1, 2), (result.exit_code, result.output, result.exception)
    report = json.loads(result.stdout)
    assert report["exit_code"] == result.exit_code
    assert report["status"] == ["ok", "warning", "critical"][result.exit_code]
    return result.exit_code, report


def check(report: dict[str, Any], name: str, subject: str | None = None) -> dict[str, Any]:
    found = [c for c in report["checks"] if c["check"] == name and subject in (None, c["subject"])]
    assert len(found) == 1, (name, subject, report["checks"])
    return found[0]


def not_ok(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["check"], c["subject"]) for c in report["checks"] if c["status"] != "ok"]


@pytest.fixture
def stopped() -> Iterator[list[int]]:
    """Process groups a test SIGSTOPped: continued at teardown (the workers fixture kills them)."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)


def test_a_long_open_repeatable_read_transaction_is_reported_with_its_horizon_age(
    database_url: str, db: Conn
) -> None:
    # Nothing holds the horizon before the test's own reader: a session of the test before
    # (in this process's database: a worker or a command it started) may still be ending its
    # last transaction, which CI once caught (a holder of age 0): wait for it to end.
    reports: list[tuple[int, dict[str, Any]]] = []

    def horizon_free() -> bool:
        reports.append(health(database_url))
        return check(reports[-1][1], "mvcc_horizon")["value"] is None

    wait_until(horizon_free, timeout=15, message="no session to hold the horizon before the test's reader")
    code, report = reports[-1]
    assert code == 0, not_ok(report)

    with psycopg.connect(machinery_url(database_url)) as reader:  # its server pid: a direct session
        reader.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        reader.execute("SELECT count(*) FROM tether_tasks").fetchone()  # its snapshot is taken
        holder = reader.info.backend_pid
        burnt = 50
        for _ in range(burnt):  # each a transaction of its own, with an xid: the horizon ages
            db.execute("SELECT pg_current_xact_id()")

        # Past the warning by its age in transactions only.
        code, report = health(database_url, *CALM, "--horizon-warning-xids", "10")
        assert code == 1, not_ok(report)
        horizon = check(report, "mvcc_horizon")
        assert not_ok(report) == [("mvcc_horizon", horizon["subject"])]
        assert horizon["subject"].startswith(f"session pid {holder} (")
        assert "idle in transaction" in horizon["subject"]
        assert (
            horizon["status"] == "warning" and horizon["value"] >= burnt and horizon["unit"] == "transactions"
        )
        assert (horizon["warning"], horizon["critical"]) == (10, 2_000_000_000)
        first = report["horizon_holders"][0]
        assert (first["kind"], first["pid"], first["state"]) == ("session", holder, "idle in transaction")
        assert first["xmin_age"] == horizon["value"]
        oldest = check(report, "oldest_transaction")
        assert oldest["status"] == "ok" and oldest["value"] > 0 and f"pid {holder}" in oldest["subject"]

        # Past the critical by its age in transactions; then by how long it has been open.
        code, report = health(
            database_url, *CALM, "--horizon-warning-xids", "10", "--horizon-critical-xids", "20"
        )
        assert code == 2 and check(report, "mvcc_horizon")["status"] == "critical"
        code, report = health(database_url, *CALM, "--transaction-warning-s", "0.001")
        assert code == 1 and not_ok(report) == [("oldest_transaction", oldest["subject"])]
        code, report = health(
            database_url, *CALM, "--transaction-warning-s", "0.001", "--transaction-critical-s", "0.002"
        )
        assert code == 2 and check(report, "oldest_transaction")["status"] == "critical"

        # The real command, as a monitor runs it: its exit code, and the table it prints.
        done = tether_command(database_url, "health", *CALM, "--horizon-warning-xids", "10")
        assert done.returncode == 1, done.stderr
        assert "mvcc_horizon" in done.stdout and "health: WARNING" in done.stdout
        assert f"session pid {holder}" in done.stdout

    # The transaction is over: nothing holds the horizon, and all is well again.
    code, report = health(database_url, "--horizon-warning-xids", "10")
    assert code == 0, not_ok(report)
    assert all(h["pid"] != holder for h in report["horizon_holders"])


def listener_name(worker_id: str) -> str:
    return "tether-listener " + worker_id[-47:]


def listeners(db: Conn, worker_id: str) -> list[int]:
    rows = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
        (listener_name(worker_id),),
    ).fetchall()
    return [r["pid"] for r in rows]


def heartbeat_age_s(db: Conn, worker_id: str) -> float:
    row = db.execute(
        "SELECT extract(epoch FROM clock_timestamp() - last_heartbeat_at)::float8 AS age, status"
        " FROM tether_workers WHERE id = %s",
        (worker_id,),
    ).fetchone()
    assert row is not None and row["status"] == "active", row
    return float(row["age"])


def test_a_silent_worker_shows_as_stale_and_its_lost_listener_as_missing(
    database_url: str, db: Conn, workers: WorkerFactory, stopped: list[int]
) -> None:
    worker = workers.start(APP, "--processes", "1", env=FAST)
    me = worker.worker_id
    assert me is not None
    wait_until(lambda: listeners(db, me), message="the worker's listener, named after it")
    beats = ("--heartbeat-warning-s", "3", "--heartbeat-critical-s", "3600")
    code, report = health(database_url, *beats)
    assert code == 0, not_ok(report)
    assert check(report, "worker_heartbeat", me)["value"] < 3
    assert check(report, "worker_listener", me)["status"] == "ok"
    assert [w["id"] for w in report["workers"]] == [me] and report["workers"][0]["listening"]

    os.killpg(worker.pid, signal.SIGSTOP)
    stopped.append(worker.pid)
    # Silent: nothing it wrote since. Its listener's connection outlives it until cut, and it
    # cannot connect again while stopped.
    wait_until(lambda: heartbeat_age_s(db, me) > 3.5, timeout=20, message="its heartbeat to age past 3.5s")
    db.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (listeners(db, me),))
    wait_until(lambda: not listeners(db, me), message="its listener's connection to be gone")
    code, report = health(database_url, *beats)
    assert code == 1
    assert sorted(not_ok(report)) == [("worker_heartbeat", me), ("worker_listener", me)]
    stale = check(report, "worker_heartbeat", me)
    assert stale["status"] == "warning" and stale["value"] >= 3.5 and stale["unit"] == "s"
    assert "no work listener connection" in check(report, "worker_listener", me)["detail"]
    code, report = health(database_url, "--heartbeat-warning-s", "1", "--heartbeat-critical-s", "3")
    assert code == 2 and check(report, "worker_heartbeat", me)["status"] == "critical"

    os.killpg(worker.pid, signal.SIGCONT)
    stopped.remove(worker.pid)

    def healthy_again() -> bool:
        code, report = health(database_url, *beats)
        return code == 0 and [w["id"] for w in report["workers"]] == [me]

    wait_until(healthy_again, timeout=30, interval=0.2, message="its heartbeat and listener to be back")
    assert listeners(db, me)
    worker.stop()
    code, report = health(database_url, *beats)
    assert code == 0 and report["workers"] == []


def test_queue_lag_counts_from_the_oldest_due_task_across_priorities(
    database_url: str, basic: ModuleType, db: Conn
) -> None:
    images = basic.add.with_options(queue="images")
    old = images.send(1, 1)
    basic.add.with_options(queue="images", priority=10).send(2, 2)  # claimed first, but younger
    basic.add.with_options(queue="low").schedule(timedelta(hours=1), 3, 3)  # not due
    paused = basic.add.send(4, 4)
    assert basic.app.pause_queue("default", by="test")
    # Due 90 s ago, 10 s ago and 200 s ago (the paused one): as if they had waited that long.
    for handle, seconds in ((old, 90), (paused, 200)):
        db.execute("UPDATE tether_tasks SET run_at = now() - %s * interval '1 second' WHERE id = %s",
                   (seconds, handle.id))  # fmt: skip
    db.execute(
        "UPDATE tether_tasks SET run_at = now() - interval '10 seconds' WHERE queue = 'images' AND id <> %s",
        (old.id,),
    )

    code, report = health(database_url, "--lag-warning-s", "60", "--lag-critical-s", "120")
    assert code == 1, not_ok(report)
    assert not_ok(report) == [("queue_lag", "images")]
    lag = check(report, "queue_lag", "images")
    assert lag["status"] == "warning" and lag["value"] >= 90 and lag["unit"] == "s"
    assert str(old.id) in lag["detail"] and "no active worker serves this queue" in lag["detail"]
    by_queue = {q["queue"]: q for q in report["queues"]}
    assert sorted(by_queue) == ["default", "images", "low"]
    assert by_queue["images"]["oldest_due_task_id"] == str(old.id)
    assert by_queue["low"]["oldest_due_age_s"] is None and check(report, "queue_lag", "low")["value"] is None
    # A paused queue waits by an operator's decision: its lag is shown, not judged.
    held = check(report, "queue_lag", "default")
    assert held["status"] == "ok" and held["value"] >= 200 and "paused" in held["detail"]

    code, report = health(database_url, "--lag-warning-s", "60", "--lag-critical-s", "80")
    assert code == 2 and check(report, "queue_lag", "images")["status"] == "critical"


def stats(db: Conn, table: str) -> dict[str, Any]:
    row = db.execute(
        "SELECT n_dead_tup, greatest(last_vacuum, last_autovacuum) AS vacuumed FROM pg_stat_user_tables"
        " WHERE relname = %s",
        (table,),
    ).fetchone()
    assert row is not None
    return dict(row)


def test_dead_rows_of_a_tether_table_and_its_last_vacuum(database_url: str, db: Conn) -> None:
    table = "tether_heartbeats"
    db.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")  # only the test vacuums it
    try:
        db.execute(
            f"INSERT INTO {table} (task_id, sender_id, role, sent_at, hostname, pid)"
            " SELECT gen_random_uuid(), 'w', 'runner', now(), 'h', 1 FROM generate_series(1, 500)"
        )
        db.execute(f"DELETE FROM {table}")
        db.execute("SELECT pg_stat_force_next_flush()")
        wait_until(
            lambda: stats(db, table)["n_dead_tup"] >= 500, message="the statistics to count 500 dead rows"
        )

        dead = ("--dead-tuples-warning", "100", "--dead-tuples-critical", "100000")
        code, report = health(database_url, *dead)
        assert code == 1
        assert ("dead_tuples", table) in not_ok(report)
        rows = check(report, "dead_tuples", table)
        assert rows["status"] == "warning" and rows["value"] >= 500 and rows["unit"] == "rows"
        (facts,) = [t for t in report["tables"] if t["table_name"] == table]
        assert facts["dead_rows"] == rows["value"] and facts["table_bytes"] > 0 and facts["index_bytes"] > 0
        size = check(report, "table_size", table)
        assert size["status"] == "ok" and size["warning"] is None  # no size threshold unless given
        code, report = health(database_url, *dead, "--table-size-warning-mb", "0.001")
        assert check(report, "table_size", table)["status"] == "warning"

        db.execute(f"VACUUM {table}")
        wait_until(lambda: stats(db, table)["n_dead_tup"] == 0, message="the vacuum to be counted")
        code, report = health(database_url, *dead)
        assert check(report, "dead_tuples", table)["status"] == "ok"
        (facts,) = [t for t in report["tables"] if t["table_name"] == table]
        assert facts["last_vacuum_at"] is not None and facts["vacuums"] >= 1
        assert "last vacuum" in check(report, "dead_tuples", table)["detail"]
    finally:
        db.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")


def test_the_queue_lag_walks_the_claim_index_whatever_the_backlog(database_url: str, db: Conn) -> None:
    """Six (queue, priority) pairs among 20,000 PENDING tasks: the statement reads a few index
    pages per pair, never the table's thousands."""
    db.execute(
        "INSERT INTO tether_tasks (id, name, queue, priority, run_at)"
        " SELECT gen_random_uuid(), 'add', CASE WHEN i % 2 = 0 THEN 'images' ELSE 'low' END,"
        "        (i % 3) * 10, now() - i * interval '1 millisecond'"
        " FROM generate_series(1, 20000) AS i"
    )
    db.execute("ANALYZE tether_tasks")
    row = db.execute("SELECT relpages FROM pg_class WHERE relname = 'tether_tasks'").fetchone()
    assert row is not None and row["relpages"] > 300
    plan = db.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + q("queue_lag")).fetchone()
    assert plan is not None
    top = next(iter(plan.values()))[0]
    assert ("Seq Scan", "tether_tasks") not in _scans(top["Plan"])
    assert ("Index Only Scan", "tether_tasks") in _scans(top["Plan"])
    pages = top["Plan"]["Shared Hit Blocks"] + top["Plan"]["Shared Read Blocks"]
    assert pages < 150, pages
    code, report = health(database_url)
    assert code == 0 and {q["queue"] for q in report["queues"]} == {"images", "low"}


def _scans(node: dict[str, Any]) -> list[tuple[str, str]]:
    """(node type, relation) of every node of a plan that reads a relation."""
    found = [(node["Node Type"], node["Relation Name"])] if "Relation Name" in node else []
    for child in node.get("Plans", []):
        found += _scans(child)
    return found


@pytest.mark.server_agnostic
@pytest.mark.parametrize(
    ("args", "named", "why"),
    [
        (["--lag-warning-s", "-1"], "--lag-warning-s", "not in the range x>0"),
        (["--dead-tuples-warning", "0"], "--dead-tuples-warning", "not in the range x>=1"),
        (["--horizon-critical-xids", "many"], "--horizon-critical-xids", "not a valid integer"),
        (["--table-size-warning-mb", "0"], "--table-size-warning-mb", "not in the range x>0"),
        (
            ["--heartbeat-warning-s", "10", "--heartbeat-critical-s", "5"],
            "--heartbeat-warning-s",
            "10 is above --heartbeat-critical-s (5): a warning must come before its critical",
        ),
        (
            ["--transaction-critical-s", "60"],  # below the default warning (300)
            "--transaction-warning-s",
            "300 is above --transaction-critical-s (60)",
        ),
    ],
)
def test_bad_thresholds_are_refused_naming_the_option(args: list[str], named: str, why: str) -> None:
    # No database: a refusal comes before anything is opened (this URL reaches nothing).
    result = CliRunner().invoke(
        tether.cli.cli, ["health", *args, "--database-url", "postgresql://nobody@127.0.0.1:1/none"]
    )
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert f"Invalid value for '{named}'" in result.stderr and why in result.stderr, result.stderr


@pytest.mark.server_agnostic
def test_an_unreachable_database_is_critical() -> None:
    result = CliRunner().invoke(
        tether.cli.cli, ["health", "--database-url", "postgresql://nobody@127.0.0.1:1/none"]
    )
    assert result.exit_code == 2, result.output
    assert "cannot connect to PostgreSQL at postgresql://nobody@127.0.0.1:1/none" in result.stderr


def test_a_task_waiting_for_a_slot_of_its_limit_is_not_late(
    database_url: str, basic: ModuleType, db: Conn
) -> None:
    """docs/limits.md: a flow-controlled queue whose tasks are moving keeps its due tasks
    waiting for a slot; that wait is shown, not judged. With nothing in flight it is lag."""
    db.execute("INSERT INTO tether_queue_limits (queue, max_in_flight) VALUES ('images', 1)")
    db.execute(
        "INSERT INTO tether_workers (id, hostname, pid, queues, processes)"
        " VALUES ('w-1', 'h', 1, '{images}', 1)"
    )
    images = basic.add.with_options(queue="images")
    running, waiting = images.send(1, 1), images.send(2, 2)
    db.execute("UPDATE tether_tasks SET run_at = now() - interval '90 seconds' WHERE id = %s", (waiting.id,))
    db.execute(
        "UPDATE tether_tasks SET status = 'RUNNING', attempt = 1, claimed_by_worker_id = 'w-1' WHERE id = %s",
        (running.id,),
    )
    _, report = health(database_url, "--lag-warning-s", "60", "--lag-critical-s", "120")
    lag = check(report, "queue_lag", "images")
    assert (
        lag["status"] == "ok"
        and lag["value"] >= 90
        and "waiting for its limits (1 in flight" in lag["detail"]
    )
    # Nothing in flight: the queue is stuck, not held back by its limit.
    db.execute("UPDATE tether_tasks SET status = 'COMPLETED' WHERE id = %s", (running.id,))
    _, report = health(database_url, "--lag-warning-s", "60", "--lag-critical-s", "120")
    assert check(report, "queue_lag", "images")["status"] == "warning"
