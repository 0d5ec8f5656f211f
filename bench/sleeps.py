"""Durable sleep (docs/durable-steps.md#durable-sleep): what sleeping tasks cost the workers
while they sleep, and how close to their due time they wake.

- 10,000 ``napper`` tasks (one durable sleep each, until a due time spread evenly over a
  window that starts once they are all asleep) through one worker ``--processes 2``; the
  worker runs with its metrics endpoint so its claims can be counted.
- The cost while they sleep: over a quiet window (after the last one went to sleep, before
  the first is due), the claim statements the worker ran (``tether_claim_seconds_count``
  from its metrics); then, over a second window as long, 11 s later (PostgreSQL 15 flushes
  an idle backend's statistics up to 10 s late) and without a scrape, the transactions
  committed in the bench database (pg_stat_database.xact_commit) and the rows read from
  tether_tasks by every statement (pg_stat_user_tables: idx_tup_fetch + seq_tup_read); each
  against the same windows of the same worker idle with no task at all, measured just
  before (A/B, ``rounds`` times).
- Lateness: for each task, the start of the attempt that resumed it minus the due time its
  sleep recorded (tether_task_attempts.resume_at), both database time; p50/p99/max.

``python -m bench --only sleeps``
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

from bench.apps import make_app
from bench.infra import count_by_status, wait_all_terminal
from bench.scenarios import Context, Outcome, Row

METRICS_PORT = 18101  # this bench's own (the helper's assigned range)
WAKE_BOUND_S = 1.0
STATS_SETTLE_S = 11.0
# The pace the due times allow for putting the tasks to sleep (claim, start, suspend each):
# a loaded 2-core machine did about 600/s; slower, the run says so and stops.
ASLEEP_PER_S = 150


def _claims(port: int) -> float:
    """Claim statements the worker ran so far (its metrics endpoint)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("tether_claim_seconds_count"):
            return float(line.split()[-1])
    raise RuntimeError("no tether_claim_seconds_count in the worker's metrics")


def _db_counters(ctx: Context) -> tuple[int, int]:
    ((commits, tuples),) = ctx.db.query(
        "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),"
        " (SELECT coalesce(idx_tup_fetch, 0) + seq_tup_read FROM pg_stat_user_tables"
        "  WHERE relname = 'tether_tasks')"
    )
    return int(commits), int(tuples)


def _window(ctx: Context, port: int, seconds: float) -> dict[str, float]:
    """What the worker and the database did over ``seconds`` of quiet, in two windows: the
    claims (two scrapes of the worker's metrics), then, STATS_SETTLE_S later, the database's
    counters without a scrape (a scrape reads the queue gauges: up to 1,000 PENDING rows)."""
    claims0 = _claims(port)
    time.sleep(seconds)
    claims = _claims(port) - claims0
    # A backend flushes its statistics when idle at most every 10 s (PostgreSQL 15): what the
    # burst before (or the scrape) did would otherwise land in the window.
    time.sleep(STATS_SETTLE_S)
    ctx.db.query("SELECT pg_stat_clear_snapshot()")
    commits0, tuples0 = _db_counters(ctx)
    time.sleep(seconds)
    ctx.db.query("SELECT pg_stat_clear_snapshot()")
    commits1, tuples1 = _db_counters(ctx)
    return {
        "claims": claims,
        "commits": float(commits1 - commits0),
        "tasks_rows_read": float(tuples1 - tuples0),
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _round(ctx: Context, tasks: int, quiet_s: float, spread_s: float) -> dict[str, Any]:
    ctx.db.reset_tasks()
    worker = ctx.start_worker(processes=2, extra_args=("--metrics-port", str(METRICS_PORT)))
    try:
        worker.wait_registered()
        time.sleep(STATS_SETTLE_S)  # past start-up's own claims, first heartbeats, statistics
        idle = _window(ctx, METRICS_PORT, quiet_s)  # A: the same worker, no task at all

        app = make_app(ctx.db.url)
        try:
            # Due after: the time to put them all to sleep (generous), then the quiet window.
            before_due = tasks / ASLEEP_PER_S + STATS_SETTLE_S + 2 * quiet_s + STATS_SETTLE_S + 5
            start = time.time() + before_due
            napper = app.tasks["napper"]
            napper.send_many([(start + spread_s * i / tasks,) for i in range(tasks)])
        finally:
            app.close()
        deadline = time.monotonic() + 300
        while True:
            ((asleep,),) = ctx.db.query(
                "SELECT count(*) FROM tether_tasks t JOIN tether_task_attempts a"
                " ON a.task_id = t.id AND a.attempt = t.attempt AND a.outcome = 'SUSPENDED'"
                " WHERE t.status = 'PENDING'"
            )
            if asleep == tasks:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {asleep} of {tasks} tasks asleep: {count_by_status(ctx.db)}")
            time.sleep(0.2)
        asleep_at = time.time()
        time.sleep(STATS_SETTLE_S)  # the burst's statistics flushed before the window
        if time.time() + 2 * quiet_s + STATS_SETTLE_S > start:
            raise RuntimeError("the tasks took too long to go to sleep: no quiet window before the first due")
        sleeping = _window(ctx, METRICS_PORT, quiet_s)  # B: the same worker, 10,000 asleep
        wait_all_terminal(ctx.db, worker, timeout=300, interval=0.1)
    finally:
        worker.stop()
    rows = ctx.db.query(
        "SELECT extract(epoch FROM b.started_at - a.resume_at)::float8 FROM tether_task_attempts a"
        " JOIN tether_task_attempts b ON b.task_id = a.task_id AND b.attempt > a.attempt"
        " WHERE a.outcome = 'SUSPENDED' AND b.outcome = 'COMPLETED'"
    )
    late = [float(r[0]) for r in rows]
    if len(late) != tasks:
        raise RuntimeError(f"{len(late)} of {tasks} tasks woke and completed: {count_by_status(ctx.db)}")
    return {
        "idle": idle,
        "sleeping": sleeping,
        "late": late,
        "asleep_in_s": asleep_at - (start - before_due),
    }


def sleeps(ctx: Context) -> Outcome:
    tasks = 2_000 if ctx.quick else 10_000
    quiet_s = 5.0 if ctx.quick else 10.0
    spread_s = 30.0  # due times spread evenly: ~333 wakes/s at 10,000
    rounds = 1 if ctx.quick else 2
    runs = [_round(ctx, tasks, quiet_s, spread_s) for _ in range(rounds)]
    late = [x for r in runs for x in r["late"]]
    p50, p99, worst = _percentile(late, 0.5), _percentile(late, 0.99), max(late)

    def span(kind: str, field: str) -> str:
        values = [r[kind][field] for r in runs]
        return (
            f"{min(values):,.0f}" if min(values) == max(values) else f"{min(values):,.0f}-{max(values):,.0f}"
        )

    line = (
        f"{tasks:,} tasks asleep, 1 worker x 2 processes, {quiet_s:g} s quiet window, {rounds} round(s): "
        f"claims {span('sleeping', 'claims')} (idle, no tasks: {span('idle', 'claims')}), "
        f"transactions {span('sleeping', 'commits')} (idle: {span('idle', 'commits')}), "
        f"tether_tasks rows read {span('sleeping', 'tasks_rows_read')} "
        f"(idle: {span('idle', 'tasks_rows_read')}); woken over {spread_s:g} s: lateness "
        f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {worst * 1000:.0f} ms"
    )
    worst_extra_claims = max(r["sleeping"]["claims"] - r["idle"]["claims"] for r in runs)
    rows = [
        # Its polls (one a second) come at their own pace: one more or less in a window is chance.
        Row(
            "sleeps",
            "claims in the quiet window over an idle worker's",
            worst_extra_claims,
            "",
            "<= 1",
            worst_extra_claims <= 1,
        ),
        Row("sleeps", "wake lateness p50 (ms)", p50 * 1000, ""),
        Row("sleeps", "wake lateness p99 (ms)", p99 * 1000, ""),
        Row("sleeps", "wake lateness max (ms)", worst * 1000, "", "< 1000", worst < WAKE_BOUND_S),
    ]
    details = {
        "tasks": tasks,
        "quiet_s": quiet_s,
        "spread_s": spread_s,
        "rounds": rounds,
        "runs": [{k: v for k, v in r.items() if k != "late"} for r in runs],
    }
    return Outcome(line, rows, details)


SLEEP_SCENARIOS: dict[str, Any] = {"sleeps": sleeps}
