"""``claim_cost``: what one claim statement costs, by the shape and size of the backlog.

The claim (``claim_tasks``, broker/sql/claims.sql) runs on every pickup, so its statement
time bounds a worker's drain rate. This measures it alone, in this process, on an open
connection, against a backlog filled by SQL in a database of its own:

- ``--pending N`` PENDING no-op tasks in queue ``default`` (default 300,000) at priority 0,
  of which ``--delayed-share`` (10 %) due up to a day later;
- ``--later-high N`` (3,000) more at priority 10, all due up to a day later: what is left
  of bench.millions' backlog at priority 10 once its due tasks are drained (delayed sends,
  retries waiting out their backoff), which every claim of the priorities below meets;
- then ``VACUUM (ANALYZE)``, what autovacuum leaves on a settled table.

Each timed claim takes ``--batch`` tasks (10, the async executor's batch) in a transaction
that is rolled back, so the backlog stays the same for every claim; the figure is the
median statement time over ``--claims`` claims after 20 untimed ones (psycopg prepares the
statement on its 6th run; the plan then kept is the one every worker uses).

Comparing two checkouts: fill once with ``--keep``, then run each checkout's Python on the
same database in turn with ``--reuse NAME`` (interleaved, several times each):

    .venv/bin/python -m bench.claim_cost --keep
    for i in 1 2 3; do A/.venv/bin/python -m bench.claim_cost --reuse tether_bench_X; \\
        B/.venv/bin/python -m bench.claim_cost --reuse tether_bench_X; done
    .venv/bin/python -m bench.claim_cost --drop tether_bench_X
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import psycopg
from psycopg import sql

from bench.infra import DEFAULT_SERVER_URL, BenchDatabase, with_database
from tether.broker.claims import claim_tasks
from tether.db.migrate import migrate

FILL = """
INSERT INTO tether_tasks (id, name, queue, priority, args, kwargs, status, run_at, enqueued_at,
                          sent_at, updated_at)
SELECT gen_random_uuid(), 'noop', 'default', 0, '[]'::jsonb, '{}'::jsonb, 'PENDING',
       CASE WHEN random() < %(delayed)s THEN now() + random() * interval '1 day'
            ELSE now() - interval '6 hours' + i * interval '1 millisecond' END,
       now(), now(), now()
FROM generate_series(1, %(n)s) AS i
UNION ALL
SELECT gen_random_uuid(), 'noop', 'default', 10, '[]'::jsonb, '{}'::jsonb, 'PENDING',
       now() + random() * interval '1 day', now(), now(), now()
FROM generate_series(1, %(later_high)s) AS i
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.claim_cost", description=__doc__.split("\n")[0])
    p.add_argument("--database-url", default=DEFAULT_SERVER_URL, help="the server (default: local)")
    p.add_argument("--pending", type=int, default=300_000)
    p.add_argument("--later-high", type=int, default=3_000)
    p.add_argument("--delayed-share", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--claims", type=int, default=300)
    p.add_argument("--keep", action="store_true", help="keep the filled database (its name is printed)")
    p.add_argument("--reuse", metavar="NAME", help="measure a database filled before (tether_bench_*)")
    p.add_argument("--drop", metavar="NAME", help="drop a database kept before, and stop")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def _named(server_url: str, name: str) -> BenchDatabase:
    if not name.startswith("tether_bench_"):
        raise SystemExit(f"--reuse/--drop: {name!r} is not a tether_bench_* database")
    db = BenchDatabase(server_url)
    db.name, db.url, db.created = name, with_database(server_url, name), True
    return db


def fill(db: BenchDatabase, args: argparse.Namespace) -> None:
    with psycopg.connect(db.url, autocommit=True) as conn:
        migrate(conn)
        conn.execute(FILL, {"n": args.pending, "later_high": args.later_high, "delayed": args.delayed_share})
        conn.execute(sql.SQL("VACUUM (ANALYZE) tether_tasks"))


async def measure(url: str, claims: int, batch: int) -> list[float]:
    conn = await psycopg.AsyncConnection.connect(url, row_factory=psycopg.rows.dict_row)
    try:
        seconds: list[float] = []
        for i in range(20 + claims):
            async with conn.transaction(force_rollback=True):
                t0 = time.perf_counter()
                got = await claim_tasks(
                    conn, worker_id=f"bench-{uuid.uuid4()}", queues=["default"], limit=batch, skip_names=[]
                )
                took = time.perf_counter() - t0
            if len(got.tasks) != batch:
                raise SystemExit(
                    f"claim {i} took {len(got.tasks)} tasks, not {batch}: the backlog is too small"
                )
            if i >= 20:
                seconds.append(took)
        return seconds
    finally:
        await conn.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.drop:
        _named(args.database_url, args.drop).drop()
        return 0
    db = _named(args.database_url, args.reuse) if args.reuse else BenchDatabase(args.database_url)
    try:
        if not args.reuse:
            db.create()
            fill(db, args)
        seconds = asyncio.run(measure(db.url, args.claims, args.batch))
    finally:
        if not (args.keep or args.reuse):
            db.drop()
    med = statistics.median(seconds)
    p90 = statistics.quantiles(seconds, n=10)[-1]
    print(
        f"claim_cost: {db.name}: median {med * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us per claim of {args.batch}"
    )
    if args.keep:
        print(f"kept: {db.name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"database": db.name, "seconds": seconds}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
