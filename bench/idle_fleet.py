"""What an idle (and a busy) fleet of workers costs the database: ``python -m bench.idle_fleet
[--workers N] [--busy-rate TASKS_PER_S]``.

Starts a private embedded PostgreSQL (in a temporary folder, with ``max_connections``
raised for the fleet), a database in it, and N idle workers (``tether worker bench.apps:app
--processes 1``, tether's default settings), each a real subprocess in its own session.
Once every worker is registered and waits for work (its row in ``tether_queue_waiters``),
and a settling time has passed, it measures over one window (30 s by default):

- the database server's CPU time: the postmaster and all its processes (psutil), delta
- transactions/s of the fleet's database (``pg_stat_database``: commits + rollbacks),
  read from the server's own ``postgres`` database so that the reads do not count
- round trips/s, counted on the wire by a loopback proxy in front of the server
  (``tests/wire_counter.py``: every Simple Query and every Sync), by connection kind
  (``application_name``); ``--no-proxy`` connects the workers directly and skips this
- connections held, from ``pg_stat_activity``, by ``application_name``
- statements executed and their execution time, by statement (``pg_stat_statements``,
  loaded by the private server: ``shared_preload_libraries``), reset at the window's start
- the reaper's passes in the window (``tether_reaper``, where the schema has it)
- the workers' own CPU (main processes and children), as context

With ``--busy-rate R`` it then measures a second window with tasks flowing: a producer
thread in this process sends R no-op tasks per second (a ``send_many`` every 0.1 s) for
the fleet to run, from ``--settle`` seconds before the window to its end.

Every process it starts is stopped by its pid in a ``finally`` (SIGTERM to each worker,
then SIGKILL to each worker's process group), the server through its postmaster's pid,
and the temporary folder is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
import psycopg

if __package__ in (None, ""):  # `python bench/idle_fleet.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.wire_counter import WireCounter

from bench.infra import RECOVERY_ENV, REPO, wait_for
from tether.db.embedded import EmbeddedServer
from tether.db.migrate import migrate

DATABASE = "tether_fleet"
# Per idle worker: its pool's one connection, listener, heartbeat writer, reaper; more
# once it has run tasks (see docs/operations.md). Generous, so a fleet never hits it.
CONNECTIONS_PER_WORKER = 8
# Stop starting workers when less memory than this is left: the machine must stay usable.
MEMORY_RESERVE = 2 * 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.idle_fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=100, help="idle workers to start (default 100)")
    parser.add_argument("--window", type=float, default=30.0, help="measurement window, seconds (default 30)")
    parser.add_argument(
        "--settle",
        type=float,
        default=15.0,
        help="seconds to wait after the last worker is idle, before the window (default 15): "
        "start-up work ends, and psycopg prepares the claim on its 6th run on a connection",
    )
    parser.add_argument("--batch", type=int, default=10, help="workers started at once (default 10)")
    parser.add_argument(
        "--busy-rate",
        type=float,
        default=0.0,
        help="also measure a busy window: this many no-op tasks sent per second (default 0: idle only)",
    )
    parser.add_argument("--no-proxy", action="store_true", help="connect directly: no round trip count")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.batch < 1 or args.window <= 0 or args.settle < 0 or args.busy_rate < 0:
        parser.error("--workers and --batch must be >= 1, --window > 0, --settle and --busy-rate >= 0")
    return args


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def _trees(roots: list[int]) -> Iterator[psutil.Process]:
    """The processes of these roots and all their descendants, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc.pid)
    todo = list(roots)
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            continue  # exited meanwhile
        yield proc


class Fleet:
    """The worker subprocesses, each `tether worker bench.apps:app --processes 1` in its own session."""

    def __init__(self, url: str, log_dir: Path) -> None:
        self.url = url
        self.log_dir = log_dir
        self.workers: list[Worker] = []

    def start(self) -> Worker:
        env = {
            k: v for k, v in os.environ.items() if k not in RECOVERY_ENV and not k.startswith("TETHER_WORKER")
        }
        env["TETHER_DATABASE_URL"] = self.url
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        log_path = self.log_dir / f"worker-{len(self.workers) + 1}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "tether", "worker", "bench.apps:app", "--processes", "1"]
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        worker = Worker(proc, log, log_path)
        self.workers.append(worker)
        return worker

    def check_alive(self) -> None:
        for w in self.workers:
            if w.proc.poll() is not None:
                tail = w.log_path.read_text(errors="replace").splitlines()[-20:]
                raise RuntimeError(f"worker pid {w.pid} exited with {w.proc.returncode}:\n" + "\n".join(tail))

    def cpu_seconds(self) -> float:
        total = 0.0
        for p in _trees([w.pid for w in self.workers]):
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def rss_bytes(self) -> int:
        total = 0
        for p in _trees([w.pid for w in self.workers]):
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to every worker at once, wait, then SIGKILL to each one's process group (by pid)."""
        for w in self.workers:
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for w in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(max(0.1, deadline - time.monotonic()))
        for w in self.workers:
            # The session we created: its group id is the worker's pid. Reaches any straggler.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(5)
            w.log.close()


def server_cpu_seconds(postmaster: psutil.Process) -> float:
    """CPU seconds of the postmaster and its processes, including those that already exited."""
    t = postmaster.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system  # reaped children
    for child in _trees([postmaster.pid]):
        if child.pid != postmaster.pid:
            with contextlib.suppress(psutil.Error):
                c = child.cpu_times()
                total += c.user + c.system
    return total


def transactions(admin: psycopg.Connection[Any]) -> tuple[int, float]:
    row = admin.execute(
        "SELECT xact_commit + xact_rollback, extract(epoch FROM clock_timestamp())::float8"
        " FROM pg_stat_database WHERE datname = %s",
        (DATABASE,),
    ).fetchone()
    assert row is not None
    return int(row[0]), float(row[1])


def connections(admin: psycopg.Connection[Any]) -> dict[str, int]:
    rows = admin.execute(
        "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = %s"
        " GROUP BY 1 ORDER BY 2 DESC",
        (DATABASE,),
    ).fetchall()
    return {str(name or "-"): int(n) for name, n in rows}


def backend_memory(admin: psycopg.Connection[Any]) -> tuple[int, int]:
    """(backends of the fleet's database, their summed unique memory, USS, in bytes)."""
    pids = [r[0] for r in admin.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (DATABASE,))]
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_full_info().uss
    return len(pids), total


def reset_statements(fleet_db: psycopg.Connection[Any]) -> None:
    fleet_db.execute("SELECT pg_stat_statements_reset()")


def statements(fleet_db: psycopg.Connection[Any]) -> dict[str, Any]:
    """Calls and execution time since the reset, of the fleet's database, by statement."""
    rows = fleet_db.execute(
        "SELECT query, calls, total_exec_time FROM pg_stat_statements"
        " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND query NOT LIKE '%%pg_stat_statements%%' ORDER BY total_exec_time DESC"
    ).fetchall()
    top = [
        {"statement": _statement_label(q), "calls": int(c), "exec_ms": round(float(t), 1)}
        for q, c, t in rows[:12]
    ]
    return {
        "calls": sum(int(r[1]) for r in rows),
        "exec_ms": round(sum(float(r[2]) for r in rows), 1),
        "top_by_exec_time": top,
    }


def _statement_label(query: str) -> str:
    """A statement's first words, on one line (the .sql files' names are not sent)."""
    return " ".join(query.split())[:90]


def reaper_passes(fleet_db: psycopg.Connection[Any]) -> int | None:
    """The fleet's reaper passes so far (tether_reaper, migration 11); None before that schema."""
    if not fleet_db.execute("SELECT to_regclass('tether_reaper') IS NOT NULL").fetchone()[0]:  # type: ignore[index]
        return None
    row = fleet_db.execute("SELECT passes FROM tether_reaper").fetchone()
    return int(row[0]) if row else None


class Producer:
    """A thread that sends ``rate`` no-op tasks per second, a batch every 0.1 s, until stopped."""

    def __init__(self, url: str, rate: float) -> None:
        from bench.apps import make_app

        self.app = make_app(url)
        self.rate = rate
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench producer", daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def _run(self) -> None:
        noop = self.app.tasks["noop"]
        owed, last = 0.0, time.monotonic()
        while not self._stop.wait(0.1):
            now = time.monotonic()
            owed += (now - last) * self.rate
            last = now
            n = int(owed)
            if n:
                noop.send_many([() for _ in range(n)])
                self.sent += n
                owed -= n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.app.close()


def idle_workers(admin_db: psycopg.Connection[Any], pids: list[int]) -> int:
    """How many of these worker pids are registered, active, and wait for work."""
    row = admin_db.execute(
        "SELECT count(DISTINCT w.pid) FROM tether_workers w JOIN tether_queue_waiters q ON q.worker_id = w.id"
        " WHERE w.status = 'active' AND w.pid = ANY(%s)",
        (pids,),
    ).fetchone()
    return int(row[0]) if row else 0


def start_fleet(fleet: Fleet, wanted: int, batch: int, fleet_db: psycopg.Connection[Any]) -> str:
    """Start up to ``wanted`` workers, ``batch`` at a time, each batch idle before the next.

    Returns why it stopped short, or "" when all were started.
    """
    per_worker = 0.0
    while len(fleet.workers) < wanted:
        free = psutil.virtual_memory().available
        n = min(batch, wanted - len(fleet.workers))
        if per_worker and free - n * per_worker < MEMORY_RESERVE:
            n = max(0, int((free - MEMORY_RESERVE) / per_worker))
            if n == 0:
                return (
                    f"stopped at {len(fleet.workers)} workers: {free / 2**30:.1f} GB of memory left, "
                    f"a worker takes ~{per_worker / 2**20:.0f} MB, "
                    f"and {MEMORY_RESERVE / 2**30:.0f} GB is kept free"
                )
        for _ in range(n):
            fleet.start()
        pids = [w.pid for w in fleet.workers]

        def all_idle(pids: list[int] = pids) -> bool:
            fleet.check_alive()
            return idle_workers(fleet_db, pids) == len(pids)

        wait_for(f"{len(pids)} workers to be idle", all_idle, timeout=300, interval=0.2)
        per_worker = fleet.rss_bytes() / len(fleet.workers)
        print(
            f"  {len(fleet.workers)} workers idle; {per_worker / 2**20:.0f} MB RSS each, "
            f"{psutil.virtual_memory().available / 2**30:.1f} GB of memory left",
            flush=True,
        )
    return ""


def measure(
    fleet: Fleet,
    postmaster: psutil.Process,
    admin: psycopg.Connection[Any],
    fleet_db: psycopg.Connection[Any],
    proxy: WireCounter | None,
    window: float,
    producer: Producer | None = None,
) -> dict[str, Any]:
    conns_before = connections(admin)
    reset_statements(fleet_db)
    passes0 = reaper_passes(fleet_db)
    busy_before = psutil.cpu_times()
    # Each reading with its own time: reading ~700 processes' CPU times takes a while.
    (db0, tdb0), (w0, tw0) = _timed(lambda: server_cpu_seconds(postmaster)), _timed(fleet.cpu_seconds)
    x0, at0 = transactions(admin)
    t0 = time.monotonic()
    sent0 = producer.sent if producer else 0
    time.sleep(window)
    t1 = time.monotonic()
    sent1 = producer.sent if producer else 0
    x1, at1 = transactions(admin)
    stats = statements(fleet_db)
    passes1 = reaper_passes(fleet_db)
    (db1, tdb1), (w1, tw1) = _timed(lambda: server_cpu_seconds(postmaster)), _timed(fleet.cpu_seconds)
    busy_after = psutil.cpu_times()
    fleet.check_alive()
    conns_after = connections(admin)
    backends, uss = backend_memory(admin)
    elapsed = t1 - t0
    result: dict[str, Any] = {
        "workers": len(fleet.workers),
        "window_s": round(elapsed, 2),
        "db_cpu_s": round(db1 - db0, 3),
        "db_cpu_pct_of_one_core": round(100 * (db1 - db0) / (tdb1 - tdb0), 2),
        "transactions": x1 - x0,
        "transactions_per_s": round((x1 - x0) / (at1 - at0), 2),
        "workers_cpu_pct_of_one_core": round(100 * (w1 - w0) / (tw1 - tw0), 2),
        "machine_cpu_busy_pct": round(100 * _busy_fraction(busy_before, busy_after), 1),
        "connections_before": conns_before,
        "connections_after": conns_after,
        "connections": sum(conns_after.values()),
        "backend_uss_mb": round(uss / 2**20, 1),
        "backend_uss_mb_each": round(uss / 2**20 / max(1, backends), 2),
        "statements": stats["calls"],
        "statements_per_s": round(stats["calls"] / elapsed, 2),
        "statements_exec_ms": stats["exec_ms"],
        "statements_top_by_exec_time": stats["top_by_exec_time"],
        "reaper_passes": None if passes0 is None or passes1 is None else passes1 - passes0,
        "tasks_sent": sent1 - sent0 if producer else None,
    }
    if proxy is not None:
        trips = proxy.round_trips(t0, t1)
        by_kind = Counter(t.application_name or "-" for t in trips)
        result["round_trips"] = len(trips)
        result["round_trips_per_s"] = round(len(trips) / elapsed, 2)
        result["round_trips_by_connection_kind"] = dict(by_kind.most_common())
        result["round_trips_by_statement"] = dict(
            Counter(f"{t.application_name or '-'}: {t.label}" for t in trips).most_common(25)
        )
    return result


def _timed(read: Callable[[], float]) -> tuple[float, float]:
    """The value, and the monotonic time in the middle of reading it."""
    start = time.monotonic()
    value = read()
    return value, (start + time.monotonic()) / 2


def _busy_fraction(before: Any, after: Any) -> float:
    total = sum(after) - sum(before)
    idle = (after.idle + after.iowait) - (before.idle + before.iowait)
    return (total - idle) / total if total > 0 else 0.0


def report(r: dict[str, Any], info: dict[str, Any], label: str = "idle") -> str:
    n = r["workers"]
    lines = [
        f"{n} {label} workers (--processes 1, default settings), {r['window_s']:.1f} s window; "
        f"PostgreSQL {info['postgres']} (embedded, max_connections {info['max_connections']}); "
        f"{info['cpus']} CPUs; the whole machine was {r['machine_cpu_busy_pct']:.0f}% busy meanwhile",
        "",
        f"| figure | fleet of {n} | per worker |",
        "|---|---|---|",
    ]
    if "round_trips_per_s" in r:
        lines.append(f"| round trips/s | {r['round_trips_per_s']:.1f} | {r['round_trips_per_s'] / n:.3f} |")
        for kind, count in r["round_trips_by_connection_kind"].items():
            per_s = count / r["window_s"]
            lines.append(f"| &nbsp; of which `{kind}` | {per_s:.1f} | {per_s / n:.3f} |")
    lines += [
        f"| transactions/s | {r['transactions_per_s']:.1f} | {r['transactions_per_s'] / n:.3f} |",
        f"| statements/s (pg_stat_statements) | {r['statements_per_s']:.1f} | "
        f"{r['statements_per_s'] / n:.3f} |",
        f"| statements' execution time, ms/s | {r['statements_exec_ms'] / r['window_s']:.2f} | "
        f"{r['statements_exec_ms'] / r['window_s'] / n:.4f} |",
        f"| database server CPU, % of one core | {r['db_cpu_pct_of_one_core']:.1f} % | "
        f"{r['db_cpu_pct_of_one_core'] / n:.3f} % |",
        f"| connections | {r['connections']} | {r['connections'] / n:.2f} |",
        f"| their server processes' own memory (USS) | {r['backend_uss_mb']:.0f} MB | "
        f"{r['backend_uss_mb'] / n:.1f} MB ({r['backend_uss_mb_each']:.1f} MB per connection) |",
        f"| workers' own CPU, % of one core (context) | {r['workers_cpu_pct_of_one_core']:.1f} % | "
        f"{r['workers_cpu_pct_of_one_core'] / n:.3f} % |",
        "",
        "connections by application_name: "
        + ", ".join(f"{k} {v}" for k, v in r["connections_after"].items()),
    ]
    if r.get("reaper_passes") is not None:
        lines.append(f"reaper passes in the window (tether_reaper): {r['reaper_passes']}")
    if r.get("tasks_sent") is not None:
        lines.append(f"tasks sent in the window: {r['tasks_sent']} ({r['tasks_sent'] / r['window_s']:.1f}/s)")
    lines.append("statements by execution time: ")
    lines += [
        f"  {t['exec_ms']:9.1f} ms {t['calls']:7d} calls  {t['statement']}"
        for t in r["statements_top_by_exec_time"]
    ]
    return "\n".join(lines)


def _terminate(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwind through the finally: stop everything


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    base = Path(tempfile.mkdtemp(prefix="tether-fleet-", dir="/tmp"))
    base.chmod(0o755)  # as root the server runs as its own system user, who must get in
    log_dir = base / "logs"
    log_dir.mkdir()
    server: EmbeddedServer | None = None
    proxy: WireCounter | None = None
    fleet: Fleet | None = None
    failed = True
    try:
        server = EmbeddedServer.start(base / "data")
        max_connections = max(200, CONNECTIONS_PER_WORKER * args.workers + 50)
        with psycopg.connect(server.url(), autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET max_connections = {max_connections}")
            conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        server.restart()  # max_connections takes a restart
        url = server.create_database(DATABASE)
        with psycopg.connect(url, autocommit=True) as conn:
            migrate(conn)
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        if not args.no_proxy:
            proxy = WireCounter(url).start()
        fleet = Fleet(proxy.url if proxy else url, log_dir)
        with psycopg.connect(server.url(), autocommit=True) as admin:
            row = admin.execute(
                "SELECT current_setting('server_version'), current_setting('max_connections')"
            ).fetchone()
            assert row is not None
            info = {"postgres": row[0], "max_connections": int(row[1]), "cpus": os.cpu_count()}
            print(f"PostgreSQL {info['postgres']} in {base}; starting {args.workers} workers", flush=True)
            started = time.monotonic()
            with psycopg.connect(url, autocommit=True) as fleet_db:  # closed before the window
                short = start_fleet(fleet, args.workers, args.batch, fleet_db)
            if short:
                print(short, flush=True)
            print(
                f"{len(fleet.workers)} workers idle after {time.monotonic() - started:.0f} s; "
                f"settling for {args.settle:g} s, then measuring for {args.window:g} s",
                flush=True,
            )
            time.sleep(args.settle)
            fleet.check_alive()
            postmaster = psutil.Process(server.pid)
            with psycopg.connect(url, autocommit=True) as fleet_db:
                result = measure(fleet, postmaster, admin, fleet_db, proxy, args.window)
                busy: dict[str, Any] | None = None
                if args.busy_rate:
                    producer = Producer(url, args.busy_rate).start()
                    try:
                        print(
                            f"busy: sending {args.busy_rate:g} tasks/s; settling for {args.settle:g} s",
                            flush=True,
                        )
                        time.sleep(args.settle)
                        busy = measure(fleet, postmaster, admin, fleet_db, proxy, args.window, producer)
                    finally:
                        producer.stop()
        result.update(
            info, stopped_short=short, worker_rss_mb=round(fleet.rss_bytes() / len(fleet.workers) / 2**20)
        )
        print()
        print(report(result, info))
        if busy is not None:
            busy.update(info)
            result["busy"] = busy
            print()
            print(report(busy, info, f"busy ({args.busy_rate:g} tasks/s)"))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
            print(f"\nfigures written to {args.json}")
        failed = False
    except KeyboardInterrupt as exc:
        print(f"\ninterrupted ({exc or 'Ctrl-C'}): stopping everything", file=sys.stderr)
        return 130
    finally:
        if fleet is not None:
            fleet.stop()
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()  # by its postmaster's pid
        if failed:
            print(f"worker logs kept in {log_dir}", file=sys.stderr)
            shutil.rmtree(base / "data", ignore_errors=True)
        else:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
