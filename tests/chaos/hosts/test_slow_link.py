"""Worker hosts on slow links: every packet waits in each direction, with jitter.

Two hosts whose links delay every packet DELAY_MS (plus or minus JITTER_MS) each way
(tests/delay_line.py, standing in for ``tc netem delay``), under the fast recovery settings
of the chaos tests (1 s heartbeats, 2 s thresholds): a round trip costs a fifth of a heartbeat
interval. Both work through a batch of short tasks and one long task each (three running
thresholds long). A slow link is not a dead one: no task is recovered, no worker isolates
itself or is marked inactive, every task runs once and completes, and the heartbeats of the
long tasks, as the database stamped them, are never further apart than the threshold.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta
from typing import Any

import pytest

from tests.apps.support import task_row
from tests.chaos.conftest import FAST, RUNNING_STALE_S, check_history, runs, token, wait_all, worker_row
from tests.chaos.hosts.conftest import HostFactory, LabDatabase
from tests.hosts import Host

pytestmark = [pytest.mark.timing, pytest.mark.server_agnostic]

DELAY_MS, JITTER_MS = 100.0, 30.0
SHORT_TASKS = 20
LONG_S = 3 * RUNNING_STALE_S


def round_trips(host: Host, url: str, count: int = 5) -> list[float]:
    """Seconds of ``count`` round trips (SELECT 1) from ``host``, on one warm connection."""
    code = (
        "import psycopg, time\n"
        f"conn = psycopg.connect({url!r}, autocommit=True)\n"
        "conn.execute('SELECT 1')\n"
        "for _ in range({count}):\n"
        "    t = time.perf_counter(); conn.execute('SELECT 1'); print(time.perf_counter() - t)\n"
    ).replace("{count}", str(count))
    return [float(line) for line in host.python(code).split()]


def beat_gaps(conn: Any, task_id: Any) -> list[timedelta]:
    """The gaps between the task's start, its runner heartbeats from its owner, and its end."""
    row = task_row(conn, task_id)
    beats = conn.execute(
        "SELECT sent_at FROM tether_heartbeats WHERE task_id = %s AND role = 'runner' AND sender_id = %s"
        " ORDER BY sent_at",
        (task_id, row["claimed_by_worker_id"]),
    ).fetchall()
    times: list[datetime] = [row["started_at"], *(b["sent_at"] for b in beats), row["completed_at"]]
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def test_slow_links_keep_heartbeats_and_claims_correct(lab_db: LabDatabase, hosts: HostFactory) -> None:
    db, tasks = lab_db.conn, lab_db.app.tasks
    host_a, host_b = hosts.add("a"), hosts.add("b")
    for host in (host_a, host_b):
        host.slow(DELAY_MS, JITTER_MS)
    trips = round_trips(host_a, lab_db.host_url)
    assert min(trips) >= 2 * (DELAY_MS - JITTER_MS) / 1000, f"the link is not slow: {trips}"
    a, b = (hosts.worker(h, "--processes", "2", env=FAST, wait=False) for h in (host_a, host_b))
    for worker in (a, b):  # started together: each start-up takes dozens of slow round trips
        worker.wait_registered()

    long_tokens = {"a": token(), "b": token()}
    longs = [tasks["hold"].with_options(queue=q).send(t, LONG_S) for q, t in long_tokens.items()]
    short_tokens = [token() for _ in range(SHORT_TASKS)]
    shorts = tasks["work"].send_many([(t, 200) for t in short_tokens])
    ids = [str(h.id) for h in [*longs, *shorts]]
    wait_all(db, ids, {"COMPLETED", "FAILED"}, timeout=60, why="every task to end")

    for task_id in ids:
        row, attempts = check_history(db, task_id)
        assert (row["status"], len(attempts)) == ("COMPLETED", 1), (row, attempts)
    assert all(runs(db, t) == 1 for t in [*long_tokens.values(), *short_tokens])
    owners = {q: task_row(db, h.id)["claimed_by_worker_id"] for q, h in zip(long_tokens, longs, strict=True)}
    assert owners == {"a": a.worker_id, "b": b.worker_id}
    gaps = {q: beat_gaps(db, h.id) for q, h in zip(long_tokens, longs, strict=True)}
    widest = max(g for host_gaps in gaps.values() for g in host_gaps)
    assert widest < timedelta(seconds=RUNNING_STALE_S), f"a heartbeat gap reached the threshold: {gaps}"
    for worker in (a, b):
        assert "isolating itself" not in worker.log(), worker.log()
        row = worker_row(db, worker.worker_id or "")
        assert (row["status"], row["inactive_at"]) == ("active", None), row
    crashed = db.execute(
        "SELECT count(*) AS n FROM tether_task_attempts WHERE error_code = 'WORKER_CRASHED'"
    ).fetchone()
    assert crashed["n"] == 0
    by_host = db.execute(
        "SELECT claimed_by_worker_id AS w, count(*) AS n FROM tether_tasks GROUP BY 1"
    ).fetchall()
    print(
        f"\nround trips {[round(t * 1000) for t in trips]} ms; widest runner heartbeat gap "
        f"{widest.total_seconds():.2f}s; tasks by worker: {[(r['w'], r['n']) for r in by_host]}"
    )
