"""periodic_lateness: how late a periodic task's slot is sent, with 1 and 3 workers.

Each worker runs ``bench.apps:app`` with a schedule of every second (six fields); after
3 untimed slots, the next N slots are measured. Lateness is ``sent_at - schedule_slot``
of each slot's task: both database time (the slot is the instant the expression names,
sent_at is now() of the transaction that inserted the task).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.infra import percentile
from bench.scenarios import Context, Outcome, Row

SCHEDULE = "* * * * * *"
WARM_UP_SLOTS = 3
TARGET_P99_MS = 1000.0


def periodic_lateness(ctx: Context) -> Outcome:
    slots = 10 if ctx.quick else 60
    rows: list[Row] = []
    detail: dict[str, object] = {"slots": slots, "schedule": SCHEDULE}
    parts = []
    for n_workers in (1, 3):
        late = _measure(ctx, n_workers, slots)
        p50, p99 = percentile(late, 50), percentile(late, 99)
        rows.append(Row("periodic_lateness", f"{n_workers} worker(s) p50", p50, "ms"))
        rows.append(
            Row(
                "periodic_lateness",
                f"{n_workers} worker(s) p99",
                p99,
                "ms",
                f"<= {TARGET_P99_MS:g} ms",
                p99 <= TARGET_P99_MS,
            )
        )
        detail[f"{n_workers}_workers"] = {"p50_ms": p50, "p99_ms": p99, "max_ms": late[-1]}
        parts.append(f"{n_workers} worker(s) p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {late[-1]:.1f} ms")
    return Outcome(f"{slots} slots of a seconds schedule, sent_at - slot: " + "; ".join(parts), rows, detail)


def _measure(ctx: Context, n_workers: int, slots: int) -> list[float]:
    ctx.db.reset_tasks()
    with ctx.db.connect() as conn:
        conn.execute("TRUNCATE tether_schedules")
    env = {"TETHER_BENCH_SCHEDULE": SCHEDULE}
    workers = [ctx.start_worker(processes=1, env=env, exclusive=False) for _ in range(n_workers)]
    try:
        for worker in workers:
            worker.wait_ready()
        want = WARM_UP_SLOTS + slots
        _wait(lambda: _count(ctx) >= want, timeout=want + 60)
    finally:
        for worker in workers:
            worker.stop()
    found = ctx.db.query(
        "SELECT 1000 * extract(epoch FROM sent_at - schedule_slot) FROM tether_tasks"
        " WHERE schedule_name = 'bench' ORDER BY schedule_slot OFFSET %s LIMIT %s",
        (WARM_UP_SLOTS, slots),
    )
    doubled = ctx.db.query(
        "SELECT count(*) - count(DISTINCT schedule_slot) FROM tether_tasks WHERE schedule_name = 'bench'"
    )[0][0]
    if len(found) != slots or doubled:
        raise RuntimeError(f"expected {slots} slots once each, got {len(found)} ({doubled} doubled)")
    return sorted(float(r[0]) for r in found)


def _count(ctx: Context) -> int:
    return int(ctx.db.query("SELECT count(*) FROM tether_tasks WHERE schedule_name = 'bench'")[0][0])


def _wait(done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the slots did not come within {timeout:.0f}s")
        time.sleep(0.2)


PERIODIC_SCENARIOS: dict[str, Callable[[Context], Outcome]] = {"periodic_lateness": periodic_lateness}
