"""What ``tether health`` costs with a big backlog: ``python -m bench.health [--pending N] [--terminal N]``.

Makes two databases on the server (``--database-url``, default ``TETHER_BENCH_DATABASE_URL``
or the local one): **small**, 10,000 PENDING tasks and no history, and **big**, ``--pending``
PENDING tasks (1,000,000 by default) and ``--terminal`` COMPLETED ones (1,000,000), both
spread over 4 queues and 5 priorities, their run_at over the last hour. Both are vacuumed
and analyzed. Then it times ``tether.health.gather`` (every statement of ``tether health``,
on one open connection) ``--rounds`` times in each, alternating small and big (ABAB...) so
that the machine's load hits both alike, and prints every pair, the medians, and each
statement's median in the big one, with the machine's load average before and after.

Both databases are dropped at the end, also after an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/health.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.infra import DEFAULT_SERVER_URL, BenchDatabase, connect_dict
from tether.broker import health as facts
from tether.db.migrate import migrate
from tether.health import HealthThresholds, gather

QUEUES = 4
PRIORITIES = 5
CHUNK = 250_000

FILL = """
INSERT INTO tether_tasks (id, name, queue, priority, status, run_at, sent_at, updated_at)
SELECT gen_random_uuid(), 'noop', 'queue-' || (i %% {queues}), (i %% {priorities}) * 10, %(status)s,
       now() - (i %% 3600) * interval '1 second', now() - interval '1 hour', now() - interval '1 hour'
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i
"""


def fill(db: BenchDatabase, status: str, count: int) -> None:
    statement = FILL.format(queues=QUEUES, priorities=PRIORITIES)
    with db.connect() as conn:
        for first in range(0, count, CHUNK):
            last = min(count, first + CHUNK) - 1
            conn.execute(statement, {"status": status, "first": first, "last": last})  # type: ignore[arg-type]


def prepare(db: BenchDatabase, pending: int, terminal: int) -> None:
    db.create()
    with db.connect() as conn:
        migrate(conn)
    started = time.monotonic()
    fill(db, "PENDING", pending)
    fill(db, "COMPLETED", terminal)
    with db.connect() as conn:
        conn.execute("VACUUM ANALYZE tether_tasks")
    print(
        f"{db.name}: {pending:,} PENDING + {terminal:,} COMPLETED loaded in {time.monotonic() - started:.0f}s"
    )


def time_gather(url: str) -> float:
    with connect_dict(url) as conn:
        gather(conn, HealthThresholds())  # warm: plans, catalog caches
        t0 = time.perf_counter()
        gather(conn, HealthThresholds())
        return (time.perf_counter() - t0) * 1000


def time_statements(url: str, rounds: int) -> dict[str, float]:
    readers = {
        "horizon_holders": facts.horizon_holders,
        "tether_tables": facts.tether_tables,
        "worker_liveness": facts.worker_liveness,
        "queue_lag": facts.queue_lag,
    }
    medians = {}
    with connect_dict(url) as conn:
        for name, read in readers.items():
            read(conn)
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                read(conn)
                times.append((time.perf_counter() - t0) * 1000)
            medians[name] = statistics.median(times)
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.health", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url", default=os.environ.get("TETHER_BENCH_DATABASE_URL", DEFAULT_SERVER_URL)
    )
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--terminal", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    small, big = BenchDatabase(args.database_url), BenchDatabase(args.database_url)
    try:
        prepare(small, 10_000, 0)
        prepare(big, args.pending, args.terminal)
        print(f"load before: {os.getloadavg()}")
        pairs = [(time_gather(small.url), time_gather(big.url)) for _ in range(args.rounds)]
        print(f"load after: {os.getloadavg()}")
        for i, (a, b) in enumerate(pairs, 1):
            print(f"pair {i:2d}: small {a:7.1f} ms   big {b:7.1f} ms")
        print(
            f"median: small {statistics.median(a for a, _ in pairs):.1f} ms, "
            f"big {statistics.median(b for _, b in pairs):.1f} ms "
            f"(p95 big {sorted(b for _, b in pairs)[int(0.95 * (len(pairs) - 1))]:.1f} ms)"
        )
        for name, ms in time_statements(big.url, args.rounds).items():
            print(f"  big, {name}: median {ms:.1f} ms")
        lags = []
        with connect_dict(big.url) as conn:
            lags = facts.queue_lag(conn)
        print(
            f"  big, queues found: {len(lags)}, oldest due: {max(q.oldest_due_age_s or 0 for q in lags):.0f}s"
        )
    finally:
        small.drop()
        big.drop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
