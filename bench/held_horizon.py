"""``held_horizon``: no-op drain throughput while a transaction holds back the vacuum.

A client opens ``REPEATABLE READ``, reads a row and stays open: from then on no row
version that any later transaction replaced or deleted can be removed, by a vacuum or
by the index scans that normally mark dead entries, until it ends. With it held:

1. churn: one worker (``--processes 2``) runs ``churn`` no-op tasks, sent with
   ``send_many`` in batches of 1,000 while it runs (at most 2,000 waiting);
2. drain: ``drain`` no-op tasks are sent while no worker runs, then one worker
   (``--processes 2``) is started; the figure is drain / (last ``completed_at`` - first
   ``started_at``), database time, as ``throughput`` measures it;
3. recovery: the holding transaction ends, and the same drain runs again (no VACUUM: on
   a server with autovacuum off, what recovers is tether's own doing; see docs/schema.md).

The run watches its progress by counting ``tether_task_attempts`` (one row per finished
no-op task; insert-only, so the hold leaves it no dead rows): a count of PENDING rows would
itself read every dead entry of the claim index, many times a second, in the held runs only.

The same run without the held transaction is the reference. The two configurations
alternate (held, clean, held, clean, ...) on emptied tables; each pair's ratio is
reported, with the churn's duration and the dead row versions per table
(``pg_stat_user_tables.n_dead_tup``) after the churn and after the drain.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import psycopg

from bench.apps import make_app
from bench.infra import count_by_status, wait_for
from bench.scenarios import Context, Outcome, Row

RATIO_TARGET = 0.8
TABLES = (
    "tether_tasks",
    "tether_task_attempts",
    "tether_heartbeats",
    "tether_workers",
    "tether_worker_states",
)
BATCH = 1_000
MAX_WAITING = 2_000


def held_horizon(ctx: Context) -> Outcome:
    churn, drain = (4_000, 2_000) if ctx.quick else (20_000, 10_000)
    pairs = 1 if ctx.quick else 2
    runs: list[dict[str, Any]] = []
    for _ in range(pairs):
        for held in (True, False):
            runs.append(_one_run(ctx, held=held, churn=churn, drain=drain))
            print(f"held_horizon           {_describe(runs[-1])}", flush=True)
    ratios = [h["drain_per_s"] / c["drain_per_s"] for h, c in zip(runs[::2], runs[1::2], strict=True)]
    recovered = [
        h["after_release_per_s"] / c["drain_per_s"] for h, c in zip(runs[::2], runs[1::2], strict=True)
    ]
    ratio = statistics.median(ratios)
    held_runs, clean_runs = runs[::2], runs[1::2]
    return Outcome(
        f"{churn:,} tasks of churn then a drain of {drain:,}: held/clean drain ratio per pair "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f"; after the hold ends {', '.join(f'{r:.2f}' for r in recovered)} of clean; churn "
        + ", ".join(
            f"{h['churn_s']:.1f}s held / {c['churn_s']:.1f}s clean"
            for h, c in zip(held_runs, clean_runs, strict=True)
        )
        + f"; dead tether_tasks rows after a held churn {held_runs[0]['dead_after_churn']['tether_tasks']:,}",
        [
            Row(
                "held_horizon",
                "drain with the horizon held / without",
                ratio,
                "x",
                f">= {RATIO_TARGET}x",
                min(ratios) >= RATIO_TARGET,
            ),
            Row("held_horizon", "drain after the hold ends / without", statistics.median(recovered), "x"),
            Row(
                "held_horizon",
                "drain, horizon held",
                statistics.median(h["drain_per_s"] for h in held_runs),
                "tasks/s",
            ),
            Row(
                "held_horizon",
                "drain, clean",
                statistics.median(c["drain_per_s"] for c in clean_runs),
                "tasks/s",
            ),
        ],
        {"churn": churn, "drain": drain, "ratios": ratios, "recovered": recovered, "runs": runs},
    )


def _one_run(ctx: Context, *, held: bool, churn: int, drain: int) -> dict[str, Any]:
    ctx.db.reset_tasks()
    holder: psycopg.Connection[Any] | None = None
    run: dict[str, Any] = {"held": held}
    try:
        if held:
            holder = psycopg.connect(ctx.db.url)
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute(
                "SELECT count(*) FROM tether_schema_version"
            ).fetchone()  # reads: takes its snapshot
        run["churn_s"] = _churn(ctx, churn)
        run["dead_after_churn"] = _dead(ctx)
        run["drain_per_s"] = _drain(ctx, drain)
        run["dead_after_drain"] = _dead(ctx)
        if holder is not None:
            holder.close()  # the hold ends: nothing vacuums (autovacuum is off on the test server)
            holder = None
            run["after_release_per_s"] = _drain(ctx, drain)
            run["dead_after_release"] = _dead(ctx)
    finally:
        if holder is not None:
            holder.close()
    return run


def _churn(ctx: Context, n: int) -> float:
    app = make_app(ctx.db.url)
    noop = app.tasks["noop"]
    worker = ctx.start_worker(processes=2)
    base = _finished(ctx)
    try:
        t0 = time.perf_counter()
        sent = 0
        while sent < n:
            noop.send_many([()] * min(BATCH, n - sent))
            sent += min(BATCH, n - sent)
            while sent - (_finished(ctx) - base) > MAX_WAITING - BATCH:
                worker.check_alive()
                time.sleep(0.02)
        _wait_finished(ctx, base + n, worker)
        return time.perf_counter() - t0
    finally:
        app.close()
        worker.stop()


def _drain(ctx: Context, n: int) -> float:
    app = make_app(ctx.db.url)
    base = _finished(ctx)
    try:
        ids = [h.id for h in app.tasks["noop"].send_many([()] * n)]
    finally:
        app.close()
    worker = ctx.start_worker(processes=2)
    try:
        _wait_finished(ctx, base + n, worker)
    finally:
        worker.stop()
    ((completed, span),) = ctx.db.query(
        "SELECT count(*) FILTER (WHERE status = 'COMPLETED'), extract(epoch FROM max(completed_at)"
        " - min(started_at)) FROM tether_tasks WHERE id = ANY(%s::uuid[])",
        ([str(i) for i in ids],),
    )
    if completed != n:
        raise RuntimeError(f"{completed} of {n} drained tasks COMPLETED: {count_by_status(ctx.db)}")
    return n / float(span)


def _finished(ctx: Context) -> int:
    return int(ctx.db.query("SELECT count(*) FROM tether_task_attempts")[0][0])


def _wait_finished(ctx: Context, total: int, worker: Any) -> None:
    def done() -> bool:
        worker.check_alive()
        return _finished(ctx) >= total

    wait_for("the tasks to finish", done, timeout=1800, interval=0.05)


def _dead(ctx: Context) -> dict[str, int]:
    # Counters reach the statistics when a session's transaction ends (workers are stopped).
    time.sleep(0.6)
    rows = ctx.db.query(
        "SELECT relname, n_dead_tup FROM pg_stat_user_tables WHERE relname = ANY(%s)", (list(TABLES),)
    )
    return {name: int(n) for name, n in rows}


def _describe(run: dict[str, Any]) -> str:
    line = (
        f"{'held ' if run['held'] else 'clean'}: churn {run['churn_s']:.1f}s,"
        f" drain {run['drain_per_s']:,.0f} tasks/s, dead rows after churn {run['dead_after_churn']}"
    )
    if run["held"]:
        line += f"; after release {run['after_release_per_s']:,.0f} tasks/s"
    return line


HELD_HORIZON_SCENARIOS = {"held_horizon": held_horizon}
