"""Run the benchmarks: ``python -m bench [--quick] [--only NAME[,NAME]] [--json PATH]``.

Creates a fresh database tether_bench_<random> on the server, runs each scenario,
prints one line per scenario and a markdown table, and drops the database at the
end. Every worker subprocess started is killed by its pid on the way out, even
after an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import psycopg

if __package__ in (None, ""):  # `python bench/run.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import REPO

from bench.apps import make_app
from bench.async_tasks import ASYNC_SCENARIOS
from bench.held_horizon import HELD_HORIZON_SCENARIOS
from bench.infra import DEFAULT_SERVER_URL, BenchDatabase, cache_bytecode
from bench.limits import LIMITS_SCENARIOS
from bench.periodic import PERIODIC_SCENARIOS
from bench.recovery import RECOVERY_SCENARIOS
from bench.retention_pace import RETENTION_SCENARIOS
from bench.scenarios import CORE_SCENARIOS, Context, Outcome, Row
from bench.send_limit import SEND_LIMIT_SCENARIOS
from bench.sleeps import SLEEP_SCENARIOS
from bench.steps import STEP_SCENARIOS
from bench.transactions import TRANSACTION_SCENARIOS
from bench.unique import UNIQUE_SCENARIOS
from bench.workflows import WORKFLOW_SCENARIOS

BUSY_WARNING = 15.0
SCENARIOS = {
    **CORE_SCENARIOS,
    **SEND_LIMIT_SCENARIOS,
    **UNIQUE_SCENARIOS,
    **TRANSACTION_SCENARIOS,
    **RECOVERY_SCENARIOS,
    **WORKFLOW_SCENARIOS,
    **PERIODIC_SCENARIOS,
    **ASYNC_SCENARIOS,
    **HELD_HORIZON_SCENARIOS,
    **RETENTION_SCENARIOS,
    **LIMITS_SCENARIOS,
    **STEP_SCENARIOS,
    **SLEEP_SCENARIOS,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("TETHER_BENCH_DATABASE_URL") or DEFAULT_SERVER_URL,
        help="server to benchmark on; a fresh database is created there and dropped afterwards "
        f"(default: TETHER_BENCH_DATABASE_URL, else {DEFAULT_SERVER_URL})",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run only these scenarios (repeat or comma-separate): {', '.join(SCENARIOS)}",
    )
    parser.add_argument("--quick", action="store_true", help="smaller counts, for a smoke run")
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each scenario, wait up to SECONDS for the machine to be idle "
        f"(< {BUSY_WARNING:g}%% CPU over a second); for shared machines",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    names = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    args.names = [n for n in SCENARIOS if n in names] if names else list(SCENARIOS)
    return args


def machine(db: BenchDatabase) -> dict[str, Any]:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    rows = db.query(
        "SELECT current_setting('server_version'), current_setting('fsync'),"
        " current_setting('synchronous_commit'), current_setting('wal_sync_method'),"
        " current_setting('shared_buffers')"
    )
    version, fsync, sync_commit, wal_sync, shared_buffers = rows[0]
    from tether import __version__

    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "tether": __version__,
        "tether_commit": _commit(),
        "postgres": version,
        "fsync": fsync,
        "synchronous_commit": sync_commit,
        "wal_sync_method": wal_sync,
        "shared_buffers": shared_buffers,
    }


def background_cpu() -> float:
    """System-wide CPU use over one second while the benchmark itself is idle: other load."""
    return float(psutil.cpu_percent(interval=1.0))


def others_cpu_seconds() -> float:
    """CPU seconds used so far by processes that are neither this run (nor its workers) nor PostgreSQL.

    Differences of this across a scenario tell whether other work on the machine competed
    with it. Processes that start and end in between are counted once their parent reaps them.
    """
    me = psutil.Process()
    ours = {me.pid, *(p.pid for p in me.children(recursive=True))}
    total = 0.0
    for proc in psutil.process_iter(["pid", "ppid", "username", "cpu_times"]):
        info = proc.info
        times = info.get("cpu_times")
        # Skipped: kernel threads (children of kthreadd, pid 2: block I/O completions of our own
        # fsyncs run there) and PostgreSQL's processes (our backends are among them).
        if (
            info["pid"] in ours
            or info.get("ppid") == 2
            or info["pid"] == 2
            or info.get("username") == "postgres"
            or times is None
        ):
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def _commit() -> str:
    """The checked-out commit of the code under test, '+dirty' when src/ has local changes."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"
    return f"{head or '?'}{'+dirty' if dirty else ''}"


def table(rows: list[Row]) -> str:
    lines = ["| scenario | figure | target | pass/fail |", "|---|---|---|---|"]
    for r in rows:
        verdict = "context" if r.passed is None else ("pass" if r.passed else "**FAIL**")
        lines.append(f"| {r.scenario} | {r.shown()} | {r.target or '-'} | {verdict} |")
    return "\n".join(lines)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwind through the finally blocks: kill workers, drop db


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cache_bytecode(REPO / "src", REPO / "bench")  # as an installed tether would be
    signal.signal(signal.SIGTERM, _terminate)
    log_dir = Path(tempfile.mkdtemp(prefix="tether-bench-"))
    db = BenchDatabase(args.database_url)
    rows: list[Row] = []
    details: dict[str, Any] = {}
    errors: dict[str, str] = {}
    info: dict[str, Any] = {}
    ctx = Context(db, args.quick, log_dir)
    started = time.perf_counter()
    interrupted = ""
    noisy: list[str] = []
    try:
        db.create()
        print(f"database {db.name} created; worker logs in {log_dir}", flush=True)
        info = machine(db)
        print(
            f"tether {info['tether']} at {info['tether_commit']}; machine: {info['cpus']} cpus "
            f"({info['cpu_model']}), PostgreSQL {info['postgres']}, "
            f"fsync={info['fsync']}, synchronous_commit={info['synchronous_commit']}"
            f"{', QUICK run' if args.quick else ''}",
            flush=True,
        )
        schema_app = make_app(db.url)
        try:
            _ = schema_app.broker.url  # applies the migrations once, before any timing
        finally:
            schema_app.close()
        for name in args.names:
            busy = background_cpu()
            deadline = time.monotonic() + args.wait_idle
            while busy > BUSY_WARNING and time.monotonic() < deadline:
                busy = background_cpu()
            if busy > BUSY_WARNING:
                print(
                    f"{name:<22} warning: the machine is {busy:.0f}% busy before this scenario "
                    "(other processes): figures will be low",
                    flush=True,
                )
            others_before, wall_before = others_cpu_seconds(), time.perf_counter()
            try:
                outcome: Outcome = SCENARIOS[name](ctx)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                print(f"{name:<22} ERROR {errors[name]}", flush=True)
                traceback.print_exc()
                rows.append(Row(name, "error", float("nan"), "", "-", False))
                continue
            finally:
                for worker in ctx.workers:  # a scenario's own finally stops its worker; make sure
                    worker.stop()
            others = (
                100
                * (others_cpu_seconds() - others_before)
                / ((time.perf_counter() - wall_before) * (os.cpu_count() or 1))
            )
            print(f"{name:<22} {outcome.line}", flush=True)
            if others > BUSY_WARNING:
                noisy.append(f"{name} ({others:.0f}%)")
                print(
                    f"{name:<22} warning: other processes used {others:.0f}% of the machine's CPU "
                    "during this scenario: its figures are low",
                    flush=True,
                )
            rows.extend(outcome.rows)
            details[name] = {
                **outcome.detail,
                "machine_busy_before_pct": busy,
                "other_processes_cpu_pct_during": others,
                "loadavg_after": os.getloadavg(),
            }
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "Ctrl-C"
    finally:
        for worker in ctx.workers:
            try:
                worker.stop()
            except Exception as exc:
                print(f"could not stop worker pid {worker.pid}: {exc}", file=sys.stderr)
        try:
            db.drop()
        except Exception as exc:
            print(f"could not drop database {db.name}: {exc}", file=sys.stderr)
    elapsed = time.perf_counter() - started
    if interrupted:
        print(
            f"\ninterrupted ({interrupted}): workers stopped, database {db.name} "
            f"{'NOT dropped' if db.created else 'dropped'}",
            file=sys.stderr,
        )
        return 130
    print()
    print(table(rows))
    if noisy:
        print(
            f"\nother processes competed for the CPU during: {', '.join(noisy)}; rerun those when "
            "the machine is quiet (--wait-idle only checks before each scenario)"
        )
    print(
        f"\n{len(args.names)} scenario(s) in {elapsed:.0f}s; database {db.name} "
        f"{'NOT dropped' if db.created else 'dropped'}"
    )
    if args.json:
        results = [{**r.__dict__, "value": None if math.isnan(r.value) else r.value} for r in rows]
        report = {
            "quick": args.quick,
            "machine": info,
            "elapsed_s": elapsed,
            "results": results,
            "details": details,
            "errors": errors,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"results written to {args.json}")
    if errors:
        print(f"worker logs kept in {log_dir}")
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
