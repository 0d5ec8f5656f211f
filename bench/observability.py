"""``observability``: what metrics and tracing cost a worker's no-op throughput, and a scrape.

    .venv/bin/python -m bench.observability [--tasks 10000] [--rounds 3]

For the sync executor (``bench.apps``, ``noop``, 2 processes) and the async one
(``bench.async_apps``, ``anoop``, 1 async child), in interleaved rounds (off, on, off, on,
... so the machine's drift hits both alike): ``--tasks`` no-op tasks sent with one
``send_many``, then one worker started to drain them; the figure is tasks per second
between the first ``started_at`` and the last ``completed_at`` (database time), as the
``throughput`` scenario measures it.

- off: tether's defaults (no --metrics-port, tracing off);
- metrics: ``--metrics-port`` with this run scraping it every second (each scrape also reads
  the queues' state from the database);
- tracing: ``TETHER_TRACING=1`` with the OpenTelemetry SDK installed in every process of the
  worker and a batch processor whose exporter drops the spans (bench/otel_sdk.py), and the
  tasks sent traced by a producer with the SDK (so each run extracts and links its send's
  context), every trace sampled;
- on: both; sampled: both, with 1 % of traces sampled (ParentBased(TraceIdRatioBased));
  tracing_sampled: tracing alone, 1 % sampled. ``--kinds async`` (or sync) runs one executor;
- sdk: the SDK installed in the worker (its batch processor's thread, which also makes the
  worker start its fork server as a new interpreter), tracing off, sends untraced; thread:
  no SDK, only an idle thread started at the app's import (the same fork server start).
  Both decompose what the SDK's presence costs apart from tether's tracing;
- metrics_unscraped: metrics on, the endpoint never scraped (the counting alone, apart from
  the scrapes' cost).

The tasks are sent in sends of SEND_CHUNK, all in one transaction: traced, each send is a
trace, so 1 % sampled samples about 1 % of the runs (one send_many of all of them was one
trace: no run sampled, or all).

Beside the throughput, the worker's CPU time per task (its processes' user + system time over
the run, after a warm-up): on a shared machine the throughput moves with others' load, the
CPU time much less. Each run also prints the main process's share (its threads: the
metrics endpoint's, included) and the children's.

Then, with ``--history N`` terminal rows (default 1,000,000) filled by SQL, the median time
of a scrape of the dashboard's /metrics (``DashboardMetrics.exposition``, what a scrape
runs), after a few untimed ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from tests.harness import WorkerProcess

from bench import otel_sdk
from bench.infra import DEFAULT_SERVER_URL, BenchDatabase, bench_worker, settled, tree_cpu, wait_all_terminal
from tether import AppConfig, PostgresConfig, Tether
from tether.db.migrate import migrate

PORT = 19150  # --metrics-port: another session's bench may hold this one
# Tasks per send (each a trace when traced): 10,000 tasks are 1,000 traces, so 1 % sampled
# samples about 100 runs of a drain, not all or none.
SEND_CHUNK = 10
KINDS = {
    "sync": ("bench.apps:app", "noop", ("--processes", "2", "--async-processes", "0")),
    "async": ("bench.async_apps:app", "anoop", ("--processes", "0", "--async-processes", "1")),
}

FILL_HISTORY = """
INSERT INTO tether_tasks (id, name, queue, priority, args, kwargs, status, run_at, enqueued_at,
                          sent_at, updated_at, completed_at, attempt, result)
SELECT gen_random_uuid(), 'noop', 'default', 0, '[]'::jsonb, '{}'::jsonb, 'COMPLETED',
       now() - interval '1 day', now() - interval '1 day', now() - interval '1 day', now(), now(), 1,
       '{"ok": null}'::jsonb
FROM generate_series(1, %(n)s)
"""


def producer(url: str, kind: str, traced: bool) -> Tether:
    from bench import apps, async_apps

    app = Tether(AppConfig(broker=PostgresConfig(database_url=url), tracing=traced))
    return apps._register(app) if kind == "sync" else async_apps._register(app)


def is_traced(mode: str) -> bool:
    return mode in ("tracing", "on", "sampled", "tracing_sampled")


def is_metered(mode: str) -> bool:
    return mode in ("metrics", "on", "sampled", "metrics_unscraped")


def sample_ratio(mode: str) -> float:
    """The share of traces sampled, in the producer and in the worker."""
    return 0.01 if mode in ("sampled", "tracing_sampled") else 1.0


def mode_worker(
    db: BenchDatabase, kind: str, mode: str, port: int, log: Path, *, exclusive: bool = True
) -> WorkerProcess:
    """The worker of ``kind`` (sync, async) in ``mode`` (one_run's), not started yet; its
    metrics on ``port`` when the mode has them."""
    app_path, _, args = KINDS[kind]
    env = (
        {
            "TETHER_TRACING": "1",
            "TETHER_BENCH_OTEL_SDK": "1",
            "TETHER_BENCH_OTEL_RATIO": str(sample_ratio(mode)),
        }
        if is_traced(mode)
        else {}
    )
    if mode == "sdk":  # the SDK and its span processor's thread, tracing off, sends untraced
        env = {"TETHER_BENCH_OTEL_SDK": "1"}
    elif mode == "thread":  # no SDK: only an idle thread started at the app's import
        env = {"TETHER_BENCH_IDLE_THREAD": "1"}
    worker = bench_worker(
        db,
        log,
        processes=None,  # type: ignore[arg-type]
        extra_args=(*args, "--metrics-port", str(port)) if is_metered(mode) else args,
        env=env,
        exclusive=exclusive,
        app_path=app_path,
    )
    worker.log_level = "INFO"
    return worker


def one_run(db: BenchDatabase, kind: str, mode: str, n: int, logs: Path) -> tuple[float, float, float]:
    """``mode``: off, metrics, tracing, on (both), sampled (both, 1 % of traces sampled) or
    tracing_sampled (tracing alone, 1 %).
    Returns (tasks/s by database time, worker CPU microseconds per task, the main process's
    share of it): the CPU is what the machine's other load moves least."""
    _, task_name, _ = KINDS[kind]
    traced, metered, ratio = is_traced(mode), is_metered(mode), sample_ratio(mode)
    otel_sdk.set_ratio(ratio)  # the producer's sampler: a run follows its send's decision
    db.reset_tasks()
    worker = mode_worker(db, kind, mode, PORT, logs / f"{kind}-{mode}-{time.monotonic_ns()}.log")
    scrapes: list[float] = []
    stop = threading.Event()

    def scrape_once() -> float | None:
        began = time.perf_counter()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5) as r:
                r.read()
        except OSError:
            return None  # not listening yet
        return time.perf_counter() - began

    def scrape() -> None:
        while not stop.wait(1.0):
            took = scrape_once()
            if took is not None:
                scrapes.append(took)

    app = producer(db.url, kind, traced)
    task = app.tasks[task_name]
    worker.start()
    try:
        worker.wait_registered()
        settled(worker.pid, 2 if kind == "sync" else 1)
        task.send_many([()] * 200)  # warm-up: connections, prepared statements, first spans
        wait_all_terminal(db, worker, timeout=120, interval=0.05)
        ((warm_end,),) = db.query("SELECT max(completed_at) FROM tether_tasks")
        if metered and mode != "metrics_unscraped":
            # One scrape in the warm-up: the first opens the endpoint's database connection
            # (metrics/serve.py) and reads the queues cold, 20-30 ms once in a worker's life,
            # which within a 1-2 s drain was 1-2 us a task of what the steady state never pays.
            scrape_once()
            threading.Thread(target=scrape, daemon=True).start()
        cpu0, main0 = tree_cpu(worker.pid), main_cpu(worker.pid)
        send_in_traces(db, task, n)
        wait_all_terminal(db, worker, timeout=900, interval=0.1)
        cpu, main = tree_cpu(worker.pid) - cpu0, main_cpu(worker.pid) - main0
    finally:
        stop.set()
        app.close()
        worker.stop()
    ((done, span),) = db.query(
        "SELECT count(*) FILTER (WHERE status = 'COMPLETED'),"
        " extract(epoch FROM max(completed_at) - min(started_at)) FROM tether_tasks WHERE started_at > %s",
        (warm_end,),
    )
    if done != n:
        raise RuntimeError(f"{done} of {n} completed after the warm-up")
    return n / float(span), 1e6 * cpu / n, 1e6 * main / n


def send_in_traces(db: BenchDatabase, task: Any, n: int) -> None:
    """``n`` no-op tasks in sends of SEND_CHUNK, each its own trace (traced modes), all in one
    transaction so the worker sees them at once. One send_many of all ``n`` would be one
    trace: at 1 % sampled, either no run of the drain sampled or, once in 100 drains, all."""
    with db.connect() as conn, conn.transaction():
        lent = task.with_options(connection=conn)
        for _ in range(n // SEND_CHUNK):
            lent.send_many([()] * SEND_CHUNK)
        if n % SEND_CHUNK:
            lent.send_many([()] * (n % SEND_CHUNK))


def main_cpu(pid: int) -> float:
    """CPU seconds (user + system) of the worker's main process alone, its threads included."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def scrape_time(db: BenchDatabase, history: int) -> tuple[float, float]:
    from tether.broker import PostgresBroker
    from tether.web.metrics import DashboardMetrics

    db.reset_tasks()
    with db.connect() as conn:
        conn.execute(FILL_HISTORY, {"n": history})
        conn.execute("VACUUM (ANALYZE) tether_tasks")
    broker = PostgresBroker(PostgresConfig(database_url=db.url))
    try:
        metrics = DashboardMetrics(broker)
        times = []
        for i in range(13):
            time.sleep(1.05)  # past the collector's one-second reuse: each scrape reads afresh
            began = time.perf_counter()
            metrics.exposition(None)
            if i >= 3:
                times.append(time.perf_counter() - began)
        return statistics.median(times), max(times)
    finally:
        broker.close()


def main(argv: list[str] | None = None) -> None:
    global PORT
    p = argparse.ArgumentParser(prog="python -m bench.observability")
    p.add_argument("--database-url", default=os.environ.get("TETHER_BENCH_DATABASE_URL", DEFAULT_SERVER_URL))
    p.add_argument("--tasks", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--history", type=int, default=1_000_000)
    p.add_argument("--only", choices=["throughput", "scrape"], default=None)
    p.add_argument(
        "--modes",
        default="off,on",
        help="comma-separated, off first: off, metrics, tracing, on (both), sampled (both, 1 %% of "
        "traces), tracing_sampled (tracing alone, 1 %% of traces), sdk (the SDK installed, tracing off), "
        "metrics_unscraped (metrics, never scraped), thread (an idle thread at the app's import)",
    )
    p.add_argument("--kinds", default="sync,async", help="comma-separated executors: sync, async")
    p.add_argument("--metrics-port", type=int, default=PORT, help="the worker's metrics port (metrics modes)")
    a = p.parse_args(argv)
    PORT = a.metrics_port
    db = BenchDatabase(a.database_url)
    db.create()
    try:
        with db.connect() as conn:
            migrate(conn)
        print(f"load before: {os.getloadavg()}")
        otel_sdk.install(1.0)  # the producer's SDK: traced sends store a sampled context
        if a.only in (None, "throughput"):
            with tempfile.TemporaryDirectory() as tmp:
                modes = a.modes.split(",")
                kinds = [k for k in a.kinds.split(",") if k]
                unknown = [k for k in kinds if k not in KINDS]
                if unknown:
                    p.error(f"--kinds: unknown executor(s) {unknown}; known: {sorted(KINDS)}")
                results: dict[tuple[str, str], list[float]] = {}
                cpus: dict[tuple[str, str], list[float]] = {}
                for r in range(a.rounds):
                    for kind in kinds:
                        for mode in modes if r % 2 == 0 else modes[::-1]:
                            rate, cpu, main_us = one_run(db, kind, mode, a.tasks, Path(tmp))
                            results.setdefault((kind, mode), []).append(rate)
                            cpus.setdefault((kind, mode), []).append(cpu)
                            print(
                                f"round {r + 1} {kind:5} {mode:8}: {rate:8,.0f} tasks/s, "
                                f"worker CPU {cpu:6.0f} us/task (main process {main_us:4.0f}, children "
                                f"{cpu - main_us:4.0f}) (load {os.getloadavg()[0]:.1f})",
                                flush=True,
                            )
                for kind in kinds:
                    off = results[(kind, "off")]
                    for mode in modes[1:]:
                        these = results[(kind, mode)]
                        ratios = [b / a_ for a_, b in zip(off, these, strict=True)]
                        cpu_on = statistics.median(cpus[(kind, mode)])
                        cpu_off = statistics.median(cpus[(kind, "off")])
                        print(
                            f"{kind}: {mode} / off per round "
                            + ", ".join(f"{x:.3f}" for x in ratios)
                            + f" (median {statistics.median(ratios):.3f}); medians "
                            f"{statistics.median(these):,.0f}/s vs {statistics.median(off):,.0f}/s; "
                            f"worker CPU per task median {cpu_on:.0f} us vs {cpu_off:.0f} us "
                            f"({cpu_on / cpu_off:.3f})"
                        )
        if a.only in (None, "scrape"):
            median, worst = scrape_time(db, a.history)
            print(
                f"scrape of /metrics with {a.history:,} terminal rows: median {1000 * median:.1f} ms, "
                f"max {1000 * worst:.1f} ms"
            )
        print(f"load after: {os.getloadavg()}")
    finally:
        db.drop()


if __name__ == "__main__":
    main()
