"""``held_horizon``: no-op drain throughput while a transaction holds back the vacuum.

A client opens ``REPEATABLE READ``, reads a row and stays open: from then on no row
version that a later transaction replaced or deleted can be removed, by a vacuum or by
the index scans that normally mark dead entries, until it ends.

Held and clean run **side by side**, at the same moment, in two databases of the same
server, each with its own worker (``--processes 2``): on a shared machine whose load moves
by tens of percent within a minute, runs one after the other compare the moments as much
as the configurations; side by side, both see the same load. (Since PostgreSQL 14, a
transaction holds back the removal of rows of its own database only, so the clean database
is not affected by the held one.) Each round:

1. churn: in both databases, ``churn`` no-op tasks sent with ``send_many`` in batches of
   1,000 while the worker runs (at most 2,000 waiting); each churn's duration;
2. drain: ``drain`` no-op tasks are sent in both with no worker running, then both workers
   are started; the figure is the tasks each finished during the same window (from
   ``WARMUP_S`` after the start until the first database finishes), per second, and the
   held/clean ratio;
3. recovery: the held transaction ends and the drain runs again, side by side, with no
   VACUUM (on a server with autovacuum off, what recovers is tether's own doing).

Rounds: 2 (``--quick``: 1, with 4,000 tasks of churn and drains of 4,000);
``TETHER_BENCH_HELD_ROUNDS`` sets another number. Side by side, the two share the machine's
two cores, so CPU one spends the other lacks: the ratio understates a difference of CPU.
``TETHER_BENCH_HELD_MODE=alternate`` runs each step in the held database, then in the clean
one, each worker alone (held, clean, held, clean, ...): no sharing, but each run meets the
machine's load of its own moment.

Progress is watched by counting ``tether_task_attempts`` (one row per finished no-op
task; insert-only, so the hold leaves it no dead rows): a count of PENDING rows would
itself read every dead entry of the claim index, in the held database only. Dead row
versions per table (``pg_stat_user_tables.n_dead_tup``) are read after the churn and after
the drain.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from tests.harness import WorkerProcess

from bench.apps import make_app
from bench.infra import BenchDatabase, bench_worker, wait_for
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
WARMUP_S = 2.0  # after both workers started: interpreter and children start-up


def held_horizon(ctx: Context) -> Outcome:
    churn, drain = (4_000, 4_000) if ctx.quick else (20_000, 20_000)
    rounds = int(os.environ.get("TETHER_BENCH_HELD_ROUNDS") or (1 if ctx.quick else 2))
    held_db = BenchDatabase(ctx.db.server_url)
    held_db.create()
    try:
        schema = make_app(held_db.url)
        try:
            _ = schema.broker.url  # migrates the second database
        finally:
            schema.close()
        runs = [_round(ctx, held_db, churn, drain, n) for n in range(rounds)]
    finally:
        held_db.drop()
    ratios = [r["drain"]["ratio"] for r in runs]
    recovered = [r["after_release"]["ratio"] for r in runs]
    return Outcome(
        f"{churn:,} tasks of churn, then drains of {drain:,}, held and clean"
        + (
            " one after the other:"
            if os.environ.get("TETHER_BENCH_HELD_MODE") == "alternate"
            else " side by side:"
        )
        + " held/clean per round "
        + ", ".join(f"{x:.2f}" for x in ratios)
        + "; after the hold ends "
        + ", ".join(f"{x:.2f}" for x in recovered)
        + "; churn held/clean "
        + ", ".join(f"{r['churn_s']['held']:.1f}/{r['churn_s']['clean']:.1f}s" for r in runs)
        + "; dead tether_tasks rows after a held churn "
        + f"{runs[0]['dead_after_churn']['held']['tether_tasks']:,}",
        [
            Row(
                "held_horizon",
                "drain with the horizon held / without (median of rounds)",
                statistics.median(ratios),
                "x",
                f">= {RATIO_TARGET}x",
                min(ratios) >= RATIO_TARGET,
            ),
            Row("held_horizon", "drain after the hold ends / without", statistics.median(recovered), "x"),
            Row(
                "held_horizon",
                "drain, held (side by side)",
                statistics.median(r["drain"]["held"] for r in runs),
                "tasks/s",
            ),
            Row(
                "held_horizon",
                "drain, clean (side by side)",
                statistics.median(r["drain"]["clean"] for r in runs),
                "tasks/s",
            ),
        ],
        {"churn": churn, "drain": drain, "ratios": ratios, "recovered": recovered, "rounds": runs},
    )


def _round(ctx: Context, held_db: BenchDatabase, churn: int, drain: int, n: int) -> dict[str, Any]:
    together = os.environ.get("TETHER_BENCH_HELD_MODE", "side_by_side") != "alternate"
    dbs = {"held": held_db, "clean": ctx.db}
    for db in dbs.values():
        db.reset_tasks()
    run: dict[str, Any] = {}
    holder = psycopg.connect(held_db.url)
    try:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM tether_schema_version").fetchone()  # reads: takes its snapshot
        run["churn_s"] = _side_by_side(ctx, dbs, lambda db, worker: _churn(db, worker, churn), together)
        run["dead_after_churn"] = {k: _dead(db) for k, db in dbs.items()}
        run["drain"] = _drain(ctx, dbs, drain, together)
        run["dead_after_drain"] = {k: _dead(db) for k, db in dbs.items()}
    finally:
        holder.close()  # the hold ends: nothing vacuums (autovacuum is off on the test server)
    run["after_release"] = _drain(ctx, dbs, drain, together)
    print(
        f"held_horizon           round {n + 1}: churn held {run['churn_s']['held']:.1f}s / clean"
        f" {run['churn_s']['clean']:.1f}s; drain held {run['drain']['held']:,.0f} / clean"
        f" {run['drain']['clean']:,.0f} tasks/s = {run['drain']['ratio']:.2f}; after the hold ends"
        f" {run['after_release']['held']:,.0f} / {run['after_release']['clean']:,.0f} ="
        f" {run['after_release']['ratio']:.2f}; dead rows after the churn {run['dead_after_churn']}",
        flush=True,
    )
    return run


def _start(ctx: Context, db: BenchDatabase, label: str) -> WorkerProcess:
    worker = bench_worker(
        db, ctx.log_dir / f"held-horizon-{label}-{len(ctx.workers)}.log", 2, exclusive=False
    )
    ctx.workers.append(worker)
    return worker.start()


def _side_by_side(
    ctx: Context,
    dbs: dict[str, BenchDatabase],
    work: Callable[[BenchDatabase, WorkerProcess], float],
    together: bool = True,
) -> dict[str, float]:
    """``work`` in every database at once (or one after the other), each with its own worker;
    each one's result."""
    if not together:
        return {label: _side_by_side(ctx, {label: db}, work)[label] for label, db in dbs.items()}
    results: dict[str, float] = {}
    errors: list[BaseException] = []
    workers = {label: _start(ctx, db, label) for label, db in dbs.items()}

    def one(label: str) -> None:
        try:
            results[label] = work(dbs[label], workers[label])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(label,)) for label in dbs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for worker in workers.values():
            worker.stop()
    if errors:
        raise errors[0]
    return results


def _churn(db: BenchDatabase, worker: WorkerProcess, n: int) -> float:
    app = make_app(db.url)
    noop = app.tasks["noop"]
    base = _finished(db)
    try:
        t0 = time.perf_counter()
        sent = 0
        while sent < n:
            noop.send_many([()] * min(BATCH, n - sent))
            sent += min(BATCH, n - sent)
            while sent - (_finished(db) - base) > MAX_WAITING - BATCH:
                worker.check_alive()
                time.sleep(0.02)
        _wait_finished(db, base + n, worker)
        return time.perf_counter() - t0
    finally:
        app.close()


def _drain(ctx: Context, dbs: dict[str, BenchDatabase], n: int, together: bool = True) -> dict[str, float]:
    """Both drains at once (or one after the other); each one's rate over the window in which
    both were running (or its own, until it finished)."""
    if not together:
        rates = {label: _drain(ctx, {label: db}, n)[label] for label, db in dbs.items()}
        return {**rates, "ratio": rates["held"] / rates["clean"]}
    base = {}
    for label, db in dbs.items():
        app = make_app(db.url)
        try:
            app.tasks["noop"].send_many([()] * n)
        finally:
            app.close()
        base[label] = _finished(db)
    workers = {label: _start(ctx, db, label) for label, db in dbs.items()}
    try:
        time.sleep(WARMUP_S)
        t0, at0 = time.perf_counter(), {label: _finished(db) for label, db in dbs.items()}
        while True:
            done = {label: _finished(db) - base[label] for label, db in dbs.items()}
            if max(done.values()) >= n:  # one finished: the window closes
                break
            for worker in workers.values():
                worker.check_alive()
            time.sleep(0.05)
        window = time.perf_counter() - t0
        at1 = {label: _finished(db) for label, db in dbs.items()}
        for label, db in dbs.items():
            _wait_finished(db, base[label] + n, workers[label])
    finally:
        for worker in workers.values():
            worker.stop()
    rates = {label: (at1[label] - at0[label]) / window for label in dbs}
    if len(dbs) == 1:
        return rates
    return {**rates, "ratio": rates["held"] / rates["clean"], "window_s": window}


def _finished(db: BenchDatabase) -> int:
    return int(db.query("SELECT count(*) FROM tether_task_attempts")[0][0])


def _wait_finished(db: BenchDatabase, total: int, worker: WorkerProcess) -> None:
    def done() -> bool:
        worker.check_alive()
        return _finished(db) >= total

    wait_for("the tasks to finish", done, timeout=1800, interval=0.05)


def _dead(db: BenchDatabase) -> dict[str, int]:
    # Counters reach the statistics when a session's transaction ends (workers are stopped).
    time.sleep(0.6)
    rows = db.query(
        "SELECT relname, n_dead_tup FROM pg_stat_user_tables WHERE relname = ANY(%s)", (list(TABLES),)
    )
    return {name: int(n) for name, n in rows}


HELD_HORIZON_SCENARIOS = {"held_horizon": held_horizon}
