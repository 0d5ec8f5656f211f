"""``limits_pairs``: what the limited claim costs a drain, with the VM's speed cancelled.

    .venv/bin/python -m bench.limits_pairs [--executor sync] [--rounds 20] [--tasks 2000]

bench/limits.py's ``limits_throughput`` starts a worker for every drain and compares the
drains' CPU a task (worker and server) across kinds; on this 2-vCPU VM the same work takes
±15 % more or less CPU time from one drain to the next (bench/README.md, "Metrics and
tracing"), as much as the few percent between a share of 77 % and one of 80 %. Here three
workers live through the run, each on a database of its own on the same server, one per
kind of bench/limits.py (``unlimited``, ``queue_limit``: max_in_flight 100,000, a limit that
never binds; ``per_key``: per_key 100 over 100 keys, each task carrying one), and are fed in
turns ``--tasks`` no-op tasks each (sent in one transaction, all due at once), the order
rotating every round.

The speed is cancelled by the worker's **children**: they run the tasks and write their
outcomes whichever claim handed them out, so their work a task is the same in every kind,
while the claim is the main process's and the server's. A drain's cost is (main process +
server sessions) over children, and a kind's whole cost a task against the unlimited one's
is ``(1 + x_kind) / (1 + x_unlimited)``, x that quotient: the CPU share of issue 23 is its
inverse (target >= 80 %). The raw shares (CPU a task, throughput) are printed beside it,
each the median of the rounds' ratios with a 90 % sign-test interval (bench/paired.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import WorkerProcess

from bench import async_apps
from bench.apps import make_app
from bench.infra import (
    DEFAULT_SERVER_URL,
    BenchDatabase,
    bench_worker,
    drain_mark,
    drain_span,
    settled,
    wait_all_terminal,
)
from bench.limits import KEYS, KINDS, SHARE_TARGET, set_limits
from bench.paired import sign_test_interval
from bench.precise_cpu import sessions_cpu, worker_cpu
from tether.db.migrate import migrate


@dataclass
class Side:
    """One kind's database and worker, alive through the run, and its drains' figures."""

    kind: str
    db: BenchDatabase
    worker: WorkerProcess
    claim_us: list[float] = field(default_factory=list)  # main process + server sessions, a task
    children_us: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)  # tasks/s, database time


def start_side(server_url: str, kind: str, executor: str, logs: Path) -> Side:
    db = BenchDatabase(server_url)
    db.create()
    with db.connect() as conn:
        migrate(conn)
    set_limits(db, kind)
    if executor == "async":
        worker = bench_worker(
            db,
            logs / f"{kind}.log",
            processes=0,
            extra_args=("--async-processes", "1", "--async-concurrency", "100"),
            exclusive=False,
            app_path="bench.async_apps:app",
        )
    else:
        worker = bench_worker(db, logs / f"{kind}.log", processes=2, exclusive=False)
    worker.start()
    worker.wait_registered()
    settled(worker.pid, 1 if executor == "async" else 2)
    return Side(kind, db, worker)


def drain(side: Side, executor: str, n: int, record: bool) -> None:
    """``n`` no-op tasks (with keys for per_key) sent in one transaction, drained."""
    app = async_apps.make_app(side.db.url) if executor == "async" else make_app(side.db.url)
    task = app.tasks["anoop" if executor == "async" else "noop"]
    try:
        mark = drain_mark(side.db)
        sends = [(f"key-{k:03d}", n // KEYS) for k in range(KEYS)] if side.kind == "per_key" else [(None, n)]
        (main0, children0), sessions0 = worker_cpu(side.worker.pid), sessions_cpu(side.db)
        with side.db.connect() as conn, conn.transaction():  # one commit: all due at once
            for key, count in sends:
                keyed = {} if key is None else {"concurrency_key": key}
                task.with_options(connection=conn, **keyed).send_many([()] * count)
        wait_all_terminal(side.db, side.worker, timeout=600, interval=0.02)
        main1, children1 = worker_cpu(side.worker.pid)
        sessions1 = sessions_cpu(side.db)  # a session opened meanwhile counts whole
        server = sum(cpu - sessions0.get(pid, ("", 0.0))[1] for pid, (_, cpu) in sessions1.items())
    finally:
        app.close()
    span = drain_span(side.db, mark, n, side.kind)
    if record:
        side.claim_us.append(1e6 * (main1 - main0 + server) / n)
        side.children_us.append(1e6 * (children1 - children0) / n)
        side.rates.append(n / span)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.limits_pairs")
    p.add_argument("--database-url", default=os.environ.get("TETHER_BENCH_DATABASE_URL", DEFAULT_SERVER_URL))
    p.add_argument("--executor", choices=["sync", "async"], default="sync")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--tasks", type=int, default=2_000, help="no-op tasks per drain (a multiple of 100)")
    p.add_argument("--warm-up", type=int, default=2, help="rounds drained first and not counted")
    a = p.parse_args(argv)
    if a.rounds < 6:
        p.error("--rounds: at least 6 (a 90 % sign-test interval needs them)")
    if a.tasks <= 0 or a.tasks % KEYS:
        p.error(f"--tasks: a positive multiple of {KEYS} (per_key sends the same number to each key)")
    print(f"load before: {os.getloadavg()}", flush=True)
    sides: list[Side] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for kind in KINDS:
                sides.append(start_side(a.database_url, kind, a.executor, Path(tmp)))
            for r in range(a.warm_up + a.rounds):
                order = sides[r % len(sides) :] + sides[: r % len(sides)]  # drift hits each kind alike
                for side in order:
                    drain(side, a.executor, a.tasks, r >= a.warm_up)
                if r >= a.warm_up:
                    print(
                        f"round {r - a.warm_up + 1:3}: "
                        + "; ".join(
                            f"{s.kind} {s.claim_us[-1]:6.1f} + {s.children_us[-1]:6.1f} us, "
                            f"{s.rates[-1]:6,.0f}/s"
                            for s in sides
                        )
                        + f" (load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
            base = sides[0]
            print(
                f"{a.executor}, {a.rounds} rounds of {a.tasks:,} tasks a kind, share of unlimited, "
                "median (90 % interval):"
            )
            for side in sides[1:]:
                figures = {
                    # What issue 23 asks: the unlimited whole cost a task over this kind's.
                    "CPU share, machine speed cancelled": [
                        (1 + c0 / k0) / (1 + c1 / k1)
                        for c0, k0, c1, k1 in zip(
                            base.claim_us, base.children_us, side.claim_us, side.children_us, strict=True
                        )
                    ],
                    "CPU share, raw": [
                        (c0 + k0) / (c1 + k1)
                        for c0, k0, c1, k1 in zip(
                            base.claim_us, base.children_us, side.claim_us, side.children_us, strict=True
                        )
                    ],
                    "children's CPU a task (should be 1)": [
                        k0 / k1 for k0, k1 in zip(base.children_us, side.children_us, strict=True)
                    ],
                    "throughput share": [r1 / r0 for r0, r1 in zip(base.rates, side.rates, strict=True)],
                }
                for name, ratios in figures.items():
                    low, high = sign_test_interval(ratios)
                    target = (
                        f"  (target >= {100 * SHARE_TARGET:.0f} %)" if name.startswith("CPU share, m") else ""
                    )
                    print(
                        f"  {side.kind:11} {name:36} {100 * statistics.median(ratios):5.1f} % "
                        f"({100 * low:.1f}-{100 * high:.1f}){target}"
                    )
            for side in sides:
                side.worker.stop()
    finally:
        for side in sides:
            if not side.worker.stopped:
                side.worker.kill()
            side.db.drop()
        print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
