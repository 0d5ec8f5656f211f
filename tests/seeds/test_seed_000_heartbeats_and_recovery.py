"""Seed 000, "Heartbeats & Recovery": its examples, run as written (see conftest.py).

Covered: the RecoveryConfig examples and the threshold rule's error, the heartbeats table's
columns (and the two roles real workers write), the reaper's rules after a real kill, the
broker's three manual recovery calls (``app.get_broker()``) and what they print and return,
recovery disabled (tasks stay stuck until recovered by hand), and heartbeat cleanup, by
the reaper and by the seed's SQL.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from types import ModuleType
from typing import Any

import pytest

import tether
from tests.apps.support import attempt_rows, task_row
from tests.chaos.conftest import APP, FAST, last_heartbeat, runs, token, wait_status, worker_row
from tests.conftest import WorkerFactory, wait_until
from tests.seeds.conftest import age_rows, as_tether, run_example

pytestmark = pytest.mark.usefixtures("db")

NAMES: dict[str, Any] = {name: getattr(tether, name) for name in tether.__all__}

RECOVERY_CONFIG_EXAMPLE = """
from horsies.core.models.recovery import RecoveryConfig
config = AppConfig(
    broker=PostgresConfig(...),
    recovery=RecoveryConfig(
        # Claimer detection
        auto_requeue_stale_claimed=True,
        claimed_stale_threshold_ms=120_000, # 2 minutes
        claimer_heartbeat_interval_ms=30_000, # 30 seconds
        # Runner detection
        auto_fail_stale_running=True,
        running_stale_threshold_ms=300_000, # 5 minutes
        runner_heartbeat_interval_ms=30_000, # 30 seconds
        # Check frequency
        check_interval_ms=30_000, # 30 seconds
    ),
)
"""

VALID_EXAMPLE = """
# Valid
RecoveryConfig(
    runner_heartbeat_interval_ms=30_000, # 30s
    running_stale_threshold_ms=60_000, # 60s (2x)
)
"""

INVALID_EXAMPLE = """
# Invalid - will raise ValueError
RecoveryConfig(
    runner_heartbeat_interval_ms=30_000, # 30s
    running_stale_threshold_ms=30_000, # 30s (too tight!)
)
"""

CPU_HEAVY_EXAMPLE = """
RecoveryConfig(
    runner_heartbeat_interval_ms=60_000, # Heartbeat every minute
    running_stale_threshold_ms=300_000, # 5 minutes before stale
)
"""

FAST_TASKS_EXAMPLE = """
RecoveryConfig(
    runner_heartbeat_interval_ms=10_000, # 10 seconds
    running_stale_threshold_ms=30_000, # 30 seconds
)
"""

FALSE_POSITIVES_EXAMPLE = """
RecoveryConfig(
    running_stale_threshold_ms=600_000, # 10 minutes
)
"""

NOT_RECOMMENDED_EXAMPLE = """
RecoveryConfig(
    auto_requeue_stale_claimed=False,
    auto_fail_stale_running=False,
)
"""

QUERY_STALE_EXAMPLE = """
broker = app.get_broker()
# Find stale RUNNING tasks
stale = await broker.get_stale_tasks(stale_threshold_minutes=5)
for task in stale:
    print(f"Stale: {task['id']} on {task['worker_hostname']}")
"""

FORCE_RECOVERY_EXAMPLE = """
# Manually fail stale RUNNING
failed = await broker.mark_stale_tasks_as_failed(stale_threshold_ms=300_000)
print(f"Failed {failed} stale tasks")
# Manually requeue stale CLAIMED
requeued = await broker.requeue_stale_claimed(stale_threshold_ms=120_000)
print(f"Requeued {requeued} stale tasks")
"""

HEARTBEAT_CLEANUP_SQL = """
-- Delete heartbeats older than 24 hours
DELETE FROM horsies_heartbeats WHERE sent_at < NOW() - INTERVAL '24 hours';
"""

#: Recovery in seconds with the automatic rules switched off (the "not recommended" example).
NO_AUTO_RECOVERY = {
    **FAST,
    "TETHER_AUTO_REQUEUE_STALE_CLAIMED": "false",
    "TETHER_AUTO_FAIL_STALE_RUNNING": "false",
}


async def test_the_recovery_config_example_configures_an_app(database_url: str) -> None:
    namespace = dict(NAMES)
    await run_example(RECOVERY_CONFIG_EXAMPLE, namespace, database_url)
    config = namespace["config"]
    assert isinstance(config, tether.AppConfig)
    recovery = config.recovery
    assert (recovery.auto_requeue_stale_claimed, recovery.auto_fail_stale_running) == (True, True)
    assert (recovery.claimed_stale_threshold_ms, recovery.claimer_heartbeat_interval_ms) == (120_000, 30_000)
    assert (recovery.running_stale_threshold_ms, recovery.runner_heartbeat_interval_ms) == (300_000, 30_000)
    assert recovery.check_interval_ms == 30_000
    with tether.Tether(config) as app:
        assert app.get_broker() is app.broker
        assert app.get_broker().url == database_url  # the config's database, reached


async def test_the_threshold_examples_and_the_error_of_the_invalid_one() -> None:
    for example, interval, threshold in (
        (VALID_EXAMPLE, 30_000, 60_000),
        (CPU_HEAVY_EXAMPLE, 60_000, 300_000),
        (FAST_TASKS_EXAMPLE, 10_000, 30_000),
        (FALSE_POSITIVES_EXAMPLE, 30_000, 600_000),
    ):
        namespace = dict(NAMES)
        await run_example(example, namespace)
        made = namespace["_"]
        assert (made.runner_heartbeat_interval_ms, made.running_stale_threshold_ms) == (interval, threshold)
    namespace = dict(NAMES)
    await run_example(NOT_RECOMMENDED_EXAMPLE, namespace)
    assert (namespace["_"].auto_requeue_stale_claimed, namespace["_"].auto_fail_stale_running) == (
        False,
        False,
    )

    with pytest.raises(ValueError, match=r"running_stale_threshold_ms \(30000\) must be at least 2 x") as err:
        await run_example(INVALID_EXAMPLE, dict(NAMES))
    assert "runner_heartbeat_interval_ms" in str(err.value) and "60000" in str(err.value)


def test_the_heartbeats_table_has_the_seeds_columns_and_workers_fill_both_roles(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    columns = {
        r["column_name"]: r["data_type"]
        for r in db.execute(
            "SELECT column_name, data_type FROM information_schema.columns"
            " WHERE table_name = 'tether_heartbeats' AND table_schema = current_schema()"
        )
    }
    # The seed's table: id int, task_id str, sender_id str, role str, sent_at datetime,
    # hostname str, pid int (tether's ids are UUIDs, its counters 64-bit).
    assert columns == {
        "id": "bigint",
        "task_id": "uuid",
        "sender_id": "text",
        "role": "text",
        "sent_at": "timestamp with time zone",
        "hostname": "text",
        "pid": "integer",
    }
    hold = chaos.app.tasks["hold"]
    worker = workers.start(APP, "--processes", "1", "--prefetch", "1", env=FAST)
    running = hold.send(token(), 30)
    wait_status(db, running.id, "RUNNING")
    claimed = hold.send(token(), 0)  # waits CLAIMED behind the busy child
    wait_until(
        lambda: last_heartbeat(db, claimed.id, "claimer") and last_heartbeat(db, running.id, "runner"),
        message="a claimer heartbeat for the CLAIMED task and a runner heartbeat for the RUNNING one",
    )
    assert task_row(db, claimed.id)["status"] == "CLAIMED"
    rows = db.execute(
        "SELECT DISTINCT task_id, sender_id, role, hostname, pid FROM tether_heartbeats"
        " WHERE task_id IN (%s, %s)",
        (running.id, claimed.id),
    ).fetchall()
    me = worker_row(db, worker.worker_id)
    roles = {(r["task_id"], r["role"]) for r in rows}
    assert roles >= {(running.id, "runner"), (claimed.id, "claimer")}
    assert (claimed.id, "runner") not in roles  # its code has not started
    assert all(r["sender_id"] == worker.worker_id and r["hostname"] == me["hostname"] for r in rows)
    assert {r["pid"] for r in rows if r["role"] == "claimer"} == {worker.pid}  # the main process
    runner_pids = {r["pid"] for r in rows if r["role"] == "runner"}
    assert runner_pids and worker.pid not in runner_pids  # the child running the task


def test_the_reaper_requeues_stale_claimed_and_fails_stale_running(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    """The seed's simplified logic: requeue(task) for CLAIMED (code never ran), fail(task) for RUNNING."""
    hold = chaos.app.tasks["hold"]
    doomed = workers.start(APP, "--processes", "1", "--prefetch", "1", env=FAST)  # takes both tasks...
    t_running, t_claimed = token(), token()
    running = hold.send(t_running, 60)
    wait_status(db, running.id, "RUNNING")
    wait_until(lambda: runs(db, t_running) == 1, message="the held task's code to start")
    claimed = hold.send(t_claimed, 0)
    wait_status(db, claimed.id, "CLAIMED")
    survivor = workers.start(APP, "--processes", "1", env=FAST)  # ...then a survivor to reap them
    doomed.kill()

    wait_status(db, running.id, "FAILED", timeout=20)
    row = task_row(db, running.id)
    assert row["error_code"] == "WORKER_CRASHED" and row["claimed_by_worker_id"] == doomed.worker_id
    assert [a["outcome"] for a in attempt_rows(db, running.id)] == ["FAILED"]
    assert runs(db, t_running) == 1  # not run again: it has no crash retry
    wait_status(db, claimed.id, "COMPLETED", timeout=20)  # requeued, then run by the survivor
    assert runs(db, t_claimed) == 1  # its code ran once, on the survivor
    assert task_row(db, claimed.id)["claimed_by_worker_id"] == survivor.worker_id


async def test_the_manual_recovery_examples_as_written(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    hold, hold_retry = chaos.app.tasks["hold"], chaos.app.tasks["hold_retry"]
    worker = workers.start(APP, "--processes", "2", "--prefetch", "1", env=FAST)
    failing = hold.send(token(), 60)
    retrying = hold_retry.send(token(), 60, 0)  # its policy retries WORKER_CRASHED once
    wait_status(db, failing.id, "RUNNING")
    wait_status(db, retrying.id, "RUNNING")
    claimed = hold.send(token(), 0)
    wait_status(db, claimed.id, "CLAIMED")
    worker.kill()  # kill -9, and no other worker: nothing recovers them but the operator
    hostname = worker_row(db, worker.worker_id)["hostname"]
    assert hostname == socket.gethostname()
    age_rows(db, [failing.id, retrying.id, claimed.id], timedelta(minutes=6))

    namespace: dict[str, Any] = {**NAMES, "app": chaos.app}
    printed = await run_example(QUERY_STALE_EXAMPLE, namespace)
    assert sorted(printed.splitlines()) == sorted(
        f"Stale: {task.id} on {hostname}" for task in (failing, retrying)
    )
    assert {t.id for t in namespace["stale"]} == {failing.id, retrying.id}
    assert task_row(db, failing.id)["status"] == "RUNNING"  # listing changes nothing

    printed = await run_example(FORCE_RECOVERY_EXAMPLE, namespace)
    assert printed.splitlines() == ["Failed 2 stale tasks", "Requeued 1 stale tasks"]
    assert (namespace["failed"], namespace["requeued"]) == (2, 1)
    failed = task_row(db, failing.id)
    assert (failed["status"], failed["error_code"]) == ("FAILED", "WORKER_CRASHED")
    retried = task_row(db, retrying.id)
    assert (retried["status"], retried["retry_count"]) == ("PENDING", 1)
    assert retried["next_retry_at"] is not None
    assert task_row(db, claimed.id)["status"] == "PENDING"
    assert task_row(db, claimed.id)["claimed_at"] is None
    assert [(a["outcome"], a["will_retry"]) for a in attempt_rows(db, retrying.id)] == [("FAILED", True)]
    assert attempt_rows(db, claimed.id) == []  # its code never ran: no attempt

    # Run again, nothing is left to do.
    printed = await run_example(QUERY_STALE_EXAMPLE + FORCE_RECOVERY_EXAMPLE, namespace)
    assert printed.splitlines() == ["Failed 0 stale tasks", "Requeued 0 stale tasks"]


def test_with_automatic_recovery_off_tasks_stay_stuck_until_recovered_by_hand(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    hold = chaos.app.tasks["hold"]
    doomed = workers.start(APP, "--processes", "1", "--prefetch", "1", env=NO_AUTO_RECOVERY)
    running = hold.send(token(), 60)
    wait_status(db, running.id, "RUNNING")
    claimed = hold.send(token(), 0)
    wait_status(db, claimed.id, "CLAIMED")
    survivor = workers.start(APP, "--processes", "1", env=NO_AUTO_RECOVERY)
    doomed.kill()
    # The survivor's reaper marks the silent worker inactive (3 heartbeats, 3 s) in the same
    # tick that would have recovered its tasks (stale after 2 s): they stay as they were.
    wait_until(
        lambda: worker_row(db, doomed.worker_id)["status"] == "inactive",
        timeout=20,
        message="the survivor's reaper to mark the killed worker inactive",
    )
    assert task_row(db, running.id)["status"] == "RUNNING"
    assert task_row(db, claimed.id)["status"] == "CLAIMED"

    broker = chaos.app.get_broker()
    assert broker.mark_stale_tasks_as_failed_sync(stale_threshold_ms=2_000) == 1
    assert broker.requeue_stale_claimed_sync(stale_threshold_ms=2_000) == 1
    assert task_row(db, running.id)["status"] == "FAILED"
    wait_status(db, claimed.id, "COMPLETED")  # requeued, then run by the survivor
    assert task_row(db, claimed.id)["claimed_by_worker_id"] == survivor.worker_id


def test_heartbeat_cleanup_by_the_reaper_and_by_the_seeds_sql(db: Any, workers: WorkerFactory) -> None:
    def insert(age_hours: float, n: int) -> None:
        db.execute(
            "INSERT INTO tether_heartbeats (task_id, sender_id, role, sent_at, hostname, pid)"
            " SELECT gen_random_uuid(), 'gone-1-ab', 'runner', now() - make_interval(hours => %s), 'gone', 1"
            " FROM generate_series(1, %s)",
            (age_hours, n),
        )

    def count(older_than_hours: float) -> int:
        row = db.execute(
            "SELECT count(*) AS n FROM tether_heartbeats WHERE sent_at < now() - make_interval(hours => %s)",
            (older_than_hours,),
        ).fetchone()
        return int(row["n"])

    # Automatic: heartbeat_retention_hours (24 by default); a worker's reaper prunes on its
    # first tick, then hourly.
    insert(25, 30)
    insert(23, 20)
    workers.start(APP, "--processes", "1", env=FAST)
    wait_until(lambda: count(24) == 0, timeout=20, message="the reaper to prune heartbeats past 24 h")
    assert count(22) == 20  # younger than the retention: kept

    # By hand, the seed's statement.
    insert(30, 5)
    with db.cursor() as cur:
        cur.execute(as_tether(HEARTBEAT_CLEANUP_SQL))
        assert cur.rowcount == 5
    assert count(24) == 0 and count(22) == 20


def test_heartbeat_cleanup_disabled_with_none_keeps_old_rows(db: Any, workers: WorkerFactory) -> None:
    db.execute(
        "INSERT INTO tether_heartbeats (task_id, sender_id, role, sent_at, hostname, pid)"
        " VALUES (gen_random_uuid(), 'gone-1-ab', 'runner', now() - interval '48 hours', 'gone', 1)"
    )
    # A worker stopped 8 days ago: past worker_state_retention_hours (7 days), still on.
    db.execute(
        "INSERT INTO tether_workers (id, hostname, pid, queues, processes, status, updated_at)"
        " VALUES ('gone-1-ab', 'gone', 1, '{default}', 1, 'stopped', now() - interval '8 days')"
    )
    assert tether.RecoveryConfig(heartbeat_retention_hours=None).heartbeat_retention_hours is None
    workers.start(APP, "--processes", "1", env={**FAST, "TETHER_HEARTBEAT_RETENTION_HOURS": "none"})
    wait_until(
        lambda: (
            db.execute("SELECT count(*) AS n FROM tether_workers WHERE id = 'gone-1-ab'").fetchone()["n"] == 0
        ),
        timeout=20,
        message="the reaper's first prune (the old worker row goes)",
    )
    row = db.execute("SELECT count(*) AS n FROM tether_heartbeats WHERE hostname = 'gone'").fetchone()
    assert row["n"] == 1  # heartbeat pruning is off: the 48-hour-old heartbeat stays
