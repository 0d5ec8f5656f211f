"""Workflow scenario: what finishing one step costs as workflows get wider, and 1,000-wide runs.

The statements that advance a workflow are planned from the table statistics, so every
figure is taken in a stated statistics state:
- ``fresh``: the workflow tables have never been analysed (a new install; autovacuum may
  analyse them while the scenario runs, as it would there).
- ``stats include it``: ANALYZE ran after the measured workflows were started, so the
  planner knows how many steps each has.
- ``stats of an earlier load``: the statistics are the ones the previous state's ANALYZE
  took (about 170 workflows of widths 2 to 1,000, deleted since). In part 1 autovacuum is
  off for the workflow tables meanwhile, so they stay so: the planner has never seen the
  measured workflows and estimates each at a row or two, as in a live database for a
  workflow started after the last ANALYZE. In part 2 autovacuum runs, as in production.

Part 1, no worker: ``engine.advance`` for one completed step, timed alone. The step's task is
marked COMPLETED by SQL first (untimed), as a worker's child would have committed it; then
the advance runs on a pooled connection of the producer app, the path a worker takes
(same statements, prepared after psycopg's 5 executions). Measured at widths
10, 100 and 1,000 for a fan-in leaf (one of the roots a join waits for), a fan-out leaf (one
of the steps a root feeds with ``args_from``) and a fan-out root (it enqueues all its leaves).
Flat means: for a leaf, the median at 1,000 within 1.5x of the median at 10; for a root,
whose work is one task per leaf, what each further leaf adds between widths 100 and 1,000
within 1.5x of what it adds between 10 and 100 (linear in its out-degree, no more).

Part 2, one worker ``--processes 2``: wall time of a fan-out of 1,000 (root -> 1,000 leaves)
and a fan-in of 1,000 (1,000 roots -> one join), from ``start()`` to the workflow COMPLETED as
``handle.get()`` sees it, and steps/s; as context, 1,001 plain tasks through the same worker.
The worker runs ``bench.apps:app``, whose tasks take no value to pass along, so these steps
wait with ``after=`` (no ``args_from``); part 1 covers the data flow.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql

from bench.apps import make_app
from bench.infra import BenchDatabase, count_by_status, percentile, wait_for
from bench.scenarios import Context, Outcome, Row
from tether import TaskError, TaskResult, Tether
from tether.broker.workflows import get_workflow
from tether.workflow import engine

WIDTHS = (10, 100, 1_000)
E2E_WIDTH = 1_000
FLAT_RATIO = 1.5
WORKFLOW_TABLES = ("tether_workflows", "tether_workflow_tasks")
KINDS = ("fan-in leaf", "fan-out leaf", "fan-out root")


def _reset(db: BenchDatabase) -> None:
    """Empty the task and workflow tables (no worker may be running)."""
    db.reset_tasks()
    with db.connect() as conn:
        conn.execute(
            sql.SQL("TRUNCATE {} CASCADE").format(sql.SQL(", ").join(map(sql.Identifier, WORKFLOW_TABLES)))
        )


def _analyze(db: BenchDatabase) -> None:
    with db.connect() as conn:
        for table in (*WORKFLOW_TABLES, "tether_tasks"):
            conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(table)))


def _value_task(app: Tether) -> Any:
    """A producer-only task with a parameter, so leaves can be fed (never run: no worker in part 1)."""

    @app.task("bench.value")
    def value(x: int = 0) -> TaskResult[int, TaskError]:
        return TaskResult(ok=x)

    return value


def _complete(conn: psycopg.Connection[Any], workflow_id: Any, names: list[str]) -> list[Any]:
    rows = conn.execute(
        "UPDATE tether_tasks t SET status = 'COMPLETED', result = '{\"ok\": 1}', completed_at = now()"
        " FROM tether_workflow_tasks s"
        " WHERE s.workflow_id = %s AND s.node_name = ANY(%s) AND t.id = s.task_id AND t.status = 'PENDING'"
        " RETURNING t.id",
        (workflow_id, names),
    ).fetchall()
    if len(rows) != len(names):
        raise RuntimeError(f"workflow {workflow_id}: {len(rows)} of {len(names)} step tasks were PENDING")
    return [r["id"] for r in rows]


@contextmanager
def _autovacuum_off(db: BenchDatabase) -> Iterator[None]:
    """Keep the statistics as they are: no autovacuum (nor its ANALYZE) on the workflow tables."""
    with db.connect() as conn:
        for table in WORKFLOW_TABLES:
            conn.execute(
                sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(sql.Identifier(table))
            )
    try:
        yield
    finally:
        with db.connect() as conn:
            for table in WORKFLOW_TABLES:
                conn.execute(
                    sql.SQL("ALTER TABLE {} RESET (autovacuum_enabled)").format(sql.Identifier(table))
                )


# -- part 1: one advance ---------------------------------------------------------------------------


def _advance_times(ctx: Context, state: str) -> tuple[list[Row], dict[str, Any], str]:
    """One advance at each width, in statistics state ``state`` ("stats include it" or "... earlier load")."""
    leaf_samples = 50 if ctx.quick else 200
    root_samples = {10: 10, 100: 10, 1_000: 3} if ctx.quick else {10: 40, 100: 40, 1_000: 10}
    include = state == "stats include it"
    _reset(ctx.db)
    with _nothing() if include else _autovacuum_off(ctx.db):
        times = _time_advances(ctx.db, leaf_samples, root_samples, analyse_first=include)
        _reset(ctx.db)

    rows: list[Row] = []
    detail: dict[str, Any] = {}
    for kind in KINDS:
        medians = {}
        for width in WIDTHS:
            ms = sorted(t * 1000 for t in times[kind, width])
            med, p95 = statistics.median(ms), percentile(ms, 95)
            medians[width] = med
            detail[f"{kind}, width {width}"] = {
                "samples": len(ms),
                "median_ms": med,
                "p95_ms": p95,
                "max_ms": ms[-1],
            }
            rows.append(
                Row("workflows", f"[{state}] {kind}, width {width:,}: median (p95 {p95:.2f} ms)", med, "ms")
            )
        if kind == "fan-out root":
            # Its work is one task per leaf: what each further leaf adds must not grow with width.
            (w0, m0), (w1, m1), (w2, m2) = medians.items()
            low, high = 1000 * (m1 - m0) / (w1 - w0), 1000 * (m2 - m1) / (w2 - w1)
            detail[kind] = {f"us_per_leaf_{w0}_to_{w1}": low, f"us_per_leaf_{w1}_to_{w2}": high}
            rows.append(Row("workflows", f"[{state}] {kind}: each further leaf, widths {w0}-{w1}", low, "us"))
            rows.append(
                Row("workflows", f"[{state}] {kind}: each further leaf, widths {w1}-{w2:,}", high, "us")
            )
            ratio, label = high / low, f"{kind}: per further leaf, {w1}-{w2:,} / {w0}-{w1}"
        else:
            ratio = medians[WIDTHS[-1]] / medians[WIDTHS[0]]
            label = f"{kind}: median at {WIDTHS[-1]:,} / at {WIDTHS[0]}"
        detail[f"{kind}, flat ratio"] = ratio
        rows.append(
            Row("workflows", f"[{state}] {label}", ratio, "x", f"<= {FLAT_RATIO:g}x", ratio <= FLAT_RATIO)
        )
    medians_text = "; ".join(
        f"{kind} " + "/".join(f"{detail[f'{kind}, width {w}']['median_ms']:.2f}" for w in WIDTHS) + " ms"
        for kind in KINDS
    )
    return (
        rows,
        detail,
        f"[{state}] median of one advance at widths {'/'.join(map(str, WIDTHS))}: {medians_text}",
    )


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _time_advances(
    db: BenchDatabase, leaf_samples: int, root_samples: dict[int, int], *, analyse_first: bool
) -> dict[tuple[str, int], list[float]]:
    app = make_app(db.url)
    value = _value_task(app)
    noop = app.tasks["noop"]

    def fan_in(width: int) -> Any:
        roots = [noop.node(name=f"r{i}") for i in range(width)]
        return app.workflow(f"fan-in-{width}", [*roots, noop.node(after=roots, name="join")]).start().id

    def fan_out(width: int) -> Any:
        root = value.node(args=(1,), name="root")
        leaves = [value.node(args_from={"x": root}, name=f"l{i}") for i in range(width)]
        return app.workflow(f"fan-out-{width}", [root, *leaves]).start().id

    # Every sample: (workflow id, steps advanced first untimed, the step timed).
    plans: dict[tuple[str, int], list[tuple[Any, list[str], str]]] = {}
    warmup: list[tuple[Any, str]] = []
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for _ in range(15):  # untimed: the connection's prepared statements and their plans
            warmup += [(fan_out(2), "root"), (fan_in(2), "r0")]
        for width in WIDTHS:
            per = width - 1  # a fan-in's last root releases the join: not a "leaf" sample
            fan_ins = [fan_in(width) for _ in range(-(-leaf_samples // per))]
            plans["fan-in leaf", width] = [(wf, [], f"r{i}") for wf in fan_ins for i in range(per)][
                :leaf_samples
            ]
            fan_outs = [fan_out(width) for _ in range(-(-leaf_samples // width))]
            plans["fan-out leaf", width] = [
                (wf, ["root"] if i == 0 else [], f"l{i}") for wf in fan_outs for i in range(width)
            ][:leaf_samples]
            plans["fan-out root", width] = [(fan_out(width), [], "root") for _ in range(root_samples[width])]
        if analyse_first:
            _analyze(db)
        times = {key: [] for key in plans}
        with app.broker.connection() as conn:
            for wf, step in warmup:
                engine.advance(conn, wf, _complete(conn, wf, [step]))
            # Widths interleaved, one sample each in turn: load from elsewhere hits them alike.
            for i in range(max(map(len, plans.values()))):
                for key, samples in plans.items():
                    if i >= len(samples):
                        continue
                    wf, before, step = samples[i]
                    if before:
                        engine.advance(conn, wf, _complete(conn, wf, before))
                    task_ids = _complete(conn, wf, [step])
                    t0 = time.perf_counter()
                    done = engine.advance(conn, wf, task_ids)
                    times[key].append(time.perf_counter() - t0)
                    expected = key[1] if key[0] == "fan-out root" else 0
                    if len(done.settled) != 1 or done.enqueued != expected:
                        raise RuntimeError(
                            f"{key}: advance did {done}, expected 1 settled, {expected} enqueued"
                        )
    finally:
        app.close()
    return times


# -- part 2: end to end --------------------------------------------------------------------------


def _run(app: Tether, build: Callable[[], Any], steps: int, timeout: float) -> dict[str, Any]:
    workflow = build()
    t0 = time.perf_counter()
    handle = workflow.start()
    result = handle.get(timeout=timeout)
    wall = time.perf_counter() - t0
    if not result.is_ok:
        raise RuntimeError(f"workflow {workflow.name} did not complete: {result.err}")
    info = app.broker.run(lambda c: get_workflow(c, handle.id))
    if info is None or info.status != "COMPLETED" or info.steps_done != steps:
        raise RuntimeError(f"workflow {workflow.name}: {info}")
    db_span = (info.finished_at - info.created_at).total_seconds()
    return {"steps": steps, "wall_s": wall, "db_s": db_span, "steps_per_s": steps / wall}


def _end_to_end(ctx: Context, state: str) -> tuple[list[Row], dict[str, Any], str]:
    """Fan-out and fan-in through one worker (autovacuum on); when fresh, also plain tasks for context."""
    width = 200 if ctx.quick else E2E_WIDTH
    steps = width + 1
    fresh = state == "fresh"
    _reset(ctx.db)
    worker = ctx.start_worker(processes=2)
    app = make_app(ctx.db.url)
    noop = app.tasks["noop"]

    def fan_out() -> Any:
        root = noop.node(name="root")
        return app.workflow(f"fan-out-{width}", [root, *(noop.node(after=[root]) for _ in range(width))])

    def fan_in() -> Any:
        roots = [noop.node() for _ in range(width)]
        return app.workflow(f"fan-in-{width}", [*roots, noop.node(after=roots, name="join")])

    def warm_up() -> Any:
        return app.workflow("warm-up", [noop.node(name="a"), noop.node(after=["a"])])

    def plain_done() -> bool:
        worker.check_alive()
        left = ctx.db.query(
            "SELECT 1 FROM tether_tasks WHERE status IN ('PENDING', 'CLAIMED', 'RUNNING') LIMIT 1"
        )
        return not left

    plain = None
    try:
        worker.wait_ready()
        for _ in range(5):  # untimed: the children's connections and prepared statements, the listener
            _run(app, warm_up, 2, 60)
        runs = {"fan-out": _run(app, fan_out, steps, 900), "fan-in": _run(app, fan_in, steps, 900)}
        if fresh:
            t0 = time.perf_counter()
            noop.send_many([()] * steps)
            wait_for("plain tasks to finish", plain_done, 600, interval=0.02)
            plain = time.perf_counter() - t0
    finally:
        app.close()
        worker.stop()
    statuses = count_by_status(ctx.db)
    if set(statuses) != {"COMPLETED"}:
        raise RuntimeError(f"expected every task COMPLETED, got {statuses}")
    _reset(ctx.db)
    rows = []
    for shape, run in runs.items():
        label = f"[{state}] {shape} {width:,}, 1 worker x 2 processes: start -> COMPLETED"
        rows.append(Row("workflows", label, run["wall_s"], "s"))
        rows.append(Row("workflows", f"[{state}] {shape} {width:,}: steps/s", run["steps_per_s"], ""))
    line = f"[{state}] " + ", ".join(
        f"{shape} {width:,}: {run['wall_s']:.2f}s ({run['steps_per_s']:,.0f} steps/s)"
        for shape, run in runs.items()
    )
    detail: dict[str, Any] = {"runs": runs}
    if plain is not None:
        rows.append(
            Row(
                "workflows", f"context: {steps:,} plain tasks, same worker: send_many -> all done", plain, "s"
            )
        )
        detail["plain_tasks"] = {"tasks": steps, "wall_s": plain, "tasks_per_s": steps / plain}
        line += f"; {steps:,} plain tasks {plain:.2f}s ({steps / plain:,.0f}/s)"
    return rows, detail, line


def workflows(ctx: Context) -> Outcome:
    rows: list[Row] = []
    detail: dict[str, Any] = {}
    lines: list[str] = []
    # In this order: the fresh run while the workflow tables have never been analysed; what
    # "stats include it" analyses is then the earlier load of the last two.
    for part, state in (
        (_end_to_end, "fresh"),
        (_advance_times, "stats include it"),
        (_advance_times, "stats of an earlier load"),
        (_end_to_end, "stats of an earlier load"),
    ):
        more_rows, more_detail, line = part(ctx, state)
        rows += more_rows
        detail[f"{part.__name__.strip('_')} [{state}]"] = more_detail
        lines.append(line)
    return Outcome(f"\n{'':<23}".join(lines), rows, detail)


WORKFLOW_SCENARIOS = {"workflows": workflows}
