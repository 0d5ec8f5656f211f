"""The async executor (docs/workers.md#the-executor-model): async tasks beside sync ones.

- async_throughput: 10,000 no-op tasks through one worker with one child process, the
  async executor (one async child) and the sync path (one sync child) in alternating
  rounds of the same run; tasks/s by database time and wall time, and commits per task.
- async_sleep: 2,000 tasks each awaiting asyncio.sleep(1) through one worker with one
  async child (concurrency 2,000), from send to the last COMPLETED; then the worker's
  resident memory, idle and with 1,000 tasks in flight.
- async_pickup_latency: sends 10-20 ms apart to an idle async child; started_at - sent_at.
"""

from __future__ import annotations

import time
from typing import Any

from tests.harness import WorkerProcess

from bench import async_apps
from bench.apps import make_app
from bench.infra import count_by_status, percentile, wait_all_terminal, wait_for
from bench.scenarios import MB, Context, Outcome, Row, paced_sends

ASYNC_THROUGHPUT_TARGET = 5_000
SLEEP_WALL_TARGET_S = 3.0
ASYNC_APP = "bench.async_apps:app"


def _async_worker(ctx: Context, concurrency: int = 100) -> WorkerProcess:
    return ctx.start_worker(
        processes=0,
        app_path=ASYNC_APP,
        extra_args=("--async-processes", "1", "--async-concurrency", str(concurrency)),
    )


def _commits(ctx: Context) -> int:
    ((n,),) = ctx.db.query("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
    return int(n)


def _drain(ctx: Context, kind: str, n: int) -> dict[str, float]:
    """Send n no-op tasks, then start one worker with one child of ``kind`` and time it."""
    ctx.db.reset_tasks()
    if kind == "async":
        app = async_apps.make_app(ctx.db.url)
        task = app.tasks["anoop"]
    else:
        app = make_app(ctx.db.url)
        task = app.tasks["noop"]
    try:
        task.send_many([()] * n)
    finally:
        app.close()
    commits_before = _commits(ctx)
    worker = _async_worker(ctx) if kind == "async" else ctx.start_worker(processes=1)
    try:
        seen_at = wait_all_terminal(ctx.db, worker, timeout=900, interval=0.05)
        wall = seen_at - worker.started_at
    finally:
        worker.stop()  # waits until its sessions are gone: their statistics are flushed
    commits = _commits(ctx) - commits_before
    ((completed, span),) = ctx.db.query(
        "SELECT count(*) FILTER (WHERE status = 'COMPLETED'),"
        " extract(epoch FROM max(completed_at) - min(started_at)) FROM tether_tasks"
    )
    if completed != n:
        raise RuntimeError(f"{kind}: {completed} of {n} tasks COMPLETED: {count_by_status(ctx.db)}")
    return {"tasks_per_s": n / float(span), "wall_s": wall, "commits_per_task": commits / n}


def async_throughput(ctx: Context) -> Outcome:
    n = 2_000 if ctx.quick else 10_000
    rounds = 1 if ctx.quick else 3
    runs: dict[str, list[dict[str, float]]] = {"async": [], "sync": []}
    for _ in range(rounds):
        for kind in runs:
            runs[kind].append(_drain(ctx, kind, n))

    def best(kind: str, key: str) -> float:
        values = [r[key] for r in runs[kind]]
        return min(values) if key != "tasks_per_s" else max(values)

    def median(kind: str, key: str) -> float:
        values = sorted(r[key] for r in runs[kind])
        return values[len(values) // 2]

    rate, sync_rate = median("async", "tasks_per_s"), median("sync", "tasks_per_s")
    return Outcome(
        f"{n:,} no-op tasks, 1 worker x 1 process, {rounds} alternating round(s): async child "
        f"{rate:,.0f} tasks/s (best {best('async', 'tasks_per_s'):,.0f}), "
        f"{median('async', 'commits_per_task'):.3f} commits/task; sync child {sync_rate:,.0f} tasks/s "
        f"(best {best('sync', 'tasks_per_s'):,.0f}), {median('sync', 'commits_per_task'):.3f} commits/task",
        [
            Row(
                "async_throughput",
                "async tasks/s (db time, median)",
                rate,
                "",
                f">= {ASYNC_THROUGHPUT_TARGET:,}/s",
                rate >= ASYNC_THROUGHPUT_TARGET,
            ),
            Row("async_throughput", "sync tasks/s, same run (db time, median)", sync_rate, ""),
            Row("async_throughput", "async commits per task", median("async", "commits_per_task"), ""),
            Row("async_throughput", "sync commits per task", median("sync", "commits_per_task"), ""),
            Row(
                "async_throughput",
                "async wall, worker start -> all COMPLETED",
                median("async", "wall_s"),
                "s",
            ),
            Row(
                "async_throughput", "sync wall, worker start -> all COMPLETED", median("sync", "wall_s"), "s"
            ),
        ],
        {"tasks": n, "rounds": rounds, "runs": runs},
    )


def _running(ctx: Context) -> int:
    ((n,),) = ctx.db.query("SELECT count(*) FROM tether_tasks WHERE status = 'RUNNING'")
    return int(n)


def async_sleep(ctx: Context) -> Outcome:
    n = 2_000
    ctx.db.reset_tasks()
    worker = _async_worker(ctx, concurrency=n)
    app = async_apps.make_app(ctx.db.url)
    try:
        worker.wait_ready()
        app.tasks["anoop"].send_many([()] * 20)  # untimed warm-up: the child's connection and statements
        wait_all_terminal(ctx.db, worker, timeout=60, interval=0.02)
        time.sleep(2.0)  # let RSS settle after start-up
        idle_rss, _ = worker.rss_bytes()
        t0 = time.perf_counter()
        app.tasks["asleep"].send_many([(1.0,)] * n)
        seen_at = wait_all_terminal(ctx.db, worker, timeout=120, interval=0.02)
        wall = seen_at - t0
        ((completed, started_span),) = ctx.db.query(
            "SELECT count(*) FILTER (WHERE status = 'COMPLETED' AND name = 'asleep'),"
            " extract(epoch FROM max(started_at) - min(started_at)) FROM tether_tasks WHERE name = 'asleep'"
        )
        if completed != n:
            raise RuntimeError(f"{completed} of {n} sleeping tasks COMPLETED: {count_by_status(ctx.db)}")
        # Memory with 1,000 tasks in flight: each sleeps long enough to be counted.
        app.tasks["asleep"].send_many([(4.0,)] * 1_000)
        wait_for("1,000 tasks RUNNING", lambda: _running(ctx) >= 1_000, timeout=30, interval=0.05)
        busy_rss, per_pid = worker.rss_bytes()
        wait_all_terminal(ctx.db, worker, timeout=60, interval=0.05)
    finally:
        app.close()
        worker.stop()
    return Outcome(
        f"{n:,} x asyncio.sleep(1), 1 worker x 1 async child (concurrency {n:,}): send -> all COMPLETED "
        f"{wall:.2f}s (starts spread over {float(started_span):.2f}s); worker RSS idle "
        f"{idle_rss / MB:.0f} MB, with 1,000 in flight {busy_rss / MB:.0f} MB ({len(per_pid)} processes)",
        [
            Row(
                "async_sleep",
                "2,000 x sleep(1): send -> all COMPLETED",
                wall,
                "s",
                f"<= {SLEEP_WALL_TARGET_S:g} s",
                wall <= SLEEP_WALL_TARGET_S,
            ),
            Row("async_sleep", "worker RSS, idle", idle_rss / MB, "MB"),
            Row("async_sleep", "worker RSS, 1,000 tasks in flight", busy_rss / MB, "MB"),
        ],
        {
            "tasks": n,
            "wall_s": wall,
            "started_span_s": float(started_span),
            "idle_rss_mb": idle_rss / MB,
            "busy_rss_mb": busy_rss / MB,
            "rss_per_pid_mb": {str(pid): rss / MB for pid, rss in per_pid.items()},
        },
    )


def async_pickup_latency(ctx: Context) -> Outcome:
    n = 100 if ctx.quick else 500
    ctx.db.reset_tasks()
    worker = _async_worker(ctx)
    app = async_apps.make_app(ctx.db.url)
    try:
        ids = paced_sends(ctx, worker, app.tasks["anoop"], n)
    finally:
        app.close()
        worker.stop()
    rows = ctx.db.query(
        "SELECT status, 1000 * extract(epoch FROM started_at - sent_at) FROM tether_tasks WHERE id = ANY(%s)",
        (ids,),
    )
    if len(rows) != n or any(r[0] != "COMPLETED" for r in rows):
        raise RuntimeError(f"expected {n} COMPLETED tasks: {count_by_status(ctx.db)}")
    pickup = sorted(float(r[1]) for r in rows)
    p50, p99 = percentile(pickup, 50), percentile(pickup, 99)
    return Outcome(
        f"{n} async sends 10-20 ms apart to an idle async child: started_at - sent_at p50 {p50:.2f} ms, "
        f"p99 {p99:.2f} ms, max {pickup[-1]:.2f} ms",
        [
            Row("async_pickup_latency", "p50", p50, "ms"),
            Row("async_pickup_latency", "p99", p99, "ms"),
        ],
        {"tasks": n, "p50_ms": p50, "p99_ms": p99, "max_ms": pickup[-1]},
    )


ASYNC_SCENARIOS: dict[str, Any] = {
    "async_throughput": async_throughput,
    "async_sleep": async_sleep,
    "async_pickup_latency": async_pickup_latency,
}
