"""``retention_pace``: does pruning keep pace with 2,000 finished tasks/s and 200 running tasks
at 1 s heartbeats?

The write load is simulated with SQL, at the rate rows cross their retention line in that
steady state: every 100 ms a writer thread inserts what is due of 2,000 COMPLETED tasks/s
(each with its attempt row, in one statement) and 200 runner heartbeats/s, all stamped just
past their retention (``terminal_record_retention_hours``, 720 h, and
``heartbeat_retention_hours``, 24 h, tether's defaults). That is what a fleet finishing
2,000 tasks/s writes, 30 days (or 24 hours) later; the fresh rows themselves only cost
inserts. One real worker (``--processes 1``, tether's default check interval of 30 s) runs
the reaper, whose retention deletes them.

Every 10 s the run samples the rows written, the rows deleted (``n_tup_del`` of each table)
and the rows past their retention still there. The figures: rows deleted per second against
rows written per second over the run, the backlog at the end, and the longest batch the
worker logged (its retention lines: one statement, one commit, its locks held that long).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import psycopg

from bench.infra import wait_for
from bench.scenarios import Context, Outcome, Row

TASKS_PER_S = 2_000
HEARTBEATS_PER_S = 200
STEP_S = 0.1
SAMPLE_S = 10.0
# The reaper prunes once per pass: between passes (the check interval, 30 s, when nothing is
# in flight) rows past their retention wait, so the backlog is a sawtooth whose height is one
# interval of writes. Pruning keeps pace when that height does not grow over the run.
MAX_GROWTH = 1.25  # largest backlog in the last third of the run / in the first third

INSERT_FINISHED = """
WITH t AS (
    INSERT INTO tether_tasks (id, name, queue, status, args, kwargs, result, attempt, sent_at, run_at,
                              enqueued_at, claimed_at, started_at, completed_at, updated_at,
                              claimed_by_worker_id)
    SELECT (lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::bigint), 12, '0')
            || substr(md5(random()::text || g::text), 1, 20))::uuid,
           'noop', 'default', 'COMPLETED', '[]', '{}', '{"ok": null}', 1, o.at, o.at, o.at, o.at,
           o.at, o.at, o.at, 'bench-worker'
    FROM generate_series(1, %(n)s) g,
         (SELECT now() - interval '720 hours' - interval '1 second' AS at) o
    RETURNING id, started_at
)
INSERT INTO tether_task_attempts (task_id, attempt, worker_id, hostname, pid, started_at, finished_at,
                                  outcome)
SELECT id, 1, 'bench-worker', 'bench', 1, started_at, started_at, 'COMPLETED' FROM t
"""
INSERT_HEARTBEATS = """
INSERT INTO tether_heartbeats (task_id, sender_id, role, sent_at, hostname, pid)
SELECT gen_random_uuid(), 'bench-worker', 'runner', now() - interval '24 hours' - interval '1 second',
       'bench', 1
FROM generate_series(1, %(n)s)
"""
DELETED = (
    "SELECT relname, n_tup_del FROM pg_stat_user_tables"
    " WHERE relname IN ('tether_tasks', 'tether_task_attempts', 'tether_heartbeats')"
)
BACKLOG = (
    "SELECT (SELECT count(*) FROM tether_tasks WHERE status = 'COMPLETED'"
    "        AND updated_at < now() - interval '720 hours'),"
    " (SELECT count(*) FROM tether_heartbeats WHERE sent_at < now() - interval '24 hours')"
)
LONGEST = re.compile(r"retention: pruned .* in (\d+) batch\(es\), the longest (\d+) ms")


class Writer(threading.Thread):
    """Inserts, every STEP_S, what is due at the target rates since it started."""

    def __init__(self, url: str) -> None:
        super().__init__(name="retention-writer", daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.tasks = 0
        self.heartbeats = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                t0 = time.monotonic()
                while not self.stop.is_set():
                    elapsed = time.monotonic() - t0
                    due_tasks = min(int(elapsed * TASKS_PER_S) - self.tasks, 10 * TASKS_PER_S)
                    due_beats = int(elapsed * HEARTBEATS_PER_S) - self.heartbeats
                    if due_tasks > 0:
                        conn.execute(INSERT_FINISHED, {"n": due_tasks})
                        self.tasks += due_tasks
                    if due_beats > 0:
                        conn.execute(INSERT_HEARTBEATS, {"n": due_beats})
                        self.heartbeats += due_beats
                    self.stop.wait(STEP_S)
        except BaseException as exc:  # reported by the scenario
            self.error = exc


def retention_pace(ctx: Context) -> Outcome:
    seconds = 60.0 if ctx.quick else 600.0
    ctx.db.reset_tasks()
    worker = ctx.start_worker(processes=1)
    writer = Writer(ctx.db.url)
    samples: list[dict[str, Any]] = []
    try:
        worker.wait_ready()
        deleted0 = _deleted(ctx)
        writer.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            time.sleep(SAMPLE_S)
            worker.check_alive()
            if writer.error is not None:
                raise RuntimeError(f"the writer failed: {writer.error}")
            samples.append(_sample(ctx, writer, deleted0, time.monotonic() - t0))
            print(f"retention_pace         {_line(samples[-1])}", flush=True)
        writer.stop.set()
        writer.join(30)
        # Once the load stops, everything past its retention goes within one more check interval.
        wait_for("the backlog to be pruned", lambda: _backlog(ctx) == (0, 0), timeout=60, interval=1.0)
        final = _sample(ctx, writer, deleted0, time.monotonic() - t0)
    finally:
        writer.stop.set()
        log = worker.log()
        worker.stop()
    last = samples[-1]
    pace = {
        table: last["deleted"][table] / max(1, last["written"][table])
        for table in ("tether_tasks", "tether_task_attempts", "tether_heartbeats")
    }
    batches = [(int(b), int(ms)) for b, ms in LONGEST.findall(log)]
    longest = max((ms for _, ms in batches), default=0)
    worst_backlog = max(s["backlog"][0] for s in samples)
    third = max(1, len(samples) // 3)
    growth = max(s["backlog"][0] for s in samples[-third:]) / max(
        1, max(s["backlog"][0] for s in samples[:third])
    )
    rates = _rates(samples)
    return Outcome(
        f"{seconds:.0f}s of {TASKS_PER_S:,} finished tasks/s (+ attempts) and {HEARTBEATS_PER_S} heartbeats/s"
        f" written past retention: deleted/written at the end tasks {pace['tether_tasks']:.3f},"
        f" attempts {pace['tether_task_attempts']:.3f}, heartbeats {pace['tether_heartbeats']:.3f};"
        f" largest backlog seen {worst_backlog:,} tasks (last third / first third {growth:.2f});"
        f" tasks deleted/s over the run after the first pass {rates['deleted']:,.0f} against"
        f" {rates['written']:,.0f} written/s; the longest batch {longest} ms; nothing left"
        f" {final['t']:.0f}s after the start",
        [
            Row(
                "retention_pace",
                "largest backlog, last third / first third",
                growth,
                "x",
                f"<= {MAX_GROWTH}",
                growth <= MAX_GROWTH,
            ),
            Row("retention_pace", "tasks deleted / written at the end of the load", pace["tether_tasks"], ""),
            Row("retention_pace", "heartbeats deleted / written", pace["tether_heartbeats"], ""),
            Row("retention_pace", "largest backlog of prunable tasks", worst_backlog, "rows"),
            Row("retention_pace", "longest batch", longest, "ms"),
        ],
        {
            "seconds": seconds,
            "samples": samples,
            "final": final,
            "batches_logged": batches,
            "growth": growth,
            "rates": rates,
        },
    )


def _rates(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Tasks written and deleted per second between the first sample that saw a deletion and the last."""
    first = next((s for s in samples if s["deleted"]["tether_tasks"]), samples[0])
    last = samples[-1]
    span = max(1e-9, last["t"] - first["t"])
    return {
        "written": (last["written"]["tether_tasks"] - first["written"]["tether_tasks"]) / span,
        "deleted": (last["deleted"]["tether_tasks"] - first["deleted"]["tether_tasks"]) / span,
    }


def _deleted(ctx: Context) -> dict[str, int]:
    return {name: int(n) for name, n in ctx.db.query(DELETED)}


def _backlog(ctx: Context) -> tuple[int, int]:
    ((tasks, beats),) = ctx.db.query(BACKLOG)
    return int(tasks), int(beats)


def _sample(ctx: Context, writer: Writer, deleted0: dict[str, int], t: float) -> dict[str, Any]:
    now = _deleted(ctx)
    return {
        "t": t,
        "written": {
            "tether_tasks": writer.tasks,
            "tether_task_attempts": writer.tasks,
            "tether_heartbeats": writer.heartbeats,
        },
        "deleted": {table: now.get(table, 0) - deleted0.get(table, 0) for table in now},
        "backlog": _backlog(ctx),
    }


def _line(s: dict[str, Any]) -> str:
    w, d = s["written"], s["deleted"]
    return (
        f"t={s['t']:.0f}s tasks written {w['tether_tasks']:,} deleted {d['tether_tasks']:,};"
        f" heartbeats written {w['tether_heartbeats']:,} deleted {d['tether_heartbeats']:,};"
        f" backlog {s['backlog'][0]:,} tasks, {s['backlog'][1]:,} heartbeats"
    )


RETENTION_SCENARIOS = {"retention_pace": retention_pace}
