"""Workflows 1,000 wide: real runs, and what finishing one step reads and writes.

The first two tests run a fan-out and a fan-in of 1,000 through one real worker
(`tether worker tests.apps.flows:app --processes 2`) and check the outcome: states, rows,
values, every task run exactly once, the join only after all its dependencies.

The rest prove structurally that advancing a workflow never rescans it: the cost of one
completion must not depend on the workflow's width. How long it takes is measured by the
benchmark (`python -m bench --only workflows`), never here. What is counted instead is what
PostgreSQL itself counts for the two tables a completion touches, in
``pg_stat_xact_user_tables``: scans, rows read (``seq_tup_read`` + ``idx_tup_fetch``: live
rows returned by sequential, index and bitmap scans) and rows written. The counters are read
before and after ``engine.advance`` inside one outer transaction (advance's own transaction
becomes a savepoint), which is then rolled back, so every measurement starts from the same rows.

The planner is part of what is measured, so its inputs are pinned (autovacuum is off for the
two tables while a state is measured, so the statistics stay the ones described):
- Statistics, three states. ``stats-include-them``: 150 finished background workflows (as a
  live database has) and the measured ones, then ANALYZE, which reads every row (the tables
  are far below its 30,000-row sample): the planner knows each workflow's size.
  ``stats-predate-them``: the same, but ANALYZE ran before the measured workflows were
  started (a wide workflow started since autovacuum last looked): the planner believes a
  workflow has a handful of steps. ``stats-never-taken``: a database of its own, created for
  the state (a fresh install): only the measured workflows, never analysed. (This run's
  shared database cannot be made statistics-free again: TRUNCATE keeps pg_statistic.)
  Without pinned statistics the plans would depend on what earlier tests left in
  pg_statistic and on when autovacuum ran. With only the measured workflows in an analysed
  table, a 1,000-wide workflow is a third of it and the planner picks sequential scans for
  it (seen); with the background it does not, and ``seq_scan == 0`` is asserted besides the
  rows read.
- Plan kind: a worker's pooled connections run the same statements thousands of times;
  psycopg prepares a statement after 5 executions and PostgreSQL may then switch to a generic
  plan, made without the parameter values (plan_cache_mode=auto). Each case runs once with
  plan_cache_mode=force_custom_plan and once with force_generic_plan: both occur in production,
  so both must stay flat.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import connect, ensure_ledger, load_app_module, runs, workflow_row
from tests.apps.support import workflow_steps as steps
from tests.conftest import WorkerFactory, _with_dbname, clean_tables
from tether import WorkflowStatus
from tether.db.migrate import migrate
from tether.ids import new_task_id
from tether.workflow import engine

APP = "tests.apps.flows:app"
WIDTH = 1_000
WAIT = 120.0
TABLES = ("tether_workflow_tasks", "tether_tasks")
COUNTERS = ("seq_scan", "seq_tup_read", "idx_scan", "idx_tup_fetch", "n_tup_ins", "n_tup_upd")


@pytest.fixture(scope="module")
def conn(database_url: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    with connect(database_url) as c:
        clean_tables(c)
        ensure_ledger(c)
        yield c


@pytest.fixture(scope="module")
def flows(database_url: str, conn: psycopg.Connection[Any]) -> ModuleType:
    return load_app_module("flows", database_url)


def ledger_counts(conn: psycopg.Connection[Any], prefix: str) -> dict[str, int]:
    """Runs per token for the tokens ``prefix:...`` (one token per step)."""
    rows = conn.execute(
        "SELECT token, count(*) AS n FROM tether_test_ledger WHERE token LIKE %s GROUP BY token",
        (prefix + ":%",),
    ).fetchall()
    return {r["token"]: int(r["n"]) for r in rows}


def assert_all_ran_once(rows: dict[str, dict[str, Any]]) -> None:
    not_done = {n: (r["status"], r["task_status"]) for n, r in rows.items() if r["status"] != "COMPLETED"}
    assert not not_done, f"{len(not_done)} steps not COMPLETED, e.g. {list(not_done.items())[:5]}"
    odd = {n: (r["task_status"], r["attempt"], r["attempts"]) for n, r in rows.items()}
    odd = {n: v for n, v in odd.items() if v != ("COMPLETED", 1, 1)}
    assert not odd, f"tasks not run exactly once: {list(odd.items())[:5]}"


# -- 1,000 wide, through a real worker ----------------------------------------------------------


def test_fan_out_of_1000(flows: ModuleType, workers: WorkerFactory, conn: Any) -> None:
    tok = uuid.uuid4().hex
    root = flows.number.node(args=(3,), kwargs={"token": f"{tok}:root"}, name="root")
    leaves = [
        flows.add.node(kwargs={"b": i, "token": f"{tok}:{i}"}, args_from={"a": root}, name=f"leaf{i}")
        for i in range(WIDTH)
    ]
    workflow = flows.app.workflow("fan-out-1000", [root, *leaves])
    worker = workers.start(APP, "--processes", "2")

    handle = workflow.start()
    result = handle.get(timeout=WAIT)

    assert result.is_ok, result
    assert result.ok == {f"leaf{i}": 3 + i for i in range(WIDTH)}  # every final step's value, by name
    assert handle.status() is WorkflowStatus.COMPLETED
    rows = steps(conn, handle.id)
    assert len(rows) == WIDTH + 1
    assert_all_ran_once(rows)
    assert ledger_counts(conn, tok) == {f"{tok}:root": 1, **{f"{tok}:{i}": 1 for i in range(WIDTH)}}
    root_done = rows["root"]["finished_at"]
    assert all(rows[f"leaf{i}"]["enqueued_at"] >= root_done for i in range(WIDTH))
    wf = workflow_row(conn, handle.id)
    assert (wf["status"], wf["steps_total"], wf["steps_done"], wf["steps_failed"]) == (
        "COMPLETED",
        WIDTH + 1,
        WIDTH + 1,
        0,
    )
    assert worker.stop() == 0, worker.log()


def test_fan_in_of_1000(flows: ModuleType, workers: WorkerFactory, conn: Any) -> None:
    tok = uuid.uuid4().hex
    roots = [
        flows.number.node(args=(i,), kwargs={"token": f"{tok}:{i}"}, name=f"root{i}") for i in range(WIDTH)
    ]
    join = flows.number.node(args=(-1,), kwargs={"token": f"{tok}:join"}, after=roots, name="join")
    workflow = flows.app.workflow("fan-in-1000", [*roots, join])
    worker = workers.start(APP, "--processes", "2")

    handle = workflow.start()
    result = handle.get(timeout=WAIT)

    assert result.is_ok, result
    assert result.ok == -1  # the only final step's value
    rows = steps(conn, handle.id)
    assert len(rows) == WIDTH + 1
    assert_all_ran_once(rows)
    assert runs(conn, f"{tok}:join") == 1
    assert ledger_counts(conn, tok) == {f"{tok}:join": 1, **{f"{tok}:{i}": 1 for i in range(WIDTH)}}
    # the join became a task only once every root had finished, and started after the last one
    last_root = max(rows[f"root{i}"]["finished_at"] for i in range(WIDTH))
    assert rows["join"]["enqueued_at"] >= last_root
    assert rows["join"]["started_at"] >= max(rows[f"root{i}"]["completed_at"] for i in range(WIDTH))
    assert rows["join"]["waiting_on"] == 0 and rows["join"]["deps_ok"] == WIDTH
    wf = workflow_row(conn, handle.id)
    assert (wf["status"], wf["steps_done"], wf["steps_failed"]) == ("COMPLETED", WIDTH + 1, 0)
    assert worker.stop() == 0, worker.log()


# -- what one completion costs -------------------------------------------------------------------


@dataclass
class Cost:
    """What one engine.advance did, and PostgreSQL's counters for it, per table."""

    advanced: engine.Advanced
    counters: dict[str, dict[str, int]]

    def read(self) -> int:
        return sum(c["seq_tup_read"] + c["idx_tup_fetch"] for c in self.counters.values())

    def written(self) -> dict[str, tuple[int, int]]:
        """(rows inserted, rows updated) per table."""
        return {t: (c["n_tup_ins"], c["n_tup_upd"]) for t, c in self.counters.items()}

    def seq_scans(self) -> int:
        return sum(c["seq_scan"] for c in self.counters.values())


def _counters(conn: psycopg.Connection[Any]) -> dict[str, dict[str, int]]:
    rows = conn.execute(
        "SELECT relname, " + ", ".join(COUNTERS) + " FROM pg_stat_xact_user_tables"
        " WHERE schemaname = current_schema() AND relname = ANY(%s)",
        (list(TABLES),),
    ).fetchall()
    found = {r["relname"]: {c: int(r[c]) for c in COUNTERS} for r in rows}
    assert set(found) == set(TABLES), found
    return found


def _complete(conn: psycopg.Connection[Any], workflow_id: Any, names: Sequence[str]) -> list[Any]:
    """Mark the tasks of these steps COMPLETED by SQL, as a worker would have; their ids."""
    rows = conn.execute(
        "UPDATE tether_tasks t SET status = 'COMPLETED', result = '{\"ok\": 1}', completed_at = now()"
        " FROM tether_workflow_tasks s"
        " WHERE s.workflow_id = %s AND s.node_name = ANY(%s) AND t.id = s.task_id AND t.status = 'PENDING'"
        " RETURNING t.id",
        (workflow_id, list(names)),
    ).fetchall()
    assert len(rows) == len(names), f"expected {len(names)} pending tasks for {names[:3]}..., got {len(rows)}"
    return [r["id"] for r in rows]


def measure(
    conn: psycopg.Connection[Any],
    workflow_id: Any,
    names: Sequence[str],
    *,
    plans: str,
    before: Sequence[Sequence[str]] = (),
) -> Cost:
    """Complete the steps ``names`` and advance once; counted, then all rolled back.

    ``before``: batches of steps completed and advanced first (not counted), e.g. every
    other root of a fan-in before its last one.
    """
    with conn.transaction():
        conn.execute(f"SET LOCAL plan_cache_mode = force_{plans}_plan")
        for batch in before:
            engine.advance(conn, workflow_id, _complete(conn, workflow_id, batch))
        task_ids = _complete(conn, workflow_id, names)
        start = _counters(conn)
        advanced = engine.advance(conn, workflow_id, task_ids)
        end = _counters(conn)
        raise psycopg.Rollback()  # leaves the workflow as it was for the next measurement
    delta = {t: {c: end[t][c] - start[t][c] for c in COUNTERS} for t in TABLES}
    return Cost(advanced, delta)


def _finish(conn: psycopg.Connection[Any], workflow_id: Any) -> None:
    """Run a workflow to its end by completing its enqueued steps' tasks by SQL."""
    while True:
        enqueued = conn.execute(
            "SELECT node_name FROM tether_workflow_tasks WHERE workflow_id = %s AND status = 'ENQUEUED'",
            (workflow_id,),
        ).fetchall()
        if not enqueued:
            return
        engine.advance(conn, workflow_id, _complete(conn, workflow_id, [r["node_name"] for r in enqueued]))


# (finished background workflows, ANALYZE after the measured workflows exist?) per statistics
# state; None: no ANALYZE at all, in a database of its own (CREATE DATABASE): TRUNCATE keeps
# statistics, so this run's shared database cannot be made to have none again. Before the
# advance looked steps up by task id alone, the last two states read the whole workflow per
# step (seen: 2,004 rows for a fan-in leaf at width 1,000 against 24 at width 10).
STATS = {
    "stats-include-them": (150, True),
    "stats-predate-them": (150, False),
    "stats-never-taken": (0, None),
}


@dataclass
class Shapes:
    """The measured workflows' ids by (shape, width), and the connection to their database."""

    conn: psycopg.Connection[Any]
    ids: dict[tuple[str, int], Any]

    def __getitem__(self, key: tuple[str, int]) -> Any:
        return self.ids[key]


@pytest.fixture(scope="class", params=list(STATS))
def shapes(
    request: pytest.FixtureRequest, flows: ModuleType, conn: psycopg.Connection[Any], server_url: str
) -> Iterator[Shapes]:
    """Workflows of each shape at widths 10 and 1,000, nothing run, in a pinned statistics state.

    stats-include-them: 150 finished background workflows, then the measured ones, then ANALYZE.
    stats-predate-them: 150 finished background workflows, ANALYZE, then the measured ones.
    stats-never-taken: a new database (a fresh install): the measured workflows only, never
    analysed (autovacuum off from the start).
    """
    background, analyse_after = STATS[request.param]
    fresh_name = None
    db = conn
    if analyse_after is None:
        fresh_name = f"tether_test_fresh_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(server_url, autocommit=True) as server:
            server.execute(f'CREATE DATABASE "{fresh_name}"')
        db = connect(_with_dbname(server_url, fresh_name))
        migrate(db)
    try:
        clean_tables(db)
        for table in TABLES:
            db.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        try:
            yield Shapes(db, _build_shapes(flows, db, background, analyse_after))
        finally:
            for table in TABLES:
                db.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")
            clean_tables(db)
    finally:
        if fresh_name is not None:
            db.close()
            with psycopg.connect(server_url, autocommit=True) as server:
                server.execute(f'DROP DATABASE IF EXISTS "{fresh_name}" WITH (FORCE)')


def _build_shapes(
    flows: ModuleType, db: psycopg.Connection[Any], background: int, analyse_after: bool | None
) -> dict[tuple[str, int], Any]:
    """Written through the engine on ``db`` (the app itself is bound to this run's database)."""
    step = flows.number.with_options(queue="other")  # nobody serves `other` here
    add = flows.add.with_options(queue="other")

    def start(workflow: Any) -> Any:
        workflow_id = new_task_id()
        engine.start(db, *workflow.rows(workflow_id))
        return workflow_id

    for _ in range(background):
        root = step.node(args=(1,), name="root")
        _finish(
            db,
            start(
                flows.app.workflow("background", [root, *(add.node(args_from={"a": root}) for _ in range(3))])
            ),
        )

    def fan_in(width: int) -> Any:
        roots = [step.node(args=(i,), name=f"r{i}") for i in range(width)]
        return flows.app.workflow(
            f"fan-in-{width}", [*roots, step.node(args=(-1,), after=roots, name="join")]
        )

    def fan_out(width: int) -> Any:
        root = step.node(args=(1,), name="root")
        leaves = [add.node(kwargs={"b": i}, args_from={"a": root}, name=f"l{i}") for i in range(width)]
        return flows.app.workflow(f"fan-out-{width}", [root, *leaves])

    def ten_dependents(width: int) -> Any:
        """Step `a` feeds 10 steps; beside it, `b` feeds ``width`` others: only the width differs."""
        a, b = step.node(args=(1,), name="a"), step.node(args=(2,), name="b")
        mine = [add.node(args_from={"a": a}, name=f"a{i}") for i in range(10)]
        others = [add.node(args_from={"a": b}, name=f"b{i}") for i in range(width)]
        return flows.app.workflow(f"ten-of-{width}", [a, *mine, b, *others])

    def analyse() -> None:
        for table in TABLES:
            db.execute(f"ANALYZE {table}")

    if analyse_after is False:
        analyse()
    made = {}
    for width in (10, WIDTH):
        for kind, build in (("fan_in", fan_in), ("fan_out", fan_out), ("ten_dependents", ten_dependents)):
            made[kind, width] = start(build(width))
    if analyse_after:
        analyse()
    return made


def not_wider(costs: dict[int, Cost]) -> bool:
    """A workflow 100 times wider costs at most twice the rows read (index probes can read a
    few extra entries), the same scans and writes: a rescan would read ~1,000 more rows."""
    small, wide = costs[10], costs[WIDTH]
    return wide.read() <= 2 * small.read() and wide.written() == small.written()


def _both(costs: dict[int, Cost]) -> str:
    return "\n".join(
        f"  width {w}: {c.advanced}, read {c.read()} rows, {c.counters}" for w, c in costs.items()
    )


@pytest.mark.parametrize("plans", ["custom", "generic"])
class TestOneCompletionDoesNotRescan:
    def test_a_fan_in_leaf(self, shapes: Shapes, plans: str) -> None:
        costs = {w: measure(shapes.conn, shapes["fan_in", w], ["r3"], plans=plans) for w in (10, WIDTH)}
        for cost in costs.values():
            assert (cost.advanced.settled, cost.advanced.enqueued, cost.advanced.status) == (
                [3],
                0,
                "RUNNING",
            )
            # the leaf settled, the join counted down: nothing else is written
            assert cost.written() == {"tether_workflow_tasks": (0, 2), "tether_tasks": (0, 0)}, _both(costs)
            assert cost.seq_scans() == 0, _both(costs)
        assert not_wider(costs), _both(costs)

    def test_the_fan_in_leaf_that_releases_the_join(self, shapes: Shapes, plans: str) -> None:
        costs = {
            w: measure(
                shapes.conn,
                shapes["fan_in", w],
                [f"r{w - 1}"],
                plans=plans,
                before=[[f"r{i}" for i in range(w - 1)]],
            )
            for w in (10, WIDTH)
        }
        for w, cost in costs.items():
            assert (cost.advanced.settled, cost.advanced.enqueued) == ([w - 1], 1)
            # leaf settled; join counted down to READY, then ENQUEUED; its task inserted
            assert cost.written() == {"tether_workflow_tasks": (0, 3), "tether_tasks": (1, 0)}, _both(costs)
            assert cost.seq_scans() == 0, _both(costs)
        assert not_wider(costs), _both(costs)

    def test_a_fan_out_leaf(self, shapes: Shapes, plans: str) -> None:
        costs = {
            w: measure(shapes.conn, shapes["fan_out", w], ["l5"], plans=plans, before=[["root"]])
            for w in (10, WIDTH)
        }
        for cost in costs.values():
            assert (cost.advanced.settled, cost.advanced.enqueued) == ([6], 0)
            assert cost.written() == {"tether_workflow_tasks": (0, 1), "tether_tasks": (0, 0)}, _both(costs)
            assert cost.seq_scans() == 0, _both(costs)
        assert not_wider(costs), _both(costs)

    def test_a_fan_out_root_costs_its_out_degree(self, shapes: Shapes, plans: str) -> None:
        """Finishing the root enqueues every leaf: the work is the out-degree, and no more per leaf."""
        costs = {w: measure(shapes.conn, shapes["fan_out", w], ["root"], plans=plans) for w in (10, WIDTH)}
        for w, cost in costs.items():
            assert (cost.advanced.settled, cost.advanced.enqueued) == ([0], w)
            # writes, inherent: the root settled (1), each leaf counted down to READY (w) and
            # marked ENQUEUED (w); one task row inserted per leaf (w)
            assert cost.written() == {"tether_workflow_tasks": (0, 2 * w + 1), "tether_tasks": (w, 0)}, _both(
                costs
            )
            assert cost.seq_scans() == 0, _both(costs)
        # reads: a constant number of rows per leaf, so no more per leaf at 1,000 than at 10
        per_leaf = {w: cost.read() / w for w, cost in costs.items()}
        assert per_leaf[WIDTH] <= 2 * per_leaf[10], f"rows read per leaf: {per_leaf}\n{_both(costs)}"

    def test_a_step_with_ten_dependents_costs_the_same_in_a_wider_workflow(
        self, shapes: Shapes, plans: str
    ) -> None:
        costs = {
            w: measure(shapes.conn, shapes["ten_dependents", w], ["a"], plans=plans) for w in (10, WIDTH)
        }
        for cost in costs.values():
            assert (cost.advanced.settled, cost.advanced.enqueued) == ([0], 10)
            assert cost.written() == {"tether_workflow_tasks": (0, 21), "tether_tasks": (10, 0)}, _both(costs)
            assert cost.seq_scans() == 0, _both(costs)
        assert not_wider(costs), _both(costs)
