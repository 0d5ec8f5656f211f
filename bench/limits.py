"""Flow control (docs/limits.md): what limits cost.

- limits_throughput: no-op tasks drained by one worker, in interleaved rounds of the same
  run, on the sync executor (1 worker x 2 processes) and the async one (1 async child):
  ``unlimited`` (the plain claim), ``queue_limit`` (the queue has max_in_flight 100,000:
  the limited claim, a limit that never binds) and ``per_key`` (per_key 100 over 100
  keys, each task carrying one). Figure: tasks/s in database time, each limited kind as a
  share of the unlimited one of its executor (target >= 80 %).
- limited_claim_cost: the limited claim's time (its statement(s), in one
  transaction, rolled back so the backlog stays) with 10,000 and with 100,000 PENDING
  tasks spread over 1,000 keys: it reads a window of keys, not the backlog.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg

from bench import async_apps
from bench.apps import make_app
from bench.infra import (
    BenchDatabase,
    count_by_status,
    session_cpu,
    session_cpu_since,
    settled,
    tree_cpu,
    wait_all_terminal,
)
from bench.scenarios import Context, Outcome, Row
from tether.broker import limited_claims
from tether.broker.limited_claims import KeyCursor

SHARE_TARGET = 0.80
KINDS = ("unlimited", "queue_limit", "per_key")
EXECUTORS = ("sync", "async")
KEYS = 100


def set_limits(db: BenchDatabase, kind: str, per_key: int = 100) -> None:
    """The limits of ``kind`` (KINDS) on the queue 'default' of ``db``, the others dropped."""
    with db.connect() as conn:
        conn.execute("DELETE FROM tether_queue_limits")
        if kind == "queue_limit":
            conn.execute("INSERT INTO tether_queue_limits (queue, max_in_flight) VALUES ('default', 100000)")
        elif kind == "per_key":
            conn.execute(
                "INSERT INTO tether_queue_limits (queue, per_key) VALUES ('default', %s)", (per_key,)
            )


def _drain(ctx: Context, kind: str, executor: str, n: int) -> tuple[float, float]:
    """One worker, started and settled first, then sent n no-op tasks at once (one
    transaction; with keys for per_key) and left to drain them. Returns tasks/s (database
    time) and the CPU microseconds per task of the worker's processes and of its database
    sessions together: on this 2-core machine, where the worker and the server share the
    cores, that CPU is what the drain's throughput is made of, and it moves much less than
    the throughput with other processes' load."""
    ctx.db.reset_tasks()
    set_limits(ctx.db, kind)
    if executor == "async":
        worker = ctx.start_worker(
            processes=0,
            app_path="bench.async_apps:app",
            extra_args=("--async-processes", "1", "--async-concurrency", "100"),
        )
    else:
        worker = ctx.start_worker(processes=2)
    app = async_apps.make_app(ctx.db.url) if executor == "async" else make_app(ctx.db.url)
    task = app.tasks["anoop" if executor == "async" else "noop"]
    try:
        worker.wait_registered()
        settled(worker.pid, 1 if executor == "async" else 2)
        cpu_before, sessions_before = tree_cpu(worker.pid), session_cpu(ctx.db)
        if kind == "per_key":
            per = n // KEYS
            sends = [(f"key-{k:03d}", per) for k in range(KEYS)]
        else:
            sends = [(None, n)]
        with ctx.db.connect() as conn, conn.transaction():  # one commit: all due at once
            for key, count in sends:
                keyed = {} if key is None else {"concurrency_key": key}
                task.with_options(connection=conn, **keyed).send_many([()] * count)
        wait_all_terminal(ctx.db, worker, timeout=900, interval=0.05)
        cpu = tree_cpu(worker.pid) - cpu_before + session_cpu_since(ctx.db, sessions_before)
    finally:
        app.close()
        worker.stop()
    ((completed, span),) = ctx.db.query(
        "SELECT count(*) FILTER (WHERE status = 'COMPLETED'),"
        " extract(epoch FROM max(completed_at) - min(started_at)) FROM tether_tasks"
    )
    if completed != n:
        raise RuntimeError(f"{kind}/{executor}: {completed} of {n} COMPLETED: {count_by_status(ctx.db)}")
    return n / float(span), 1e6 * cpu / n


def limits_throughput(ctx: Context) -> Outcome:
    n = 2_000 if ctx.quick else 10_000
    rounds = 1 if ctx.quick else 3
    runs: dict[str, list[float]] = {f"{k}/{e}": [] for e in EXECUTORS for k in KINDS}
    cpus: dict[str, list[float]] = {f"{k}/{e}": [] for e in EXECUTORS for k in KINDS}
    for r in range(rounds):
        for executor in EXECUTORS:
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:  # drift hits every kind alike
                rate, cpu = _drain(ctx, kind, executor, n)
                runs[f"{kind}/{executor}"].append(rate)
                cpus[f"{kind}/{executor}"].append(cpu)
    set_limits(ctx.db, "unlimited")

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    rows: list[Row] = []
    parts: list[str] = []
    for executor in EXECUTORS:
        base = median(runs[f"unlimited/{executor}"])
        base_cpu = median(cpus[f"unlimited/{executor}"])
        rows.append(Row("limits_throughput", f"unlimited, {executor} (tasks/s, median)", base, ""))
        rows.append(Row("limits_throughput", f"unlimited, {executor} (CPU a task, median)", base_cpu, "us"))
        parts.append(f"{executor}: unlimited {base:,.0f}/s, {base_cpu:,.0f} us CPU a task")
        for kind in KINDS[1:]:
            rate = median(runs[f"{kind}/{executor}"])
            cpu = median(cpus[f"{kind}/{executor}"])
            share = rate / base
            # What the limited claim leaves of the machine's capacity: the unlimited drain's
            # CPU per task over this one's (worker and its server sessions, which share the
            # two cores); the throughput share beside it moves with other processes' load.
            capacity = base_cpu / cpu
            rows.append(Row("limits_throughput", f"{kind}, {executor}: share of unlimited", 100 * share, "%"))
            rows.append(
                Row(
                    "limits_throughput",
                    f"{kind}, {executor}: CPU share (unlimited CPU a task / this one's)",
                    100 * capacity,
                    "%",
                    f">= {100 * SHARE_TARGET:.0f} %",
                    capacity >= SHARE_TARGET,
                )
            )
            parts.append(
                f"{kind} {rate:,.0f}/s ({100 * share:.0f} %), {cpu:,.0f} us ({100 * capacity:.0f} %)"
            )
    return Outcome(
        f"{n:,} no-op tasks, {rounds} interleaved round(s), 1 worker (2 sync processes / 1 async child): "
        + "; ".join(parts),
        rows,
        {"tasks": n, "rounds": rounds, "runs": runs, "cpu_us_per_task": cpus},
    )


def _fill(ctx: Context, n: int, keys: int) -> None:
    with ctx.db.connect() as conn:
        conn.execute(
            "INSERT INTO tether_tasks (id, name, queue, concurrency_key) "
            "SELECT gen_random_uuid(), 'noop', 'default', 'key-' || lpad((i %% %s)::text, 4, '0') "
            "FROM generate_series(1, %s) i",
            (keys, n),
        )
        conn.execute("VACUUM (ANALYZE) tether_tasks")


async def _claim_times(url: str, claims: int) -> list[float]:
    """Seconds per limited claim of 2 tasks, each rolled back (the backlog stays as it is)."""
    times: list[float] = []
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True, row_factory=psycopg.rows.dict_row)
    cursor = KeyCursor()
    try:
        for _ in range(claims):
            t0 = time.perf_counter()
            try:
                async with conn.transaction():
                    await limited_claims.claim_limited(
                        conn,
                        queue="default",
                        worker_id="bench",
                        cursor=cursor,
                        limit=2,
                        async_limit=0,
                        async_names=[],
                        skip_names=[],
                    )
                    times.append(time.perf_counter() - t0)
                    raise _Rollback
            except _Rollback:
                pass
    finally:
        await conn.close()
    return times


class _Rollback(Exception):
    pass


def limited_claim_cost(ctx: Context) -> Outcome:
    keys = 1_000
    results: dict[int, dict[str, float]] = {}
    for backlog in (10_000, 100_000):
        ctx.db.reset_tasks()
        set_limits(ctx.db, "per_key", per_key=2)
        _fill(ctx, backlog, keys)
        times = sorted(asyncio.run(_claim_times(ctx.db.url, 300))[20:])  # the first 20 warm up
        results[backlog] = {
            "p50_ms": 1000 * times[len(times) // 2],
            "p95_ms": 1000 * times[int(len(times) * 0.95)],
        }
    set_limits(ctx.db, "unlimited")
    small, big = results[10_000], results[100_000]
    return Outcome(
        f"limited claim of 2 (in one transaction, rolled back), {keys:,} keys: "
        f"10,000 PENDING p50 {small['p50_ms']:.2f} ms p95 {small['p95_ms']:.2f} ms; "
        f"100,000 PENDING p50 {big['p50_ms']:.2f} ms p95 {big['p95_ms']:.2f} ms",
        [
            Row("limited_claim_cost", "10,000 PENDING over 1,000 keys: p50", small["p50_ms"], "ms"),
            Row("limited_claim_cost", "100,000 PENDING over 1,000 keys: p50", big["p50_ms"], "ms"),
            Row(
                "limited_claim_cost",
                "growth 10k -> 100k (p50 ratio)",
                big["p50_ms"] / small["p50_ms"],
                "x",
                "<= 1.5 x",
                big["p50_ms"] / small["p50_ms"] <= 1.5,
            ),
        ],
        {"keys": keys, "results": {str(k): v for k, v in results.items()}},
    )


LIMITS_SCENARIOS: dict[str, Any] = {
    "limits_throughput": limits_throughput,
    "limited_claim_cost": limited_claim_cost,
}
