"""Checkpointed steps (docs/durable-steps.md): what a step costs, beside plain no-op tasks.

- steps: tasks of k no-op steps each (``stepper`` / ``astepper``: a step whose function
  returns its index) through one worker with one sync child, then one async child; in
  the same run and alternating with them, as many plain no-op tasks as there are steps
  (``noop`` / ``anoop``). Steps/s by database time (first start to last completion) and
  the transactions per step: the transactions (pg_stat_database.xact_commit) the tasks of
  k steps add over as many tasks of 0 steps (the same task, the same claims and outcomes;
  a task that calls no step reads nothing), divided by the steps. Every statement a child
  runs is its own transaction (autocommit), so this counts statements too: in a sync child
  k writes (each one commit) and the one read per attempt, so 1.1 for 10 steps; in an
  async child, whose step writes are batched across its tasks, less.

``python -m bench --only steps``
"""

from __future__ import annotations

from typing import Any

from bench import async_apps
from bench.apps import make_app
from bench.async_tasks import ASYNC_APP
from bench.infra import count_by_status, wait_all_terminal
from bench.scenarios import Context, Outcome, Row

STEPS_PER_TASK = 10


def _commits(ctx: Context) -> int:
    ((n,),) = ctx.db.query("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
    return int(n)


def _drain(ctx: Context, kind: str, stepped: bool, tasks: int, k: int = STEPS_PER_TASK) -> dict[str, float]:
    """Send ``tasks`` tasks (of ``k`` steps each when ``stepped``, else no-op tasks), then start
    one worker with one child of ``kind`` and time it."""
    ctx.db.reset_tasks()
    app = async_apps.make_app(ctx.db.url) if kind == "async" else make_app(ctx.db.url)
    try:
        if stepped:
            app.tasks["astepper" if kind == "async" else "stepper"].send_many([(k,)] * tasks)
        else:
            app.tasks["anoop" if kind == "async" else "noop"].send_many([()] * tasks)
    finally:
        app.close()
    commits_before = _commits(ctx)
    reads_before, writes_before = _step_table(ctx)
    if kind == "async":
        worker = ctx.start_worker(
            processes=0,
            app_path=ASYNC_APP,
            extra_args=("--async-processes", "1", "--async-concurrency", "100"),
        )
    else:
        worker = ctx.start_worker(processes=1)
    try:
        wait_all_terminal(ctx.db, worker, timeout=900, interval=0.05)
    finally:
        worker.stop()  # waits until its sessions are gone: their statistics are flushed
    commits = _commits(ctx) - commits_before
    reads_after, writes_after = _step_table(ctx)
    ((completed, span),) = ctx.db.query(
        "SELECT count(*) FILTER (WHERE status = 'COMPLETED'),"
        " extract(epoch FROM max(completed_at) - min(started_at)) FROM tether_tasks"
    )
    if completed != tasks:
        raise RuntimeError(f"{kind}: {completed} of {tasks} tasks COMPLETED: {count_by_status(ctx.db)}")
    if stepped:
        ((stored,),) = ctx.db.query("SELECT count(*) FROM tether_task_steps")
        if stored != tasks * k:
            raise RuntimeError(f"{kind}: {stored} steps stored, expected {tasks * k}")
    units = tasks * k if stepped and k else tasks
    return {
        "per_s": units / float(span),
        "commits_per_task": commits / tasks,
        "span_s": float(span),
        # Each write's conflict check (ON CONFLICT) is an index scan too: one per row inserted.
        "reads_per_task": ((reads_after - reads_before) - (writes_after - writes_before)) / tasks,
        "writes_per_step": (writes_after - writes_before) / (tasks * k) if stepped and k else 0.0,
    }


def _step_table(ctx: Context) -> tuple[int, int]:
    """Index scans of tether_task_steps (an attempt's read, and each insert's conflict check)
    and rows inserted into it, from the server's statistics."""
    ((scans, inserted),) = ctx.db.query(
        "SELECT coalesce(idx_scan, 0), n_tup_ins FROM pg_stat_user_tables WHERE relname = 'tether_task_steps'"
    )
    return int(scans), int(inserted)


def steps(ctx: Context) -> Outcome:
    tasks = 200 if ctx.quick else 1_000  # tasks of 10 steps; as many plain tasks as steps
    rounds = 1 if ctx.quick else 3
    runs: dict[str, list[dict[str, float]]] = {}
    for _ in range(rounds):
        for kind in ("sync", "async"):
            runs.setdefault(f"{kind}_plain", []).append(_drain(ctx, kind, False, tasks * STEPS_PER_TASK))
            runs.setdefault(f"{kind}_steps", []).append(_drain(ctx, kind, True, tasks))
            runs.setdefault(f"{kind}_zero", []).append(_drain(ctx, kind, True, tasks, k=0))

    def median(key: str, field: str) -> float:
        values = sorted(r[field] for r in runs[key])
        return values[len(values) // 2]

    def per_step(kind: str) -> float:
        extra = median(f"{kind}_steps", "commits_per_task") - median(f"{kind}_zero", "commits_per_task")
        return extra / STEPS_PER_TASK

    line = (
        f"{tasks:,} tasks x {STEPS_PER_TASK} no-op steps beside {tasks * STEPS_PER_TASK:,} no-op tasks, "
        f"1 worker x 1 process, {rounds} alternating round(s), medians: sync child "
        f"{median('sync_steps', 'per_s'):,.0f} steps/s ({median('sync_plain', 'per_s'):,.0f} tasks/s), "
        f"{per_step('sync'):.2f} transactions/step, "
        f"{median('sync_steps', 'reads_per_task'):.2f} reads/attempt; async child "
        f"{median('async_steps', 'per_s'):,.0f} steps/s ({median('async_plain', 'per_s'):,.0f} tasks/s), "
        f"{per_step('async'):.2f} transactions/step, "
        f"{median('async_steps', 'reads_per_task'):.2f} reads/attempt"
    )
    rows = []
    for kind in ("sync", "async"):
        rows += [
            Row("steps", f"{kind} child: steps/s (db time, median)", median(f"{kind}_steps", "per_s"), ""),
            Row("steps", f"{kind} child: no-op tasks/s, same run", median(f"{kind}_plain", "per_s"), ""),
            Row(
                "steps",
                f"{kind} child: step reads per attempt",
                median(f"{kind}_steps", "reads_per_task"),
                "",
                "<= 1",
                median(f"{kind}_steps", "reads_per_task") <= 1,
            ),
            Row(
                "steps",
                f"{kind} child: rows written per step",
                median(f"{kind}_steps", "writes_per_step"),
                "",
                "1",
                median(f"{kind}_steps", "writes_per_step") == 1,
            ),
            Row("steps", f"{kind} child: transactions per step, over 0-step tasks", per_step(kind), ""),
        ]
    return Outcome(
        line, rows, {"tasks": tasks, "steps_per_task": STEPS_PER_TASK, "rounds": rounds, "runs": runs}
    )


STEP_SCENARIOS: dict[str, Any] = {"steps": steps}
