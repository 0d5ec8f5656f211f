"""A fleet of workers does one reaper pass per due moment, not one per worker; and when the
worker that did the last pass is killed, another takes over within the documented bounds.

``tether_reaper`` (migration 11) counts the passes and names the worker of the last one:
the test reads the count over a window of the database's clock.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import task_row
from tests.chaos.conftest import (
    APP,
    CHECK_S,
    FAST,
    HEARTBEAT_S,
    RUNNING_STALE_S,
    check_history,
    db_now,
    last_heartbeat,
    runs,
    token,
    wait_status,
)
from tests.conftest import WorkerFactory, wait_until

FLEET = 10
WINDOW_S = 6.0
# As for one killed worker (test_worker_kill.py): stale threshold (2 s) + check interval (1 s) + slack.
RECOVERED_WITHIN = timedelta(seconds=4)


def passes(db: Any) -> tuple[int, datetime, str | None]:
    row = db.execute("SELECT passes, now() AS at, last_worker_id FROM tether_reaper").fetchone()
    assert row is not None
    return int(row["passes"]), row["at"], row["last_worker_id"]


def held(db: Any) -> dict[str, list[str]]:
    """Worker id -> the statuses of the tasks it holds."""
    rows = db.execute(
        "SELECT claimed_by_worker_id AS w, status FROM tether_tasks WHERE status IN ('CLAIMED', 'RUNNING')"
    ).fetchall()
    found: dict[str, list[str]] = {}
    for r in rows:
        found.setdefault(r["w"], []).append(r["status"])
    return found


@pytest.mark.timing
def test_a_fleet_does_one_reaper_pass_per_interval_and_survives_the_death_of_the_last_passer(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    fleet = [
        workers.start(APP, "--processes", "1", "--prefetch", "1", wait=False, env=FAST) for _ in range(FLEET)
    ]
    for w in fleet:
        w.wait_registered(timeout=120)
    by_id = {w.worker_id: w for w in fleet}

    # Idle: nothing is in flight, so the next pass is due one check interval after the last
    # (plus up to a tenth of it, the jitter). Ten workers each ticking on their own would do
    # ten passes per interval (one each: nobody else holds the lock at that moment).
    first, start, _ = passes(db)
    wait_until(lambda: db_now(db) - start >= timedelta(seconds=WINDOW_S), timeout=WINDOW_S + 30, interval=0.1)
    last, end, _ = passes(db)
    elapsed = (end - start).total_seconds()
    done = last - first
    # (At least half of that: a loaded machine wakes threads late; at most one more.)
    assert elapsed / (CHECK_S * 1.1) / 2 <= done <= elapsed / CHECK_S + 1, (done, elapsed)
    counted = [f"idle: {done} passes in {elapsed:.1f} s"]

    # Busy: every worker runs one long task and holds one more CLAIMED (capacity 2 each).
    hold = chaos.app.tasks["hold"]
    toks = [token() for _ in range(2 * FLEET)]
    hold.send_many([(t, 60) for t in toks])
    wait_until(
        lambda: (
            len(h := held(db)) == FLEET
            and all(sorted(s) == ["CLAIMED", "RUNNING"] for s in h.values())
            and sum(runs(db, t) for t in toks) == FLEET
        ),
        timeout=60,
        message="every worker to run one task and hold one CLAIMED",
    )
    # Recovery is judged against the victim's last runner heartbeat: have one for every task.
    wait_until(
        lambda: (
            db.execute(
                "SELECT count(DISTINCT task_id) AS n FROM tether_heartbeats WHERE role = 'runner'"
            ).fetchone()["n"]
            == FLEET
        ),
        timeout=10,
        message="a runner heartbeat for every running task",
    )
    first, start, _ = passes(db)
    wait_until(lambda: db_now(db) - start >= timedelta(seconds=WINDOW_S), timeout=WINDOW_S + 30, interval=0.1)
    last, end, _ = passes(db)
    elapsed = (end - start).total_seconds()
    done = last - first
    # Tasks in flight: the pass is due when the first of them would turn stale, and never
    # later than the check interval; their heartbeats keep pushing that past the interval.
    assert elapsed / (CHECK_S * 1.1) / 2 <= done <= elapsed / CHECK_S + 2, (done, elapsed)
    counted.append(f"busy: {done} passes in {elapsed:.1f} s")

    # Kill the worker that did the last pass, right after it did it.
    before, _, _ = passes(db)
    victim_id = wait_until(
        lambda: (p := passes(db))[0] > before and p[2], timeout=10, interval=0.005, message="the next pass"
    )
    victim = by_id[victim_id]
    running_id, claimed_id = (
        db.execute(
            "SELECT id FROM tether_tasks WHERE claimed_by_worker_id = %s AND status = %s", (victim_id, status)
        ).fetchone()["id"]
        for status in ("RUNNING", "CLAIMED")
    )
    killed_at = db_now(db)
    victim.kill()

    # Its RUNNING task: FAILED with WORKER_CRASHED, by another worker's pass, once stale.
    row = wait_status(db, running_id, {"FAILED", "COMPLETED", "PENDING"}, timeout=15)
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert row["failed_at"] - killed_at < RECOVERED_WITHIN, (row["failed_at"], killed_at)
    last_beat = last_heartbeat(db, running_id, "runner")
    assert last_beat is not None and row["failed_at"] - last_beat >= timedelta(seconds=RUNNING_STALE_S)
    check_history(db, running_id)
    # Its CLAIMED task: back to PENDING (every other worker is full), its code never run.
    row = wait_status(db, claimed_id, {"PENDING"}, timeout=15)
    assert row["claimed_by_worker_id"] is None and row["updated_at"] - killed_at < RECOVERED_WITHIN, row
    claimed_row = task_row(db, claimed_id)
    assert claimed_row["attempt"] == 1 and runs(db, claimed_row["args"][0]) == 0
    _, _, now_passer = passes(db)
    assert now_passer != victim_id and now_passer in by_id
    for w in fleet:
        if w is not victim:
            assert w.proc.poll() is None, w.log_tail()
    print(f"\n{FLEET} workers, check interval {CHECK_S:g} s: " + "; ".join(counted))


def last_beat(db: Any, worker_id: str | None) -> datetime:
    row = db.execute("SELECT last_heartbeat_at FROM tether_workers WHERE id = %s", (worker_id,)).fetchone()
    return row["last_heartbeat_at"]  # type: ignore[no-any-return]


REAPER_LOCK_KEY = 2122188290  # broker/sql/reaper_passes.sql: claim_reaper_pass
PASS_HOLDER = """
SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.classid = 0 AND l.objid = %s AND l.granted
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


@pytest.mark.timing
def test_a_reaper_pass_that_waits_longer_than_the_stale_threshold_holds_up_no_heartbeat(
    db: Any, database_url: str, chaos: ModuleType, workers: WorkerFactory
) -> None:
    """The reaper and the scheduler share a connection; the heartbeat keeps its own. A pass
    stuck for three stale thresholds (here on a table lock; in life a lock wait or a big
    prune) must not delay one heartbeat: the worker stays active, keeps its task, and does
    not isolate itself."""
    hold = chaos.app.tasks["hold"]
    a = workers.start(APP, "--processes", "1", env=FAST)
    tok = token()
    running = hold.send(tok, 60)
    wait_until(
        lambda: runs(db, tok) == 1 and last_heartbeat(db, running.id, "runner") is not None,
        message="A to run its task and heartbeat for it",
    )
    stuck_for = timedelta(seconds=3 * RUNNING_STALE_S)
    beats: list[datetime] = []
    with psycopg.connect(database_url) as blocker:
        # SHARE mode stops writes to tether_tasks (the pass's first step), not the reads and
        # the heartbeat rows of the heartbeat statement.
        blocker.execute("LOCK TABLE tether_tasks IN SHARE MODE")
        locked_at = db_now(db)
        holder = wait_until(
            lambda: db.execute(PASS_HOLDER, (REAPER_LOCK_KEY,)).fetchone(),
            timeout=10,
            message="A's reaper to start a pass and wait",
        )
        assert holder["application_name"] == "tether-maintenance", holder
        while db_now(db) - locked_at < stuck_for:
            previous = beats[-1] if beats else None
            beats.append(
                wait_until(
                    lambda previous=previous: (b := last_beat(db, a.worker_id)) != previous and b,
                    timeout=2 * HEARTBEAT_S,
                    interval=0.05,
                    message=f"A's next heartbeat after {previous}",
                )
            )
        assert db.execute(PASS_HOLDER, (REAPER_LOCK_KEY,)).fetchone() is not None  # still stuck
        blocker.rollback()
    gaps = [(b - a_).total_seconds() for a_, b in itertools.pairwise(beats)]
    assert len(beats) >= 5 and max(gaps) < 1.5 * HEARTBEAT_S, gaps
    assert "isolating itself" not in a.log(), a.log()
    row = task_row(db, running.id)
    assert row["status"] == "RUNNING" and row["claimed_by_worker_id"] == a.worker_id, row
    print(f"\nheartbeats while the pass waited {stuck_for.total_seconds():g} s: gaps {gaps}")
