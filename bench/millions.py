"""``python -m bench.millions``: tether with 1,000,000 PENDING and 10,000,000 terminal tasks.

Fills a database with SQL (bench/millions_fill.py), then measures against it, each beside
the same thing on a small reference database (migrated, nothing in it but what a part puts
there), interleaved big / small so load drifts hit both alike:

- throughput: a real worker (``--processes 2 --queues default``) drains no-op tasks. Big:
  the first DRAIN of ``default``'s share of the million PENDING (their backlog stays: the
  drained ones are sent again afterwards, at the back). Small: a backlog of DRAIN tasks,
  drained to the end. Figure: tasks / (max(completed_at) - min(started_at)), database time;
  target: big >= 90 % of small.
- send: sequential ``noop.send()``, blocks alternating between the two databases.
- commands: ``tether status``, ``tether tasks`` (default and common filters), ``queues``,
  ``workers``, ``workflows``, ``task ID`` as processes, and the broker calls behind them in
  this process (server-side time); the dashboard's pages over HTTP from a real
  ``tether dashboard``; target < 200 ms each.
- reaper: ``Reaper.run_once()`` in this process (tether's defaults; the fake fleet's 300
  in-flight tasks fresh, so nothing is stale), every statement of a tick timed alone too;
  target < 100 ms.

``--reuse NAME`` measures a database filled by an earlier ``--keep`` run (the fill takes
about 10-15 minutes at full size); without it the run fills a new one and drops it at the
end (unless ``--keep``). The reference database is always new and always dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import WorkerProcess

from bench import millions_fill, millions_reads
from bench.apps import make_app
from bench.infra import DEFAULT_SERVER_URL, BenchDatabase, bench_worker, connect_dict, wait_for, with_database
from bench.millions_reads import Samples, Timing
from tether.broker.queries import q
from tether.broker.retention import FROM_THE_START
from tether.config import AppConfig, PostgresConfig
from tether.worker.reaper import Reaper

FULL = {"pending": 1_000_000, "terminal": 10_000_000}
QUICK = {"pending": 20_000, "terminal": 200_000}
DRAIN = {"full": 10_000, "quick": 2_000}  # tasks per drain (quick: a third of default's backlog)
SEND_BLOCK = 1_000
COMMAND_TARGET_MS = 200.0
REAPER_TARGET_MS = 100.0
THROUGHPUT_SHARE = 0.90
MARKER = "bench_millions_fill"  # a table in the filled database: what it holds, when it was made


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.millions", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("TETHER_BENCH_DATABASE_URL") or DEFAULT_SERVER_URL,
        help="the server (its databases tether_bench_* are made there)",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"fill {QUICK['pending']:,} + {QUICK['terminal']:,}"
    )
    parser.add_argument(
        "--pending", type=int, default=None, help=f"PENDING tasks (default {FULL['pending']:,})"
    )
    parser.add_argument(
        "--terminal", type=int, default=None, help=f"terminal tasks (default {FULL['terminal']:,})"
    )
    parser.add_argument(
        "--reuse", metavar="NAME", help="measure this database, filled by an earlier --keep run"
    )
    parser.add_argument("--keep", action="store_true", help="do not drop the filled database at the end")
    parser.add_argument("--drop", metavar="NAME", help="only drop this filled database, and exit")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved big/small rounds (throughput, send)"
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each read")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PART",
        help="throughput, send, commands, server, dashboard, reaper (repeat or comma-separate)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every figure here")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    args.pending = args.pending if args.pending is not None else size["pending"]
    args.terminal = args.terminal if args.terminal is not None else size["terminal"]
    parts = [p.strip() for item in args.only for p in item.split(",") if p.strip()]
    known = ["throughput", "send", "commands", "server", "dashboard", "reaper"]
    unknown = [p for p in parts if p not in known]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    args.parts = parts or known
    return args


# -- the databases ------------------------------------------------------------------------------


class NamedDatabase(BenchDatabase):
    """A bench database with a given name (an earlier run's, to reuse)."""

    def __init__(self, server_url: str, name: str) -> None:
        super().__init__(server_url)
        if not name.startswith("tether_bench_"):
            raise SystemExit(f"{name!r}: only databases named tether_bench_* are this bench's")
        self.name, self.url = name, with_database(server_url, name)


def migrate(url: str) -> None:
    app = make_app(url)
    try:
        _ = app.broker.url  # applies the migrations
    finally:
        app.close()


def filled(db: BenchDatabase, pending: int, terminal: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Fill ``db`` (new and migrated) and record what it holds."""
    with psycopg.connect(db.url, autocommit=True) as conn:
        t0 = time.perf_counter()
        parts = millions_fill.fill(conn, pending=pending, terminal=terminal, say=say)
        parts["vacuum_analyze"] = millions_fill.vacuum_analyze(conn, say)
        conn.execute(
            f"CREATE TABLE {MARKER} AS"
            " SELECT %s::bigint AS pending, %s::bigint AS terminal, now() AS filled_at",
            (pending, terminal),
        )
        say(f"filled in {time.perf_counter() - t0:.0f}s")
    return fill_info(db) | {"fill_seconds": parts}


def fill_info(db: BenchDatabase) -> dict[str, Any]:
    with connect_dict(db.url) as conn:
        row = conn.execute(f"SELECT pending, terminal, filled_at FROM {MARKER}").fetchone()
        sizes = conn.execute(
            "SELECT relname, pg_total_relation_size(oid) AS bytes FROM pg_class"
            " WHERE relname = ANY(%s) ORDER BY relname",
            (list(millions_fill.TABLES),),
        ).fetchall()
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM tether_task_attempts) AS attempts,"
            " (SELECT count(*) FROM tether_heartbeats) AS heartbeats"
        ).fetchone()
    assert row is not None and counts is not None
    return {
        **row,
        **counts,
        "database_bytes": {r["relname"]: r["bytes"] for r in sizes},
    }


# -- throughput -----------------------------------------------------------------------------------


def drain(
    db: BenchDatabase, log: Path, n: int, *, whole: bool, vacuum: bool = True, index_cleanup: bool = True
) -> dict[str, float]:
    """A worker drains ``n`` no-op tasks of queue default (``whole``: everything there is).

    First, both databases alike: VACUUM (ANALYZE), with INDEX_CLEANUP ON unless
    ``index_cleanup`` is false (then VACUUM skips the indexes while dead rows sit on fewer
    than 2 % of the table's pages, and the claim index keeps the entries of every task
    drained before: bench/README.md, millions). Progress is polled by the newest attempt
    row (one probe of its primary key: the worker writes one per task it completes), so the
    poll costs the same on both databases.
    """
    with psycopg.connect(db.url, autocommit=True) as conn:
        if vacuum:
            conn.execute(
                "VACUUM (ANALYZE, INDEX_CLEANUP ON) tether_tasks"
                if index_cleanup
                else "VACUUM (ANALYZE) tether_tasks"
            )
        (since,) = conn.execute("SELECT now()").fetchone() or (None,)
        (first,) = conn.execute("SELECT coalesce(max(id), 0) FROM tether_task_attempts").fetchone() or (0,)
    worker: WorkerProcess = bench_worker(db, log, 2, extra_args=("--queues", "default"))
    worker.start()
    attempts = "SELECT coalesce(max(id), 0) - %s FROM tether_task_attempts"
    try:
        if whole:
            wait_for(
                "the backlog to drain",
                lambda: (
                    not db.query(
                        "SELECT 1 FROM tether_tasks WHERE status IN ('PENDING', 'CLAIMED', 'RUNNING') LIMIT 1"
                    )
                ),
                timeout=900,
                interval=0.1,
            )
        else:
            wait_for("the drain", lambda: db.query(attempts, (first,))[0][0] >= n, timeout=900, interval=0.1)
    finally:
        worker.stop()
    ((done, failed, span),) = db.query(
        # EXPIRED ones are the fill's deadlines passing (its reaper's doing), not the drain's
        "SELECT count(*) FILTER (WHERE status = 'COMPLETED'),"
        " count(*) FILTER (WHERE status IN ('FAILED', 'CANCELLED')),"
        " extract(epoch FROM max(completed_at) - min(started_at))::float8 FROM tether_tasks"
        " WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED')"
        " AND updated_at >= %s AND queue = 'default'",
        (since,),
    )
    if failed:
        raise RuntimeError(f"{failed} drained tasks did not complete; log {log}")
    return {"tasks": done, "seconds": span, "tasks_per_s": done / span}


def throughput(
    big: BenchDatabase, small: BenchDatabase, rounds: int, n: int, log_dir: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    pairs = []
    app_big, app_small = make_app(big.url), make_app(small.url)
    try:
        for r in range(rounds):
            got_big = drain(big, log_dir / f"drain-big-{r}.log", n, whole=False)
            app_big.tasks["noop"].send_many([()] * int(got_big["tasks"]))  # the backlog as it was
            small.reset_tasks()
            app_small.tasks["noop"].send_many([()] * n)
            got_small = drain(small, log_dir / f"drain-small-{r}.log", n, whole=True)
            pairs.append({"big": got_big, "small": got_small, "load": os.getloadavg()[0]})
            say(
                f"throughput round {r + 1}: big {got_big['tasks_per_s']:,.0f} tasks/s, small "
                f"{got_small['tasks_per_s']:,.0f} tasks/s: "
                f"{got_big['tasks_per_s'] / got_small['tasks_per_s']:.2f}x"
                f" (load {pairs[-1]['load']:.1f})"
            )
    finally:
        app_big.close()
        app_small.close()
    ratio = statistics.median(p["big"]["tasks_per_s"] / p["small"]["tasks_per_s"] for p in pairs)
    return {"pairs": pairs, "median_ratio": ratio, "passed": ratio >= THROUGHPUT_SHARE}


# -- send latency -------------------------------------------------------------------------------


def send(big: BenchDatabase, small: BenchDatabase, rounds: int, say: Callable[[str], None]) -> dict[str, Any]:
    apps = {"big": make_app(big.url), "small": make_app(small.url)}
    seconds: dict[str, list[float]] = {"big": [], "small": []}
    try:
        for app in apps.values():
            for _ in range(200):  # pool, schema check, psycopg's prepared statements
                app.tasks["noop"].send()
        for _ in range(rounds * 2):
            for which, app in apps.items():
                noop = app.tasks["noop"]
                t0 = time.perf_counter()
                for _ in range(SEND_BLOCK):
                    noop.send()
                seconds[which].append(time.perf_counter() - t0)
    finally:
        for app in apps.values():
            app.close()
    us = {k: [1e6 * s / SEND_BLOCK for s in v] for k, v in seconds.items()}
    ratio = statistics.median(b / s for b, s in zip(us["big"], us["small"], strict=True))
    say(
        f"send: {statistics.median(us['big']):.0f} us/send big, "
        f"{statistics.median(us['small']):.0f} us small "
        f"({ratio:.2f}x; blocks of {SEND_BLOCK:,}, {len(us['big'])} each)"
    )
    return {"us_per_send": us, "median_ratio": ratio}


# -- the reaper ------------------------------------------------------------------------------------


def reaper(db: BenchDatabase, repeat: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Ticks of a reaper with tether's defaults, in this process, each one a pass (the fleet's
    next pass made due first, untimed); each statement of a pass alone too."""
    with psycopg.connect(db.url, autocommit=True) as conn:
        millions_fill.refresh_in_flight(conn)
    config = AppConfig(broker=PostgresConfig(database_url=db.url))
    reaper = Reaper(
        db.url,
        config,
        heartbeat_interval_s=config.recovery.runner_heartbeat_interval_ms / 1000,
        worker_id="bench-millions",
    )
    ticks, first = [], 0.0
    try:
        due_now(db)
        t0 = time.perf_counter()
        reaper.run_once()  # the first pass also prunes (retention: nothing of the fill is old enough)
        first = (time.perf_counter() - t0) * 1000
        for _ in range(max(repeat, 20)):
            due_now(db)
            t0 = time.perf_counter()
            done, _wait = reaper.run_once()
            ticks.append((time.perf_counter() - t0) * 1000)
            if done is None:
                raise RuntimeError("another reaper did the pass: stop the workers on the bench database")
    finally:
        reaper.connection.close()
    statements = reaper_statements(db, repeat)
    say(
        f"reaper tick: median {statistics.median(ticks):.1f} ms, max {max(ticks):.1f} ms "
        f"over {len(ticks)} ticks "
        f"(first, with retention: {first:.0f} ms)"
    )
    for t in statements:
        say("  " + t.line())
    return {
        "tick_ms": ticks,
        "median_ms": statistics.median(ticks),
        "max_ms": max(ticks),
        "first_tick_with_prune_ms": first,
        "statements": [asdict(t) for t in statements],
        "passed": statistics.median(ticks) < REAPER_TARGET_MS,
    }


def due_now(db: BenchDatabase) -> None:
    """The fleet's next reaper pass due now (tether_reaper, migration 11)."""
    db.query("UPDATE tether_reaper SET next_pass_at = now() WHERE singleton RETURNING 1")


def reaper_statements(db: BenchDatabase, repeat: int) -> list[Timing]:
    """Each statement of a reaper's pass alone, after the pass's claim (and its settings), in
    a transaction rolled back (nothing is stale)."""
    ms = timedelta(milliseconds=1)
    params: dict[str, dict[str, Any]] = {
        "expire_pending": {"limit": 500},
        "requeue_stale_claimed": {"threshold": 120_000 * ms, "owner": None, "limit": 500},
        "stale_running": {"threshold": 300_000 * ms, "owner": None, "limit": 500},
        "deactivate_stale_workers": {"threshold": 90_000 * ms, "limit": 500},
        "next_due_in": {"claimed_threshold": 120_000 * ms, "running_threshold": 300_000 * ms},
        "stuck_steps": {"limit": 500},
        "unfinished_workflows": {"limit": 500},
        "cancelled_leftovers": {"limit": 500},
        # One batch of retention (worker/retention.py), read from the start as a first pass does.
        "prune_heartbeats": {"age": timedelta(hours=24), "limit": 1000, "after": FROM_THE_START},
        "prune_terminal_tasks": {"age": timedelta(hours=720), "limit": 1000, "after": FROM_THE_START},
        "prune_workflows": {"age": timedelta(hours=720), "limit": 1000},
    }
    found = []
    with psycopg.connect(db.url) as conn:
        for name, values in params.items():
            runs = []
            for _ in range(repeat + 1):
                # As in a pass: claimed first, with the settings its transaction has.
                conn.execute(
                    q("claim_reaper_pass"), {"worker_id": "bench-millions", "check_interval": 30_000 * ms}
                )
                t0 = time.perf_counter()
                cur = conn.execute(q(name), values)
                if cur.description is not None:
                    cur.fetchall()
                runs.append((time.perf_counter() - t0) * 1000)
                conn.rollback()
            found.append(Timing(name, runs[1:]))
    return found


# -- the run --------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    lines = ["| part | figure | target | pass/fail |", "|---|---|---|---|"]
    if "throughput" in results:
        t = results["throughput"]
        lines.append(
            f"| throughput | big / small, median of {len(t['pairs'])} pairs: "
            f"{t['median_ratio']:.2f}x | >= 0.90x | "
            f"{'pass' if t['passed'] else '**FAIL**'} |"
        )
    if "send" in results:
        s = results["send"]
        lines.append(
            f"| send | us per send, big / small: {s['median_ratio']:.2f}x "
            f"({statistics.median(s['us_per_send']['big']):.0f} / "
            f"{statistics.median(s['us_per_send']['small']):.0f}) "
            f"| unchanged | context |"
        )
    for part in ("commands", "server", "dashboard"):
        for t in results.get(part, []):
            median = statistics.median(t["runs_ms"])
            target = COMMAND_TARGET_MS
            shown = f"{median:.0f} ms"
            if part == "commands" and t["reference_ms"] is not None:
                # A process's own start-up (interpreter, imports) is the small database's
                # fastest run; what the data adds is the fastest run's excess over it.
                fastest = min(t["runs_ms"])
                extra = fastest - t["reference_ms"]
                shown = (
                    f"fastest {fastest:.0f} ms (small database {t['reference_ms']:.0f} ms: {extra:+.0f} ms)"
                )
                verdict = extra < target
            else:
                verdict = median < target
            lines.append(
                f"| {part} | {t['label']}: {shown} | < {target:.0f} ms "
                f"| {'pass' if verdict else '**FAIL**'} |"
            )
    if "reaper" in results:
        r = results["reaper"]
        lines.append(
            f"| reaper | tick median {r['median_ms']:.1f} ms, max {r['max_ms']:.1f} ms "
            f"| < {REAPER_TARGET_MS:.0f} ms "
            f"| {'pass' if r['passed'] else '**FAIL**'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def say(line: str) -> None:
        print(line, flush=True)

    if args.drop:
        gone = NamedDatabase(args.database_url, args.drop)
        gone.created = True
        gone.drop()
        say(f"dropped {args.drop}")
        return 0
    log_dir = Path(tempfile.mkdtemp(prefix="tether-bench-millions-"))
    big: BenchDatabase = (
        NamedDatabase(args.database_url, args.reuse) if args.reuse else BenchDatabase(args.database_url)
    )
    small = BenchDatabase(args.database_url)
    results: dict[str, Any] = {}
    keep = bool(args.keep or args.reuse)
    try:
        if args.reuse:
            big.created = True
            results["fill"] = fill_info(big)
            say(f"reusing {big.name}: {results['fill']['pending']:,} + {results['fill']['terminal']:,}")
        else:
            big.create()
            migrate(big.url)
            say(f"filling {big.name}: {args.pending:,} PENDING + {args.terminal:,} terminal")
            results["fill"] = filled(big, args.pending, args.terminal, say)
        small.create()
        migrate(small.url)
        samples = Samples.read(big.url)
        if "throughput" in args.parts:
            n = DRAIN["quick" if args.pending < FULL["pending"] // 10 else "full"]
            results["throughput"] = throughput(big, small, args.rounds, n, log_dir, say)
        if "send" in args.parts:
            results["send"] = send(big, small, args.rounds, say)
        with psycopg.connect(big.url, autocommit=True) as conn:
            millions_fill.refresh_in_flight(conn)
        if "reaper" in args.parts:
            results["reaper"] = reaper(big, args.repeat, say)
        small.reset_tasks()
        with psycopg.connect(small.url, autocommit=True) as conn:  # the small one: a few rows of each kind
            millions_fill.fill(conn, pending=100, terminal=1_000, say=lambda _: None)
        for part, timer in (
            ("server", lambda: millions_reads.time_server_side(big.url, samples, args.repeat)),
            ("commands", lambda: millions_reads.time_commands(big.url, small.url, samples, args.repeat)),
            ("dashboard", lambda: millions_reads.time_dashboard(big.url, samples, args.repeat, log_dir)),
        ):
            if part in args.parts:
                timings = timer()
                for t in timings:
                    say(f"{part:<10} {t.line()}")
                results[part] = [asdict(t) for t in timings]
    finally:
        small.drop()
        if not keep:
            big.drop()
        elif big.created:
            say(f"kept {big.name}: measure it again with --reuse {big.name}, drop it with --drop {big.name}")
    say("")
    say(report(results))
    if args.json:
        results["load_after"] = os.getloadavg()
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
        say(f"written to {args.json}")
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
