"""``failover``: how long a failover interrupts tether, at default and at tight recovery settings.

A primary and a synchronous standby of Debian's PostgreSQL (tests/ha_pair.py builds them),
two workers (``--processes 2``) and a producer that sends ``hold(0.3)`` every 50 ms, all on
a multi-host URL with ``target_session_attrs=read-write``; after 5 s of that, the primary is
stopped with ``-m immediate`` and the standby promoted at once (``pg_ctl promote``). From
the stop it measures, polling the new primary every 20 ms:

- ``first_completed``: the first task completed on the new primary;
- ``in_flight_settled``: every task that was CLAIMED or RUNNING at the stop (as the new
  primary has them) ended;
- and, for the context, how long the promotion itself took.

Settings: ``default`` (tether's: 30 s heartbeats, stale thresholds of minutes, 1 s poll) and
``tight`` (1 s heartbeats, 2 s stale thresholds, 1 s check interval). Each round builds a new
pair; ``--rounds N`` (default 2) per setting, alternating.

    .venv/bin/python -m bench.failover [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from tests.ha_pair import HaPair
from tests.harness import WorkerProcess

from bench.apps import make_app
from tether.db.migrate import migrate
from tether.errors import DatabaseUnreachableError

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "tight": {
        "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
        "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
        "TETHER_CLAIMED_STALE_THRESHOLD_MS": "2000",
        "TETHER_RUNNING_STALE_THRESHOLD_MS": "2000",
        "TETHER_CHECK_INTERVAL_MS": "1000",
    },
}


def one_round(setting: str, log_dir: Path) -> dict[str, float]:
    pair = HaPair().start()
    workers: list[WorkerProcess] = []
    stop = threading.Event()
    try:
        with psycopg.connect(pair.primary.url("postgres"), autocommit=True) as c:
            c.execute("CREATE DATABASE bench")
        with psycopg.connect(pair.primary.url("bench"), autocommit=True) as c:
            migrate(c)
        url = pair.multi_host_url("bench")
        env = {"TETHER_DATABASE_URL": url, **SETTINGS[setting]}
        for i in range(2):
            w = WorkerProcess(
                "bench.apps:app",
                url,
                log_dir / f"{setting}-{i}.log",
                processes=2,
                env={**_base_env(), **env},
                stop_timeout=15.0,
                stop_must_be_graceful=False,
            )
            workers.append(w.start())
        for w in workers:
            w.wait_ready()
        app = make_app(url)

        def produce() -> None:
            while not stop.is_set():
                with contextlib.suppress(DatabaseUnreachableError):  # during the failover
                    app.tasks["hold"].send(0.3)
                stop.wait(0.05)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        time.sleep(5.0)  # a steady state of tasks in flight: nothing to wait for but time

        t0 = time.monotonic()
        pair.primary.stop_immediately()
        pair.standby.promote()
        promoted_s = time.monotonic() - t0
        new = psycopg.connect(pair.standby.url("bench"), autocommit=True)
        try:
            now = new.execute("SELECT now()").fetchone()
            assert now is not None
            in_flight = [r[0] for r in new.execute(
                "SELECT id FROM tether_tasks WHERE status IN ('CLAIMED', 'RUNNING')").fetchall()]  # fmt: skip
            first = settled = None
            deadline = t0 + 600
            while (first is None or settled is None) and time.monotonic() < deadline:
                row = new.execute(
                    "SELECT count(*) FILTER (WHERE completed_at > %s),"
                    " count(*) FILTER (WHERE id = ANY(%s) AND status IN ('CLAIMED', 'RUNNING'))"
                    " FROM tether_tasks",
                    (now[0], in_flight),
                ).fetchone()
                assert row is not None
                if first is None and row[0] > 0:
                    first = time.monotonic() - t0
                if settled is None and row[1] == 0:
                    settled = time.monotonic() - t0
                time.sleep(0.02)
        finally:
            new.close()
            stop.set()
            producer.join(timeout=10)
            app.close()
        if first is None or settled is None:
            raise RuntimeError(f"{setting}: not settled within 600 s (first {first}, settled {settled})")
        return {"promote": promoted_s, "first_completed": first, "in_flight_settled": settled,
                "in_flight": float(len(in_flight))}  # fmt: skip
    finally:
        stop.set()
        for w in workers:
            w.kill_group()
        pair.close()


def _base_env() -> dict[str, str]:
    from tests.harness import REPO

    from bench.infra import RECOVERY_ENV

    env = {k: v for k, v in os.environ.items() if k not in RECOVERY_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    found: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="tether-bench-failover-") as logs:
        for i in range(args.rounds):
            for name in SETTINGS:
                r = one_round(name, Path(logs))
                found[name].append(r)
                print(f"failover {name} round {i + 1}: promotion {r['promote']:.2f}s; first task completed "
                      f"{r['first_completed']:.2f}s, {r['in_flight']:.0f} in flight settled "
                      f"{r['in_flight_settled']:.2f}s after the stop", flush=True)  # fmt: skip
    for name, rounds in found.items():
        print(f"| failover, {name} settings | first task completed "
              f"{statistics.median(r['first_completed'] for r in rounds):.2f} s, in flight settled "
              f"{statistics.median(r['in_flight_settled'] for r in rounds):.2f} s after the stop "
              f"(median of {len(rounds)}) |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
