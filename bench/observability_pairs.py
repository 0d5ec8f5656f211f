"""``observability_pairs``: metrics and tracing's cost on the whole worker, by many short pairs.

    .venv/bin/python -m bench.observability_pairs [--kind async] [--mode sampled] [--pairs 40] [--tasks 3000]

bench/observability.py starts a new worker for every drain: its rounds are a few seconds
apart, and on this 2-core VM a worker's CPU per task moves by ±10 % from one start to the
next (where its children land, how its first claims batch), more than the few percent to
be shown. Here two workers live through the whole run, each on a database of its own on
the same server, one ``off`` (tether's defaults) and one in ``--mode`` (a mode of
bench/observability.py: ``sampled`` is metrics scraped every second and tracing with 1 %
of the traces sampled). Both are started, settled and warmed up, then fed in turns,
``--pairs`` times: ``--tasks`` no-op tasks to one, drained, then the same to the other
(which goes first alternates, so drift within a pair hits both alike). A pair's ratio is
the mode's worker CPU per task over the off worker's, the two drains a second or so apart.

The figure is the median of the pairs' ratios, with a 90 % interval from a sign test (the
pairs between two order statistics of the ratios): an interval wholly under 1.05 shows the
goal (metrics and tracing under 5 % of a no-op task's cost), wholly over it shows it
missed. The throughput ratio (database time) is printed beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import WorkerProcess

from bench import observability, otel_sdk
from bench.infra import DEFAULT_SERVER_URL, BenchDatabase, drain_mark, drain_span, settled, wait_all_terminal
from bench.paired import sign_test_interval
from bench.precise_cpu import sessions_cpu, worker_cpu
from tether.db.migrate import migrate


@dataclass
class Side:
    """One of the pair: a mode's database and its worker, alive through the run."""

    mode: str
    db: BenchDatabase
    worker: WorkerProcess
    port: int
    cpu_us: list[float] = field(default_factory=list)  # per task, one per drain
    main_us: list[float] = field(default_factory=list)  # the main process's part of it
    # its server sessions' CPU per task: the work of its claims and outcomes (the same in both
    # modes), and apart, its metrics endpoint's session's (what the scrapes' reads cost)
    server_us: list[float] = field(default_factory=list)
    scrape_us: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # tasks/s by database time, one per drain
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def traced(self) -> bool:
        return observability.is_traced(self.mode)

    @property
    def metered(self) -> bool:
        return observability.is_metered(self.mode)

    @property
    def ratio(self) -> float:
        return observability.sample_ratio(self.mode)


def start_side(server_url: str, kind: str, mode: str, port: int, logs: Path) -> Side:
    db = BenchDatabase(server_url)
    db.create()
    with db.connect() as conn:
        migrate(conn)
    worker = observability.mode_worker(db, kind, mode, port, logs / f"{kind}-{mode}.log", exclusive=False)
    side = Side(mode, db, worker, port)
    side.worker.start()
    side.worker.wait_registered()
    settled(side.worker.pid, 2 if kind == "sync" else 1)
    return side


def scrape_every(side: Side, seconds: float) -> None:
    """What Prometheus does to the worker: a scrape of /metrics every ``seconds``, all the run."""

    def scrape() -> None:
        while not side.stop.wait(seconds):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{side.port}/metrics", timeout=5) as r:
                    r.read()
            except OSError:
                pass

    threading.Thread(target=scrape, daemon=True).start()


def drain(side: Side, kind: str, n: int, record: bool) -> None:
    """``n`` no-op tasks sent to the side's database (traced as its mode is), drained by its worker."""
    _, task_name, _ = observability.KINDS[kind]
    otel_sdk.set_ratio(side.ratio)  # the producer's sampler: a run follows its send's decision
    app = observability.producer(side.db.url, kind, side.traced)
    try:
        mark = drain_mark(side.db)
        cpu0, sessions0 = worker_cpu(side.worker.pid), sessions_cpu(side.db)
        observability.send_in_traces(side.db, app.tasks[task_name], n)
        wait_all_terminal(side.db, side.worker, timeout=600, interval=0.02)
        main1, children1 = worker_cpu(side.worker.pid)
        sessions1 = sessions_cpu(side.db)  # a session opened meanwhile counts whole
        used = {pid: (name, cpu - sessions0.get(pid, ("", 0.0))[1]) for pid, (name, cpu) in sessions1.items()}
        server = sum(cpu for name, cpu in used.values() if name != "tether-metrics")
        scrapes = sum(cpu for name, cpu in used.values() if name == "tether-metrics")
        main, cpu = main1 - cpu0[0], main1 + children1 - sum(cpu0)
    finally:
        app.close()
    span = drain_span(side.db, mark, n, side.mode)
    if record:
        side.cpu_us.append(1e6 * cpu / n)
        side.main_us.append(1e6 * main / n)
        side.server_us.append(1e6 * server / n)
        side.scrape_us.append(1e6 * scrapes / n)
        side.rates.append(n / span)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.observability_pairs")
    p.add_argument("--database-url", default=os.environ.get("TETHER_BENCH_DATABASE_URL", DEFAULT_SERVER_URL))
    p.add_argument("--kind", choices=sorted(observability.KINDS), default="async")
    p.add_argument("--mode", default="sampled", help="set against off (bench/observability.py's modes)")
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--tasks", type=int, default=3_000, help="no-op tasks per drain")
    p.add_argument("--warm-up", type=int, default=3, help="pairs drained first and not counted")
    p.add_argument("--metrics-port", type=int, default=19160)
    p.add_argument(
        "--scrape-every",
        type=float,
        default=15.0,
        help="seconds between scrapes of a metered worker (15: a common Prometheus scrape_interval)",
    )
    a = p.parse_args(argv)
    if a.pairs < 6:
        p.error("--pairs: at least 6 (a 90 % sign-test interval needs them)")
    if a.scrape_every <= 0:
        p.error("--scrape-every: seconds, more than 0")
    print(f"load before: {os.getloadavg()}", flush=True)
    otel_sdk.install(1.0)  # the producer's SDK: traced sends store a (sampled or not) context
    sides: list[Side] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, mode in enumerate(("off", a.mode)):
                sides.append(start_side(a.database_url, a.kind, mode, a.metrics_port + i, Path(tmp)))
            for side in sides:
                if side.metered and side.mode != "metrics_unscraped":
                    scrape_every(side, a.scrape_every)
            for i in range(a.warm_up + a.pairs):
                record = i >= a.warm_up
                for side in sides if i % 2 == 0 else sides[::-1]:
                    drain(side, a.kind, a.tasks, record)
                if record:
                    off, on = sides
                    print(
                        f"pair {i - a.warm_up + 1:3}: off {off.cpu_us[-1]:6.1f} us/task (main "
                        f"{off.main_us[-1]:5.1f}, server {off.server_us[-1]:5.1f}), {a.mode} "
                        f"{on.cpu_us[-1]:6.1f} (main {on.main_us[-1]:5.1f}, server {on.server_us[-1]:5.1f}, "
                        f"scrapes {on.scrape_us[-1]:4.2f}); "
                        f"{off.rates[-1]:7,.0f} vs {on.rates[-1]:7,.0f} tasks/s "
                        f"(load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
            off, on = sides
            # The worker's cost a task: its processes' CPU and its scrapes' reads on the server.
            worker_off = [w + m for w, m in zip(off.cpu_us, off.scrape_us, strict=True)]
            worker_on = [w + m for w, m in zip(on.cpu_us, on.scrape_us, strict=True)]
            pairs = list(
                zip(worker_off, off.server_us, off.rates, worker_on, on.server_us, on.rates, strict=True)
            )
            figures = {
                "worker CPU a task (and its scrapes')": [w1 / w0 for w0, _, _, w1, _, _ in pairs],
                "its server sessions' CPU a task": [s1 / s0 for _, s0, _, _, s1, _ in pairs],
                # The machine's speed moves both the worker's and the server's CPU time a task
                # alike (2 vCPUs, both busy): the worker's over its sessions' cancels it.
                "worker CPU over its sessions'": [(w1 / s1) / (w0 / s0) for w0, s0, _, w1, s1, _ in pairs],
                # The whole cost a task, worker and server, the server's work taken as the same
                # in both: (w1/s + 1) / (w0/s + 1).
                "worker and server, by that": [
                    (w1 / s1 + 1) / (w0 / s0 + 1) for w0, s0, _, w1, s1, _ in pairs
                ],
                "throughput": [r1 / r0 for _, _, r0, _, _, r1 in pairs],
            }
            scrapes = (
                f", a scrape every {a.scrape_every:g} s"
                if on.metered and on.mode != "metrics_unscraped"
                else ""
            )
            print(
                f"{a.kind}, {a.mode} / off, {a.pairs} pairs of {a.tasks:,} tasks{scrapes}, "
                "median (90 % interval):"
            )
            for name, ratios in figures.items():
                low, high = sign_test_interval(ratios)
                print(f"  {name:38} {statistics.median(ratios):.3f} ({low:.3f}-{high:.3f})")
            med = statistics.median
            print(
                f"  medians: worker {med(on.cpu_us):.1f} vs {med(off.cpu_us):.1f} us (main process "
                f"{med(on.main_us):.1f} vs {med(off.main_us):.1f}), server {med(on.server_us):.1f} vs "
                f"{med(off.server_us):.1f} us, scrapes' reads {med(on.scrape_us):.2f} us"
            )
            for side in sides:
                side.stop.set()
                side.worker.stop()
    finally:
        for side in sides:
            side.stop.set()
            if not side.worker.stopped:
                side.worker.kill()
            side.db.drop()
        print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
