"""The scenarios. Each returns an Outcome: one printed line, table rows and details for JSON.

Every figure is measured as the README says; nothing is tuned to look better than
it is. Task tables are emptied before each scenario (with no worker running) so
one scenario's rows never count in another's.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import psycopg
from tests.harness import WorkerProcess

from bench.apps import make_app
from bench.infra import (
    BenchDatabase,
    bench_worker,
    count_by_status,
    percentile,
    wait_all_terminal,
)
from tether.broker.queries import q

SEND_TARGET = 3_500
SEND_MANY_TARGET = 50_000
THROUGHPUT_TARGET = 1_500
P50_TARGET_MS, P99_TARGET_MS = 5.0, 15.0
RSS_LIMIT_MB, RSS_GROWTH_MB = 250.0, 10.0
MB = 1024 * 1024


@dataclass
class Row:
    scenario: str
    figure: str  # what is measured, e.g. "tasks/s"
    value: float
    unit: str
    target: str | None = None  # None: context only, no pass/fail
    passed: bool | None = None

    def shown(self) -> str:
        number = f"{self.value:,.0f}" if abs(self.value) >= 100 else f"{self.value:,.2f}"
        return f"{self.figure}: {number} {self.unit}".strip()


@dataclass
class Outcome:
    line: str
    rows: list[Row]
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    db: BenchDatabase
    quick: bool
    log_dir: Path
    workers: list[WorkerProcess] = field(default_factory=list)  # all ever started: killed at exit

    def start_worker(
        self,
        processes: int = 2,
        *,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        exclusive: bool = True,
        app_path: str = "bench.apps:app",
    ) -> WorkerProcess:
        path = self.log_dir / f"worker-{len(self.workers) + 1}.log"
        worker = bench_worker(
            self.db,
            path,
            processes,
            extra_args=extra_args,
            env=dict(env or {}),
            exclusive=exclusive,
            app_path=app_path,
        )
        self.workers.append(worker)
        return worker.start()


# -- 1. single sends -------------------------------------------------------------------


def send_single(ctx: Context) -> Outcome:
    """Sequential send(), durable (the default) and with durable=False, in alternating blocks.

    Alternating blocks of each kind share the machine's drift (a shared VM's speed moves
    by tens of percent within minutes), so the two figures compare fairly.
    """
    n = 2_000 if ctx.quick else 20_000
    blocks, warmup = 4, 200
    ctx.db.reset_tasks()
    app = make_app(ctx.db.url)
    kinds = {
        "durable": app.tasks["noop"].with_options(),
        "no_flush_wait": app.tasks["noop"].with_options(durable=False),
    }
    seconds = dict.fromkeys(kinds, 0.0)
    try:
        for task in kinds.values():
            for _ in range(warmup):  # pool connection, schema check, psycopg's prepared statements
                task.send()
        for _ in range(blocks):
            for kind, task in kinds.items():
                t0 = time.perf_counter()
                for _ in range(n // blocks):
                    task.send()
                seconds[kind] += time.perf_counter() - t0
    finally:
        app.close()
    stored = sum(count_by_status(ctx.db).values())
    if stored != len(kinds) * (n + warmup):
        raise RuntimeError(f"expected {len(kinds) * (n + warmup)} rows, found {stored}")
    rate = {kind: n / s for kind, s in seconds.items()}
    durable, fast = rate["durable"], rate["no_flush_wait"]
    return Outcome(
        f"{n:,} sequential send() in {seconds['durable']:.2f}s = {durable:,.0f} tasks/s "
        f"({1e6 / durable:.0f} us/send); with durable=False {fast:,.0f} tasks/s ({1e6 / fast:.0f} us/send)",
        [
            Row("send_single", "tasks/s", durable, "", f">= {SEND_TARGET:,}/s", durable >= SEND_TARGET),
            Row(
                "send_single",
                "tasks/s, durable=False (opt-in)",
                fast,
                "",
                f">= {SEND_TARGET:,}/s",
                fast >= SEND_TARGET,
            ),
        ],
        {
            "tasks": n,
            "blocks": blocks,
            "seconds": seconds["durable"],
            "tasks_per_s": durable,
            "us_per_send": 1e6 / durable,
            "no_flush_wait_seconds": seconds["no_flush_wait"],
            "no_flush_wait_tasks_per_s": fast,
        },
    )


def send_async_concurrent(ctx: Context) -> Outcome:
    n = 2_000 if ctx.quick else 20_000
    concurrency = 16
    ctx.db.reset_tasks()
    seconds, pool_size = asyncio.run(_async_sends(ctx.db.url, n, concurrency))
    rate = n / seconds
    return Outcome(
        f"{n:,} send_async() with {concurrency} in flight ({pool_size} producer connections open) in "
        f"{seconds:.2f}s = {rate:,.0f} tasks/s",
        [Row("send_async_concurrent", "tasks/s", rate, "", f">= {SEND_TARGET:,}/s", rate >= SEND_TARGET)],
        {
            "tasks": n,
            "concurrency": concurrency,
            "producer_connections": pool_size,
            "seconds": seconds,
            "tasks_per_s": rate,
        },
    )


async def _async_sends(url: str, n: int, concurrency: int) -> tuple[float, int]:
    app = make_app(url, pool_max_size=concurrency)
    noop = app.tasks["noop"]
    try:

        async def sender(count: int) -> None:
            for _ in range(count):
                await noop.send_async()

        # One send first, so the first uses do not race each other to build the pool; then an
        # untimed warm-up lets the pool grow and psycopg prepare its statements.
        await noop.send_async()
        await asyncio.gather(*(sender(20) for _ in range(concurrency)))
        per, extra = divmod(n, concurrency)
        t0 = time.perf_counter()
        await asyncio.gather(*(sender(per + (i < extra)) for i in range(concurrency)))
        seconds = time.perf_counter() - t0
        # However send_async is built (async pool, or the sync pool in threads), count the
        # connections the producer holds: at most `concurrency` sends can really be in flight.
        connections = await asyncio.to_thread(_producer_connections, url)
    finally:
        aclose = getattr(app.broker, "aclose", None)  # present in some versions of the broker
        if aclose is not None:
            await aclose()
        await asyncio.to_thread(app.close)
    return seconds, connections


def _producer_connections(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'tether' AND query NOT ILIKE 'LISTEN%%'"
        ).fetchone()
    return int(row[0]) if row else 0


def commit_ceiling(ctx: Context) -> Outcome:
    """What one client gets from this server for one statement per commit, with no tether code.

    A temp table writes no WAL, so its commits are not flushed to disk: that row is the
    round-trip ceiling, not a durable one. An ordinary table's commit waits for the WAL
    fsync, as every send() does. The insert_task row runs tether's own enqueue statement
    (same SQL and values as noop.send()) straight through psycopg: the server-side cost
    of a send without tether's Python.
    """
    n, warmup = 2_000, 100
    ctx.db.reset_tasks()
    figures: dict[str, float] = {}

    def send_params(_: int) -> dict[str, Any]:
        return {
            "id": uuid.uuid4(),
            "name": "noop",
            "queue": "default",
            "priority": 0,
            "args": "[]",
            "kwargs": "{}",
            "max_retries": 0,
            "retry_policy": None,
            "good_until": None,
            "delay": timedelta(0),
            "durable": True,
            "run_at": None,
            "notify_always": False,
            "trace_context": None,
            "concurrency_key": None,
        }

    with psycopg.connect(ctx.db.url, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE bench_commit_temp (id bigint, at timestamptz DEFAULT now())")
        conn.execute("CREATE TABLE bench_commit_logged (id bigint, at timestamptz DEFAULT now())")
        try:
            for label, statement, params in (
                ("temp", "INSERT INTO bench_commit_temp (id) VALUES (%s)", lambda i: (i,)),
                ("logged", "INSERT INTO bench_commit_logged (id) VALUES (%s)", lambda i: (i,)),
                ("insert_task", q("insert_task"), send_params),
                ("select", "SELECT %s::bigint", lambda i: (i,)),
            ):
                for i in range(warmup):
                    conn.execute(statement, params(i))  # type: ignore[arg-type]
                t0 = time.perf_counter()
                for i in range(n):
                    conn.execute(statement, params(i))  # type: ignore[arg-type]
                figures[label] = n / (time.perf_counter() - t0)
        finally:
            conn.execute("DROP TABLE bench_commit_logged")
    return Outcome(
        f"{n:,} autocommit statements, one client: INSERT temp table (no WAL, no fsync) "
        f"{figures['temp']:,.0f}/s, INSERT ordinary table (fsync'd) {figures['logged']:,.0f}/s, "
        f"tether's insert_task statement via raw psycopg {figures['insert_task']:,.0f}/s, "
        f"SELECT round trips {figures['select']:,.0f}/s",
        [
            Row("commit_ceiling", "INSERT temp table (no fsync), commits/s", figures["temp"], ""),
            Row("commit_ceiling", "INSERT ordinary table (fsync), commits/s", figures["logged"], ""),
            Row("commit_ceiling", "insert_task via raw psycopg, commits/s", figures["insert_task"], ""),
            Row("commit_ceiling", "SELECT round trips/s", figures["select"], ""),
        ],
        {
            "statements": n,
            "temp_table_commits_per_s": figures["temp"],
            "logged_table_commits_per_s": figures["logged"],
            "insert_task_raw_commits_per_s": figures["insert_task"],
            "select_round_trips_per_s": figures["select"],
        },
    )


# -- 2. batches ----------------------------------------------------------------------------


def send_many(ctx: Context) -> Outcome:
    batches, size = (3 if ctx.quick else 10), 10_000
    ctx.db.reset_tasks()
    app = make_app(ctx.db.url)
    noop = app.tasks["noop"]
    times = []
    try:
        noop.send_many([()] * 100)  # untimed: pool connection and schema check
        for _ in range(batches):
            t0 = time.perf_counter()
            noop.send_many([()] * size)
            times.append(time.perf_counter() - t0)
    finally:
        app.close()
    stored = sum(count_by_status(ctx.db).values())
    if stored != batches * size + 100:
        raise RuntimeError(f"expected {batches * size + 100} rows, found {stored}")
    rate = batches * size / sum(times)
    return Outcome(
        f"{batches} x send_many({size:,}) in {sum(times):.2f}s = {rate:,.0f} tasks/s "
        f"(batch min/median/max {min(times) * 1000:.0f}/{statistics.median(times) * 1000:.0f}/"
        f"{max(times) * 1000:.0f} ms)",
        [Row("send_many", "tasks/s", rate, "", f">= {SEND_MANY_TARGET:,}/s", rate >= SEND_MANY_TARGET)],
        {"batches": batches, "batch_size": size, "batch_seconds": times, "tasks_per_s": rate},
    )


# -- 3. worker throughput -----------------------------------------------------------------------


def throughput(ctx: Context) -> Outcome:
    n = 2_000 if ctx.quick else 10_000
    ctx.db.reset_tasks()
    app = make_app(ctx.db.url)
    try:
        app.tasks["noop"].send_many([()] * n)
    finally:
        app.close()
    worker = ctx.start_worker(processes=2)
    try:
        seen_at = wait_all_terminal(ctx.db, worker, timeout=900, interval=0.1)
        wall = seen_at - worker.started_at
    finally:
        worker.stop()
    ((completed, first_start, last_done, span, claim_to_start_ms),) = ctx.db.query(
        "SELECT count(*) FILTER (WHERE status = 'COMPLETED'), min(started_at), max(completed_at),"
        " extract(epoch FROM max(completed_at) - min(started_at)),"
        " 1000 * extract(epoch FROM avg(started_at - claimed_at))"
        " FROM tether_tasks"
    )
    if completed != n:
        raise RuntimeError(f"{completed} of {n} tasks COMPLETED: {count_by_status(ctx.db)}")
    span = float(span)
    rate = n / span
    return Outcome(
        f"{n:,} noop tasks, 1 worker x 2 processes: first started_at -> last completed_at "
        f"{span:.2f}s = {rate:,.0f} tasks/s; wall from worker start {wall:.2f}s ({n / wall:,.0f} tasks/s)",
        [
            Row(
                "throughput",
                "tasks/s (db time)",
                rate,
                "",
                f">= {THROUGHPUT_TARGET:,}/s",
                rate >= THROUGHPUT_TARGET,
            ),
            Row("throughput", "wall, worker start -> all COMPLETED", wall, "s"),
        ],
        {
            "tasks": n,
            "db_span_s": span,
            "tasks_per_s": rate,
            "wall_s": wall,
            "first_started_at": str(first_start),
            "last_completed_at": str(last_done),
            "avg_claimed_to_started_ms": float(claim_to_start_ms),
        },
    )


# -- 4. pickup latency ---------------------------------------------------------------------------


def paced_sends(ctx: Context, worker: WorkerProcess, task: Any, n: int) -> list[uuid.UUID]:
    """Once ``worker`` is ready and warm, ``n`` sends of ``task`` 10-20 ms apart; returns their ids
    once all are terminal (the pickup latency scenarios)."""
    rng = random.Random(7)
    worker.wait_ready()
    for _ in range(20):  # untimed warm-up: connections, prepared statements, first claims
        task.send()
        time.sleep(0.015)
    wait_all_terminal(ctx.db, worker, timeout=60, interval=0.02)
    ids = []
    for _ in range(n):
        ids.append(task.send().id)
        time.sleep(rng.uniform(0.010, 0.020))
    wait_all_terminal(ctx.db, worker, timeout=120, interval=0.02)
    return ids


def pickup_latency(ctx: Context) -> Outcome:
    n = 100 if ctx.quick else 500
    ctx.db.reset_tasks()
    worker = ctx.start_worker(processes=2)
    app = make_app(ctx.db.url)
    try:
        ids = paced_sends(ctx, worker, app.tasks["noop"], n)
    finally:
        app.close()
        worker.stop()
    rows = ctx.db.query(
        "SELECT status, 1000 * extract(epoch FROM started_at - sent_at),"
        " 1000 * extract(epoch FROM claimed_at - sent_at), 1000 * extract(epoch FROM started_at - claimed_at)"
        " FROM tether_tasks WHERE id = ANY(%s)",
        (ids,),
    )
    bad = [r[0] for r in rows if r[0] != "COMPLETED"]
    if len(rows) != n or bad:
        raise RuntimeError(f"expected {n} COMPLETED tasks, got {len(rows)} rows, {len(bad)} not COMPLETED")
    pickup = sorted(float(r[1]) for r in rows)
    to_claim = sorted(float(r[2]) for r in rows)
    claim_to_start = sorted(float(r[3]) for r in rows)
    p = {q: percentile(pickup, q) for q in (50, 95, 99)}
    return Outcome(
        f"{n} sends 10-20 ms apart to an idle worker: started_at - sent_at p50 {p[50]:.2f} ms, "
        f"p95 {p[95]:.2f} ms, p99 {p[99]:.2f} ms, max {pickup[-1]:.2f} ms "
        f"(of which sent->claimed p50 {percentile(to_claim, 50):.2f} ms, "
        f"claimed->started p50 {percentile(claim_to_start, 50):.2f} ms)",
        [
            Row("pickup_latency", "p50", p[50], "ms", f"<= {P50_TARGET_MS:g} ms", p[50] <= P50_TARGET_MS),
            Row("pickup_latency", "p95", p[95], "ms"),
            Row("pickup_latency", "p99", p[99], "ms", f"<= {P99_TARGET_MS:g} ms", p[99] <= P99_TARGET_MS),
        ],
        {
            "tasks": n,
            "p50_ms": p[50],
            "p95_ms": p[95],
            "p99_ms": p[99],
            "max_ms": pickup[-1],
            "sent_to_claimed_ms": {str(q): percentile(to_claim, q) for q in (50, 95, 99)},
            "claimed_to_started_ms": {str(q): percentile(claim_to_start, q) for q in (50, 95, 99)},
        },
    )


# -- 5. memory -----------------------------------------------------------------------------------


def memory(ctx: Context) -> Outcome:
    n = 2_000 if ctx.quick else 10_000
    ctx.db.reset_tasks()
    worker = ctx.start_worker(processes=2)
    app = make_app(ctx.db.url)
    noop = app.tasks["noop"]
    readings: dict[str, dict[str, Any]] = {}
    try:
        worker.wait_ready()
        readings["idle"] = _settled_memory(worker)
        for label in ("after_first", "after_second"):
            noop.send_many([()] * n)
            wait_all_terminal(ctx.db, worker, timeout=900, interval=0.1)
            readings[label] = _settled_memory(worker)
    finally:
        app.close()
        worker.stop()
    statuses = count_by_status(ctx.db)
    if statuses.get("COMPLETED") != 2 * n:
        raise RuntimeError(f"expected {2 * n} COMPLETED, got {statuses}")
    mb = {k: v["rss"] / MB for k, v in readings.items()}
    delta = mb["after_second"] - mb["after_first"]
    return Outcome(
        f"worker + 2 children RSS: idle {mb['idle']:.1f} MB, after {n:,} tasks {mb['after_first']:.1f} MB, "
        f"after {2 * n:,} {mb['after_second']:.1f} MB (growth over the second {n:,}: {delta:+.1f} MB; "
        f"PSS {readings['after_second']['pss'] / MB:.1f} MB)",
        [
            Row(
                "memory",
                "RSS idle after start",
                mb["idle"],
                "MB",
                f"< {RSS_LIMIT_MB:g} MB",
                mb["idle"] < RSS_LIMIT_MB,
            ),
            Row(
                "memory",
                f"RSS after {n:,} tasks",
                mb["after_first"],
                "MB",
                f"< {RSS_LIMIT_MB:g} MB",
                mb["after_first"] < RSS_LIMIT_MB,
            ),
            Row(
                "memory",
                f"RSS after {2 * n:,} tasks",
                mb["after_second"],
                "MB",
                f"< {RSS_LIMIT_MB:g} MB",
                mb["after_second"] < RSS_LIMIT_MB,
            ),
            Row(
                "memory",
                f"RSS growth, second {n:,}",
                delta,
                "MB",
                f"< {RSS_GROWTH_MB:g} MB",
                delta < RSS_GROWTH_MB,
            ),
        ],
        {"tasks_per_round": n, "readings": readings, "rss_mb": mb, "growth_mb": delta},
    )


def _settled_memory(worker: WorkerProcess, timeout: float = 10.0) -> dict[str, Any]:
    """RSS of the worker tree once two readings 0.5 s apart agree within 0.5 MB (or after timeout)."""
    deadline = time.monotonic() + timeout
    last, _ = worker.rss_bytes()
    while True:
        time.sleep(0.5)
        worker.check_alive()
        total, per_pid = worker.rss_bytes()
        if abs(total - last) < MB / 2 or time.monotonic() > deadline:
            names = {}
            for p in worker.tree():
                try:
                    names[p.pid] = " ".join(p.cmdline()[-3:])
                except psutil.Error:  # a helper that just exited
                    names[p.pid] = "?"
            return {
                "rss": total,
                "pss": worker.pss_bytes(),
                "processes": [
                    {"pid": pid, "rss_mb": rss / MB, "cmd": names.get(pid, "?")}
                    for pid, rss in per_pid.items()
                ],
            }
        last = total


CORE_SCENARIOS: dict[str, Callable[[Context], Outcome]] = {
    "send_single": send_single,
    "send_async_concurrent": send_async_concurrent,
    "commit_ceiling": commit_ceiling,
    "send_many": send_many,
    "throughput": throughput,
    "pickup_latency": pickup_latency,
    "memory": memory,
}
