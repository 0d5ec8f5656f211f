"""What the dashboard's charts cost on a big table: ``python -m bench.charts_read``.

Fills a throwaway database with TERMINAL finished tasks (default 10,000,000) that ended
evenly over the last HOURS hours up to now (so the last hour holds TERMINAL/HOURS of them:
500,000 at the defaults, about 140 a second), each with a few hundred bytes of arguments and
result (heap pages as wide as real rows'), then times, through tether.web.charts.Charts on a
real PostgresBroker:

- the first answer of the last hour (nothing settled yet: the hour's rows read through the
  terminal index) and of the last 24 hours (every row of the day);
- later answers (the dashboard keeps settled minutes: a refresh reads the last SETTLE_S);
- the statement's EXPLAIN (ANALYZE, BUFFERS) for both.

Tasks only (no attempts, heartbeats or workflows): the charts read none of them. The
database is dropped at the end unless --keep.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.infra import DEFAULT_SERVER_URL, BenchDatabase
from bench.millions import migrate
from tether import AppConfig, PostgresConfig, Tether
from tether.broker.queries import q
from tether.web import charts

BATCH = 500_000


def fill(db: BenchDatabase, terminal: int, hours: float) -> float:
    t0 = time.perf_counter()
    span_s = hours * 3600
    with db.connect() as conn:
        for start in range(0, terminal, BATCH):
            n = min(BATCH, terminal - start)
            conn.execute(
                """
                INSERT INTO tether_tasks (id, name, queue, status, args, kwargs, result, error_code,
                                          attempt, sent_at, run_at, enqueued_at, claimed_at,
                                          started_at, completed_at, failed_at, updated_at)
                SELECT gen_random_uuid(),
                       (ARRAY['send_email', 'resize_image', 'deliver_webhook', 'noop'])[1 + i %% 4],
                       (ARRAY['default', 'emails', 'images', 'webhooks', 'reports'])[1 + i %% 5],
                       CASE WHEN i %% 50 = 0 THEN 'FAILED' ELSE 'COMPLETED' END,
                       jsonb_build_array(i, repeat('a', 120)), jsonb_build_object('k', repeat('b', 80)),
                       jsonb_build_object('ok', repeat('c', 100)),
                       CASE WHEN i %% 50 = 0 THEN 'HTTP_500' END, 1,
                       e - interval '2 seconds', e - interval '2 seconds', e - interval '2 seconds',
                       e - interval '1 second', e - interval '1 second',
                       CASE WHEN i %% 50 = 0 THEN NULL ELSE e END, CASE WHEN i %% 50 = 0 THEN e END, e
                FROM (SELECT i, now() - make_interval(secs => %(span)s * (1 - i::float8 / %(total)s)) AS e
                      FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i) AS s
                """,
                {"span": span_s, "total": terminal, "lo": start, "hi": start + n - 1},
            )
            print(f"  filled {start + n:,} of {terminal:,} ({time.perf_counter() - t0:.0f} s)", flush=True)
        conn.execute("VACUUM (ANALYZE) tether_tasks")
    return time.perf_counter() - t0


def explain(db: BenchDatabase, since: datetime, bucket_s: int) -> dict[str, Any]:
    with db.connect() as conn:
        row = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + q("finished_per_bucket"),
            {"since": since, "bucket_s": bucket_s},
        ).fetchone()
    assert row is not None
    plan: dict[str, Any] = row[0][0]
    return plan


def scans(plan: dict[str, Any]) -> list[str]:
    found = []
    node = plan["Plan"]
    stack = [node]
    while stack:
        n = stack.pop()
        if "Relation Name" in n or "Index Name" in n:
            found.append(
                f"{n['Node Type']} {n.get('Index Name', n.get('Relation Name'))}: {n['Actual Rows']:,} rows"
            )
        stack.extend(n.get("Plans", []))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--terminal", type=int, default=10_000_000)
    parser.add_argument("--hours", type=float, default=20.0)
    parser.add_argument("--server-url", default=DEFAULT_SERVER_URL)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    db = BenchDatabase(args.server_url)
    db.create()
    try:
        migrate(db.url)
        print(f"database {db.name}: filling {args.terminal:,} terminal tasks over {args.hours} h", flush=True)
        print(f"fill: {fill(db, args.terminal, args.hours):.0f} s")
        size = db.query("SELECT pg_size_pretty(pg_total_relation_size('tether_tasks'))")[0][0]
        hour = db.query("SELECT count(*) FROM tether_tasks WHERE updated_at >= now() - interval '1 hour'")[0][
            0
        ]
        print(f"tether_tasks: {size}, {hour:,} tasks ended in the last hour")
        app = Tether(AppConfig(broker=PostgresConfig(database_url=db.url)))
        try:
            seen = charts.Charts(app.broker, sample_s=3600)
            for name in ("1h", "24h"):
                t0 = time.perf_counter()
                first = seen.answer(name)
                cold = time.perf_counter() - t0
                later = []
                for _ in range(10):
                    seen._answers.clear()  # as if ANSWER_MAX_AGE_S had passed
                    t0 = time.perf_counter()
                    seen.answer(name)
                    later.append(time.perf_counter() - t0)
                total = sum(first["finished"]["total"].values())
                print(
                    f"range {name}: first answer {cold * 1000:.0f} ms ({total:,} tasks counted), "
                    f"later answers median {statistics.median(later) * 1000:.1f} ms, "
                    f"max {max(later) * 1000:.1f} ms"
                )
            now = datetime.now(UTC)
            for label, since, bucket in (
                ("1h", now - timedelta(hours=1), 60),
                ("last 2 min", now - timedelta(seconds=charts.SETTLE_S), 60),
            ):
                plan = explain(db, since, bucket)
                print(f"EXPLAIN {label}: {plan['Execution Time']:.1f} ms; " + "; ".join(scans(plan)))
            seen.stop()
        finally:
            app.close()
    finally:
        if args.keep:
            print(f"kept {db.name}")
        else:
            db.drop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
