"""Side by side: tether, pgqueuer and procrastinate on the same scenarios in one run.

``python -m bench.peers [--rounds 3] [--only SCENARIO] [--peers NAME,...] [--json PATH]``

Each peer gets its own fresh database on the server (dropped at the end), its natural
worker as a real subprocess, and the same scenarios; rounds are interleaved (round 1 of
every peer, then round 2, ...; the peers' order rotates from round to round) so that a
shared machine's drift lands on all of them. pgqueuer and procrastinate come from the
``bench-peers`` extra (``pip install -e '.[bench-peers]'``); tether never imports them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import sql

from bench.infra import DEFAULT_SERVER_URL, REPO, cache_bytecode, with_database
from bench.peers import scenarios
from bench.peers.base import Peer
from bench.peers.claim_limit import claim_limit, pgbench

EXTRA = "bench-peers"
PEERS = ("tether", "pgqueuer", "procrastinate")
SCENARIOS = ("startup", "drain", "limit", "pickup", "sends", "commits", "recovery")
BUSY = 15.0  # % of the machine's CPU: above it, another process is competing


class MissingExtra(SystemExit):
    pass


def require(names: list[str]) -> None:
    """Fail, naming the extra, when a requested peer's library is not installed."""
    missing = [n for n in names if n != "tether" and importlib.util.find_spec(n) is None]
    if missing:
        raise MissingExtra(
            f"python -m bench.peers: {', '.join(missing)} not installed; the peers bench needs the "
            f"'{EXTRA}' extra: pip install -e '.[{EXTRA}]' (or run only --peers tether)"
        )


def make_peer(name: str, url: str) -> Peer:
    if name == "tether":
        from bench.peers.tether_peer import TetherPeer

        return TetherPeer(url)
    if name == "pgqueuer":
        from bench.peers.pgqueuer_peer import PgqueuerPeer

        return PgqueuerPeer(url)
    from bench.peers.procrastinate_peer import ProcrastinatePeer

    return ProcrastinatePeer(url)


def _names(
    values: list[str], allowed: tuple[str, ...], parser: argparse.ArgumentParser, what: str
) -> list[str]:
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        parser.error(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return [n for n in allowed if n in names] if names else list(allowed)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    p.add_argument(
        "--database-url",
        default=os.environ.get("TETHER_BENCH_DATABASE_URL") or DEFAULT_SERVER_URL,
        help="the server; each peer gets a fresh database there, dropped at the end",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", action="append", default=[], metavar="SCENARIO", help=", ".join(SCENARIOS))
    p.add_argument("--peers", action="append", default=[], metavar="NAME", help=", ".join(PEERS))
    p.add_argument("--tasks", type=int, default=10_000, help="no-op tasks of the drain (default 10,000)")
    p.add_argument(
        "--pickups", type=int, default=300, help="paced sends of the pickup scenario (default 300)"
    )
    p.add_argument("--sends", type=int, default=2_000, help="timed sends per kind and round (default 2,000)")
    p.add_argument("--window", type=float, default=20.0, help="seconds of each commit window (default 20)")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help=f"before each step, wait up to SECONDS for the machine to be idle (< {BUSY:g}%% CPU)",
    )
    p.add_argument("--json", type=Path, metavar="PATH")
    args = p.parse_args(argv)
    args.scenarios = _names(args.only, SCENARIOS, p, "scenario")
    args.peer_names = _names(args.peers, PEERS, p, "peer")
    if args.rounds < 1 or args.tasks < 1 or args.pickups < 1 or args.sends < 4:
        p.error("--rounds, --tasks and --pickups must be >= 1, --sends >= 4")
    return args


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _create(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def _drop(server_url: str, name: str) -> None:
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _wait_idle(seconds: float) -> float:
    busy = psutil.cpu_percent(interval=1.0)
    deadline = time.monotonic() + seconds
    while busy > BUSY and time.monotonic() < deadline:
        busy = psutil.cpu_percent(interval=1.0)
    return float(busy)


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# figure key -> (label, unit, format)
FIGURES: dict[str, tuple[str, str, str]] = {
    "first_task_s": ("worker start to first task started", "s", "{:.2f}"),
    "cold_rate": ("tasks/s, worker start to last done", "/s", "{:,.0f}"),
    "steady_rate": ("tasks/s, first start to last done", "/s", "{:,.0f}"),
    "p50_ms": ("pickup p50", "ms", "{:.1f}"),
    "p99_ms": ("pickup p99", "ms", "{:.1f}"),
    "claim_p50_ms": ("claim alone (claimed_at - sent_at) p50", "ms", "{:.1f}"),
    "claim_p99_ms": ("claim alone (claimed_at - sent_at) p99", "ms", "{:.1f}"),
    "rate": ("sends/s, one producer", "/s", "{:,.0f}"),
    "idle_commits_per_s": ("commits/s, idle worker", "/s", "{:.2f}"),
    "busy_commits_per_s": ("commits/s, 50 tasks running", "/s", "{:.2f}"),
    "kill_to_decision_s": ("whole-worker SIGKILL to recovery decision", "s", "{:.2f}"),
    "limit_rows_per_s": ("rows/s claimed and ended, batches of 10", "/s", "{:,.0f}"),
}

# Issue 25, item 3: tether's steady drain rates against the batched claim limit of the same
# round (bench/peers/claim_limit.py): (drain configuration, limit, target share). The issue
# names one limit, pgbench's with one client; two children are also shown against pgbench's
# two clients, the stricter reading.
LIMIT_SHARES = (
    ("tether 1 async child", "pgbench claim then end, 1 client", 0.5),
    ("tether 2 async children", "pgbench claim then end, 1 client", 0.7),
    ("tether 2 async children", "pgbench claim then end, 2 clients", 0.7),
)


def table(results: dict[str, dict[str, dict[str, list[float]]]]) -> str:
    lines = [
        "| scenario | peer and configuration | figure | median | range over rounds |",
        "|---|---|---|---|---|",
    ]
    for scenario, configs in results.items():
        for config, figures in configs.items():
            for key, values in figures.items():
                if key not in FIGURES or not values:
                    continue
                label, unit, fmt = FIGURES[key]
                s = summarize(values)
                lines.append(
                    f"| {scenario} | {config} | {label} | {fmt.format(s['median'])} {unit} | "
                    f"{fmt.format(s['min'])}-{fmt.format(s['max'])} |"
                )
    return "\n".join(lines)


def limit_shares(results: dict[str, dict[str, dict[str, list[float]]]]) -> list[str]:
    """Each tether drain's steady rate over the claim limit of the same round."""
    lines = []
    for config, limit_config, target in LIMIT_SHARES:
        limits = results.get("limit", {}).get(limit_config, {}).get("limit_rows_per_s", [])
        rates = results.get("drain", {}).get(config, {}).get("steady_rate", [])
        shares = [rate / limit for rate, limit in zip(rates, limits, strict=False)]
        if shares:
            lines.append(
                f"{config}: steady rate / {limit_config} per round "
                + ", ".join(f"{x:.2f}" for x in shares)
                + f" (target >= {target:g})"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require(args.peer_names)
    cache_bytecode(REPO / "src", REPO / "bench")  # the peers come compiled, from wheels
    signal.signal(signal.SIGTERM, _terminate)
    log_dir = Path(tempfile.mkdtemp(prefix="tether-peers-"))
    tag = secrets.token_hex(3)
    dbs = {n: f"peers_bench_{tag}_{n}" for n in args.peer_names}
    limit_db = f"peers_bench_{tag}_limit"
    created: list[str] = []
    cfg = scenarios.Config(args.tasks, args.pickups, args.sends, args.window, log_dir, [])
    results: dict[str, dict[str, dict[str, list[float]]]] = {s: {} for s in args.scenarios}
    details: dict[str, Any] = {"busy_before_pct": [], "meaning": {}}
    started = time.perf_counter()
    failed = ""
    try:
        peers: list[Peer] = []
        for name in args.peer_names:
            _create(args.database_url, dbs[name])
            created.append(dbs[name])
            peer = make_peer(name, with_database(args.database_url, dbs[name]))
            peer.install()
            peers.append(peer)
        if "limit" in args.scenarios:
            pgbench()  # missing: fail now, naming the package, not after the first rounds
            _create(args.database_url, limit_db)
            created.append(limit_db)
        print(
            "peers: "
            + ", ".join(f"{p.name} {p.version}" for p in peers)
            + f"; {os.cpu_count()} cpus; worker logs in {log_dir}",
            flush=True,
        )
        if "startup" in args.scenarios:  # bytecode compiled and files cached before any timing
            for peer in peers:
                scenarios.startup(peer, cfg)
        for rnd in range(args.rounds):
            order = peers[rnd % len(peers) :] + peers[: rnd % len(peers)]
            for scenario in args.scenarios:
                busy = _wait_idle(args.wait_idle)
                details["busy_before_pct"].append({"round": rnd + 1, "scenario": scenario, "pct": busy})
                if busy > BUSY:
                    print(f"round {rnd + 1} {scenario}: warning, the machine is {busy:.0f}% busy", flush=True)
                runs: list[tuple[str, Callable[[], dict[str, dict[str, Any]]]]]
                if scenario == "sends":
                    runs = [("all", lambda: scenarios.sends(peers, cfg))]
                elif scenario == "limit":  # the machine's, not a peer's: on a database of its own
                    runs = [("pgbench", lambda: claim_limit(with_database(args.database_url, limit_db)))]
                else:
                    runs = [
                        (p.name, _one(scenario, p, cfg, args.database_url, dbs[p.name], rnd)) for p in order
                    ]
                for who, run in runs:
                    t0 = time.perf_counter()
                    out = run()
                    for config, figures in out.items():
                        slot = results[scenario].setdefault(config, {})
                        for key, value in figures.items():
                            if isinstance(value, (int, float)):
                                slot.setdefault(key, []).append(float(value))
                            else:
                                details["meaning"][config] = value
                        shown = ", ".join(
                            f"{FIGURES[k][0]} {FIGURES[k][2].format(v)} {FIGURES[k][1]}"
                            for k, v in figures.items()
                            if k in FIGURES
                        )
                        print(f"round {rnd + 1} {scenario:<8} {config}: {shown}", flush=True)
                    print(
                        f"round {rnd + 1} {scenario:<8} ({who}) {time.perf_counter() - t0:.0f}s", flush=True
                    )
    except KeyboardInterrupt as exc:
        failed = f"interrupted ({exc or 'Ctrl-C'})"
    except Exception as exc:
        failed = f"{type(exc).__name__}: {exc}"
        import traceback

        traceback.print_exc()
    finally:
        for worker in cfg.workers:
            try:
                worker.kill()
            except Exception as exc:  # keep going: every other worker and database still goes
                print(f"could not stop worker pid {worker.proc.pid}: {exc}", file=sys.stderr)
        for name in created:
            try:
                _drop(args.database_url, name)
            except Exception as exc:
                print(f"could not drop database {name}: {exc}", file=sys.stderr)
    elapsed = time.perf_counter() - started
    print()
    print(table(results))
    for line in limit_shares(results):
        print(line)
    print(f"\n{args.rounds} round(s) in {elapsed:.0f}s; load average after: {os.getloadavg()[0]:.2f}")
    for config, meaning in details["meaning"].items():
        print(f"  {config}: {meaning}")
    if args.json:
        report = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "elapsed_s": elapsed,
            "results": {
                s: {c: {k: {"values": v, **summarize(v)} for k, v in f.items()} for c, f in cfgs.items()}
                for s, cfgs in results.items()
            },
            "details": details,
            "error": failed or None,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    if failed:
        print(f"FAILED: {failed}; worker logs kept in {log_dir}", file=sys.stderr)
        return 1
    shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _one(
    scenario: str, peer: Peer, cfg: scenarios.Config, server_url: str, dbname: str, rnd: int
) -> Callable[[], dict[str, dict[str, Any]]]:
    if scenario == "startup":
        return lambda: scenarios.startup(peer, cfg)
    if scenario == "drain":
        return lambda: scenarios.drain(peer, cfg)
    if scenario == "pickup":
        return lambda: scenarios.pickup(peer, cfg)
    if scenario == "recovery":
        return lambda: scenarios.recovery(peer, cfg, rnd)
    return lambda: scenarios.commits(peer, cfg, server_url, dbname)
