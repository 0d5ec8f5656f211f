"""What the dashboard's charts cost on a big table: ``python -m bench.charts_read``.

Fills a throwaway database with TERMINAL finished tasks (default 10,000,000) that ended
evenly over the last HOURS hours up to now (so the last hour holds TERMINAL/HOURS of them:
500,000 at the defaults, about 140 a second), each with a few hundred bytes of arguments and
result (heap pages as wide as real rows'), then times, through tether.web.charts.Charts on a
real PostgresBroker:

- the answers of the last hour and of the last 24 hours as a fresh dashboard gives them
  (each reads back at most ANSWER_BUDGET_S of minutes): how long each takes and how many
  until every minute is read; then the answers once it is (the live minutes only);
- how long the sampler's read-backs (BACKGROUND_BUDGET_S each) take to read a whole day;
- the statement's EXPLAIN (ANALYZE, BUFFERS) for one minute and for the live minutes.

Tasks only (no attempts, heartbeats or workflows): the charts read none of them. The
database is dropped at the end unless --keep, a reused one too (--reuse NAME measures a kept
one again; its rows end where they ended, so the last hour thins out as time passes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.infra import DEFAULT_SERVER_URL, BenchDatabase
from bench.millions import NamedDatabase, migrate
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


def explain(db: BenchDatabase, since: datetime, until: datetime, bucket_s: int) -> dict[str, Any]:
    with db.connect() as conn:
        row = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + q("finished_per_bucket"),
            {"since": since, "until": until, "bucket_s": bucket_s},
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
    parser.add_argument("--reuse", help="a tether_bench_* database an earlier --keep left (no fill)")
    args = parser.parse_args(argv)
    if args.reuse:
        db = NamedDatabase(args.server_url, args.reuse)
        db.created = True
    else:
        db = BenchDatabase(args.server_url)
        db.create()
    try:
        if not args.reuse:
            migrate(db.url)
            print(
                f"database {db.name}: filling {args.terminal:,} terminal tasks over {args.hours} h",
                flush=True,
            )
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
                # Answers as a page open on a fresh dashboard asks for them (each bounded), with
                # no sampler thread: how long each takes, and how many until the range is read.
                times = []
                while True:
                    seen._answers.clear()  # as if ANSWER_MAX_AGE_S had passed
                    t0 = time.perf_counter()
                    shown = seen.answer(name)
                    times.append(time.perf_counter() - t0)
                    if shown["complete_from"] == shown["from"] or len(times) >= 400:
                        break
                later = []
                for _ in range(10):
                    seen._answers.clear()
                    t0 = time.perf_counter()
                    seen.answer(name)
                    later.append(time.perf_counter() - t0)
                total = sum(n for n in shown["finished"]["total"].values())
                print(
                    f"range {name}: {len(times)} answers until every minute was read "
                    f"(first {times[0] * 1000:.0f} ms, median {statistics.median(times) * 1000:.0f} ms, "
                    f"max {max(times) * 1000:.0f} ms; {total:,} tasks counted); then answers median "
                    f"{statistics.median(later) * 1000:.1f} ms, max {max(later) * 1000:.1f} ms",
                    flush=True,
                )
            seen = charts.Charts(app.broker, sample_s=3600)
            t0 = time.perf_counter()
            ticks = 0
            while len(seen._minutes) < 24 * 60 - 3 and ticks < 2000:
                seen.read_back(charts.BACKGROUND_BUDGET_S)
                ticks += 1
            print(
                f"sampler: {ticks} read-backs of {charts.BACKGROUND_BUDGET_S} s read the day's "
                f"{len(seen._minutes)} minutes in {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
            now = datetime.now(UTC)
            for label, since, bucket in (
                ("1 minute", now - timedelta(minutes=30), 60),
                ("the live minutes", now - timedelta(seconds=charts.SETTLE_S + 60), 60),
            ):
                until = since + timedelta(minutes=1) if label == "1 minute" else now
                plan = explain(db, since, until, bucket)
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
