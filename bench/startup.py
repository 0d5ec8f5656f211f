"""``startup``: how soon a new worker runs its first task, and a dead child's replacement its next.

Each round starts a worker (``python -m tether worker bench.apps:app --processes 2``) on a
queue that already holds one ``noop``, and takes, by the machine's one clock:

- ``first_task_s``: from just before the worker's process is created to the task's
  ``started_at`` (the child's start write): import, connect, register, children, claim.

Then, on that worker (its children up), a ``hold(60)`` runs on one child and a ``noop``
waits; the hold's child is killed with SIGKILL, and:

- ``replacement_s``: from the kill to the noop's ``started_at`` on the replacement child
  (the death seen, the crash recorded, a child made and ready, the task handed over).
  With ``--processes 1`` only a replacement can run the noop.

The worker runs with ``--processes 1`` for the second figure and ``--prefetch 0`` for both
(the noop must wait for a free child, not sit in a dead one's queue). A/B: ``--src PATH``
twice or more runs each tree's ``src`` (PYTHONPATH first) with this Python, interleaved
round by round; ``--env NAME=VALUE`` sets a worker setting for every variant, and
``--variant LABEL:NAME=VALUE`` makes a variant of the first tree by a setting alone.

    .venv/bin/python -m bench.startup --rounds 5 --src /work/base/src --src src
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.apps import make_app
from bench.infra import (
    DEFAULT_SERVER_URL,
    BenchDatabase,
    cache_bytecode,
    connect_dict,
    task_children,
    wait_for,
)
from tether.db.migrate import migrate

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Variant:
    label: str
    src: Path
    env: dict[str, str] = field(default_factory=dict)


def start_worker(variant: Variant, db: BenchDatabase, processes: int, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **variant.env, "TETHER_DATABASE_URL": db.url}
    env["PYTHONPATH"] = os.pathsep.join([str(variant.src), str(REPO)])
    args = ["worker", "bench.apps:app", "--processes", str(processes), "--prefetch", "0"]
    return subprocess.Popen(
        [sys.executable, "-m", "tether", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("ab"),
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def started_epoch(db: BenchDatabase, task_id: object) -> float | None:
    with connect_dict(db.url) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM started_at)::float8 AS at FROM tether_tasks WHERE id = %s", (task_id,)
        ).fetchone()
    return None if row is None or row["at"] is None else float(row["at"])


def first_task(variant: Variant, db: BenchDatabase, log: Path) -> float:
    db.reset_tasks()
    app = make_app(db.url)
    try:
        handle = app.tasks["noop"].send()
    finally:
        app.close()
    t0 = time.time()
    proc = start_worker(variant, db, 2, log)
    try:
        wait_for("the first task to start", lambda: started_epoch(db, handle.id) is not None, 60, 0.01)
        return float(started_epoch(db, handle.id) or 0.0) - t0
    finally:
        stop(proc)


def replacement(variant: Variant, db: BenchDatabase, log: Path) -> float:
    db.reset_tasks()
    proc = start_worker(variant, db, 1, log)
    app = make_app(db.url)
    try:
        hold = app.tasks["hold"].send(60.0)
        wait_for("the hold to start", lambda: started_epoch(db, hold.id) is not None, 60, 0.01)
        noop = app.tasks["noop"].send()
        (child,) = task_children(proc.pid)
        t0 = time.time()
        child.send_signal(signal.SIGKILL)
        wait_for("the noop to start", lambda: started_epoch(db, noop.id) is not None, 60, 0.005)
        return float(started_epoch(db, noop.id) or 0.0) - t0
    finally:
        app.close()
        stop(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n")[0])
    p.add_argument("--database-url", default=DEFAULT_SERVER_URL)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--src", action="append", default=[], help="a tree's src folder (repeat for A/B)")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for every variant's worker")
    p.add_argument("--variant", action="append", default=[], help="LABEL:NAME=VALUE, on the first tree")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    common = dict(item.split("=", 1) for item in args.env)
    trees = [Path(s).resolve() for s in (args.src or [str(REPO / "src")])]
    variants = [Variant(str(t), t, dict(common)) for t in trees]
    for spec in args.variant:
        label, setting = spec.split(":", 1)
        name, value = setting.split("=", 1)
        variants.append(Variant(label, trees[0], {**common, name: value}))
    cache_bytecode(*trees, REPO / "bench")
    db = BenchDatabase(args.database_url)
    db.create()
    log = Path(f"/tmp/{db.name}-workers.log")
    results: dict[str, dict[str, list[float]]] = {
        v.label: {"first_task_s": [], "replacement_s": []} for v in variants
    }
    try:
        with db.connect() as conn:
            migrate(conn)
        for _ in range(args.rounds):
            for v in variants:
                results[v.label]["first_task_s"].append(first_task(v, db, log))
                results[v.label]["replacement_s"].append(replacement(v, db, log))
    finally:
        db.drop()
    for label, figures in results.items():
        print(label)
        for name, values in figures.items():
            ms = sorted(round(x * 1000) for x in values)
            print(f"  {name}: median {statistics.median(values) * 1000:.0f} ms, all {ms}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
