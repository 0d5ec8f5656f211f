"""The workflow engine's status rules that are Python, without a database.

What is decided in Python (tether/workflow/engine.py): a waiting step's next status from
its counters (``_next_status``: WAITING, READY or SKIPPED, by join mode and run_anyway),
how a finished step moves its dependents' counters and how skips cascade (``advance`` via
``_propagate``), what an advance reports to the workflow's accounting (steps done, steps
failed), and that READY steps are enqueued only while the workflow is RUNNING.

What is decided in SQL (tether/broker/sql/workflows.sql) and so is not here: a new step's
first status (READY without dependencies, else WAITING: insert_workflow_steps), a step's
status from its task's end (settle_steps), and the workflow's own status (account_steps:
COMPLETED/FAILED once every step finished, PAUSED on a failure under on_error='pause').
The integration tests cover those.

``advance`` runs here, through the typed functions of tether/broker/workflows.py, on a
stand-in connection that answers their statements (by name) from an in-memory table of
steps, with rows of the columns each statement returns; the settled steps and the workflow
status the SQL would return are given by each test.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tether.broker.queries import _all as all_statements
from tether.workflow import engine
from tether.workflow.engine import Advanced, _next_status

STATEMENT_NAMES = {text: name for name, text in all_statements().items()}

# -- _next_status: a waiting step once some of its dependencies have ended ----------------------


@pytest.mark.parametrize(
    ("run_anyway", "waiting_on", "deps_ok", "deps_failed", "expected"),
    [
        (False, 1, 1, 0, "WAITING"),  # one of two completed
        (False, 0, 2, 0, "READY"),  # all completed
        (False, 1, 0, 1, "SKIPPED"),  # a failure skips at once, others still running
        (False, 0, 1, 1, "SKIPPED"),
        (True, 1, 0, 1, "WAITING"),  # run_anyway: waits for the others
        (True, 0, 1, 1, "READY"),
        (True, 0, 0, 2, "READY"),  # run_anyway runs even when none completed
    ],
)
def test_join_all(run_anyway: bool, waiting_on: int, deps_ok: int, deps_failed: int, expected: str) -> None:
    assert _next_status("all", run_anyway, waiting_on, deps_ok, deps_failed) == expected


@pytest.mark.parametrize(
    ("run_anyway", "waiting_on", "deps_ok", "deps_failed", "expected"),
    [
        (False, 2, 1, 0, "READY"),  # the first completion starts it
        (False, 0, 1, 2, "READY"),
        (False, 1, 0, 1, "WAITING"),  # a failure: another may still complete
        (False, 0, 0, 2, "SKIPPED"),  # none completed
        (True, 1, 0, 1, "WAITING"),
        (True, 0, 0, 2, "READY"),  # none completed, run anyway
        (True, 1, 1, 0, "READY"),
    ],
)
def test_join_any(run_anyway: bool, waiting_on: int, deps_ok: int, deps_failed: int, expected: str) -> None:
    assert _next_status("any", run_anyway, waiting_on, deps_ok, deps_failed) == expected


# -- advance on a stand-in connection -----------------------------------------------------------


@dataclass
class Step:
    node: int
    status: str
    waiting_on: int = 0
    deps_ok: int = 0
    deps_failed: int = 0
    join_mode: str = "all"
    run_anyway: bool = False
    dependents: list[str] = field(default_factory=list)


class Cursor:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def fetchone(self) -> dict[str, Any] | None:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[dict[str, Any]]:
        return self.rows

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)


class Steps:
    """A workflow's step rows in memory, keyed by task id (the step's name here).

    Answers the named statements an advance runs: settle_steps takes the outcomes a test
    gave to ``end()``; waiting_dependents and update_dependents do what their SQL does to
    the counters; account_steps records what it was told and answers ``workflow_status``.
    """

    def __init__(self, workflow_status: str = "RUNNING") -> None:
        self.steps: dict[str, Step] = {}
        self.workflow: dict[str, Any] | None = {
            "id": "wf",
            "name": "test",
            "status": "RUNNING",
            "on_error": "fail",
        }
        self.workflow_status = workflow_status  # what account_steps answers
        self.ended: dict[str, str] = {}  # task id -> the step status settle_steps gives it
        self.accounted: list[tuple[int, int]] = []  # (done, failed) of each account_steps
        self.enqueued: list[list[str]] = []  # task ids of each enqueue_steps
        self.statements: list[str] = []

    def add(
        self, name: str, after: tuple[str, ...] = (), join: str = "all", run_anyway: bool = False
    ) -> None:
        """A step; one without dependencies is already ENQUEUED (its task exists)."""
        self.steps[name] = Step(
            node=len(self.steps),
            status="WAITING" if after else "ENQUEUED",
            waiting_on=len(after),
            join_mode=join,
            run_anyway=run_anyway,
        )
        for dep in after:
            self.steps[dep].dependents.append(name)

    def end(self, **outcomes: str) -> None:
        self.ended.update(outcomes)

    def node(self, name: str) -> int:
        return self.steps[name].node

    def status(self) -> dict[str, str]:
        return {name: s.status for name, s in self.steps.items()}

    # -- the connection's surface ------------------------------------------------------------

    def transaction(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def execute(self, query: str, params: dict[str, Any] | None = None) -> Cursor:
        name = STATEMENT_NAMES[query]
        self.statements.append(name)
        return Cursor(getattr(self, name)(params or {}))

    def lock_workflow(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        return [self.workflow] if self.workflow else []

    def plan_as_lookups(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def _row(self, task_id: str) -> dict[str, Any]:
        s = self.steps[task_id]
        return {"task_id": task_id, "node": s.node, "status": s.status, "dependents": list(s.dependents)}

    def settle_steps(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        rows = []
        for task_id in params["task_ids"]:
            step = self.steps[task_id]
            if step.status == "ENQUEUED" and task_id in self.ended:
                step.status = self.ended[task_id]
                rows.append(self._row(task_id))
        return rows

    def waiting_dependents(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "task_id": t,
                "node": s.node,
                "waiting_on": s.waiting_on,
                "deps_ok": s.deps_ok,
                "deps_failed": s.deps_failed,
                "join_mode": s.join_mode,
                "run_anyway": s.run_anyway,
            }
            for t in params["task_ids"]
            if (s := self.steps[t]).status == "WAITING"
        ]

    def update_dependents(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        changes = json.loads(params["changes"])
        rows = []
        for task_id in params["task_ids"]:
            step = self.steps[task_id]
            if step.status != "WAITING":
                continue
            change = changes[task_id]
            step.waiting_on = change["waiting_on"]
            step.deps_ok = change["deps_ok"]
            step.deps_failed = change["deps_failed"]
            step.status = change["status"]
            rows.append(self._row(task_id))
        return rows

    def account_steps(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        self.accounted.append((params["done"], params["failed"]))
        return [{"status": self.workflow_status, "notified": None}]

    def enqueue_steps(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        task_ids = list(params["task_ids"])
        self.enqueued.append(task_ids)
        for task_id in task_ids:
            self.steps[task_id].status = "ENQUEUED"
        return [{"enqueued": len(task_ids), "refused": None}]


def advance(steps: Steps, *task_ids: str) -> Advanced:
    return engine.advance(steps, "wf", list(task_ids))  # type: ignore[arg-type]


def chain(*names: str, run_anyway: tuple[str, ...] = ()) -> Steps:
    steps = Steps()
    previous: tuple[str, ...] = ()
    for name in names:
        steps.add(name, after=previous, run_anyway=name in run_anyway)
        previous = (name,)
    return steps


def fan_in(join: str = "all", run_anyway: bool = False) -> Steps:
    """a and b, then c after both."""
    steps = Steps()
    steps.add("a")
    steps.add("b")
    steps.add("c", after=("a", "b"), join=join, run_anyway=run_anyway)
    return steps


def test_a_completed_step_makes_its_dependent_ready_and_enqueues_it() -> None:
    steps = chain("a", "b", "c")
    steps.end(a="COMPLETED")
    done = advance(steps, "a")
    assert done == Advanced(settled=[0], skipped=[], enqueued=1, status="RUNNING")
    assert steps.accounted == [(1, 0)]
    assert steps.enqueued == [["b"]]
    assert steps.status() == {"a": "COMPLETED", "b": "ENQUEUED", "c": "WAITING"}
    assert (steps.steps["b"].waiting_on, steps.steps["b"].deps_ok, steps.steps["b"].deps_failed) == (0, 1, 0)


def test_a_failed_step_skips_its_dependents_down_the_chain() -> None:
    steps = chain("a", "b", "c", "d")
    steps.end(a="FAILED")
    steps.workflow_status = "FAILED"
    done = advance(steps, "a")
    assert done == Advanced(settled=[0], skipped=[1, 2, 3], enqueued=0, status="FAILED")
    # Skipped steps count as done, not as failed: only the step that failed does.
    assert steps.accounted == [(4, 1)]
    assert steps.enqueued == []
    assert steps.status() == {"a": "FAILED", "b": "SKIPPED", "c": "SKIPPED", "d": "SKIPPED"}
    assert (steps.steps["b"].waiting_on, steps.steps["b"].deps_ok, steps.steps["b"].deps_failed) == (0, 0, 1)
    assert (steps.steps["c"].deps_ok, steps.steps["c"].deps_failed) == (0, 1)  # a skip is not a completion


def test_a_skip_cascade_stops_at_a_run_anyway_step() -> None:
    steps = chain("a", "b", "c", "d", run_anyway=("c",))
    steps.end(a="FAILED")
    done = advance(steps, "a")
    assert (done.skipped, done.enqueued) == ([1], 1)
    assert steps.accounted == [(2, 1)]
    assert steps.enqueued == [["c"]]
    assert steps.status() == {"a": "FAILED", "b": "SKIPPED", "c": "ENQUEUED", "d": "WAITING"}


def test_join_all_waits_for_every_dependency() -> None:
    steps = fan_in()
    steps.end(a="COMPLETED", b="COMPLETED")
    first = advance(steps, "a")
    assert first == Advanced(settled=[0], skipped=[], enqueued=0, status="RUNNING")
    assert (steps.steps["c"].status, steps.steps["c"].waiting_on, steps.steps["c"].deps_ok) == (
        "WAITING",
        1,
        1,
    )
    second = advance(steps, "b")
    assert second == Advanced(settled=[1], skipped=[], enqueued=1, status="RUNNING")
    assert (steps.steps["c"].waiting_on, steps.steps["c"].deps_ok) == (0, 2)
    assert steps.enqueued == [["c"]]
    assert steps.accounted == [(1, 0), (1, 0)]


def test_steps_ending_together_count_down_their_dependent_at_once() -> None:
    steps = fan_in()
    steps.end(a="COMPLETED", b="COMPLETED")
    done = advance(steps, "a", "b")
    assert done == Advanced(settled=[0, 1], skipped=[], enqueued=1, status="RUNNING")
    assert (steps.steps["c"].waiting_on, steps.steps["c"].deps_ok, steps.steps["c"].deps_failed) == (0, 2, 0)
    assert steps.accounted == [(2, 0)]


def test_join_all_run_anyway_runs_after_a_failure_once_all_ended() -> None:
    steps = fan_in(run_anyway=True)
    steps.end(a="FAILED", b="COMPLETED")
    assert advance(steps, "a").enqueued == 0
    assert (steps.steps["c"].status, steps.steps["c"].deps_failed) == ("WAITING", 1)
    done = advance(steps, "b")
    assert (done.enqueued, steps.steps["c"].status) == (1, "ENQUEUED")
    assert steps.accounted == [(1, 1), (1, 0)]


def test_join_any_starts_on_the_first_completion_and_ignores_the_rest() -> None:
    steps = fan_in(join="any")
    steps.end(a="COMPLETED", b="FAILED")
    assert advance(steps, "a") == Advanced(settled=[0], skipped=[], enqueued=1, status="RUNNING")
    assert (steps.steps["c"].waiting_on, steps.steps["c"].deps_ok) == (1, 1)
    later = advance(steps, "b")
    assert later == Advanced(settled=[1], skipped=[], enqueued=0, status="RUNNING")
    # c no longer waits: b's end leaves its counters alone.
    assert (steps.steps["c"].status, steps.steps["c"].deps_failed) == ("ENQUEUED", 0)
    assert steps.accounted == [(1, 0), (1, 1)]


def test_join_any_is_skipped_only_when_no_dependency_completed() -> None:
    steps = fan_in(join="any")
    steps.end(a="FAILED", b="CANCELLED")
    first = advance(steps, "a")
    assert (first.skipped, steps.steps["c"].status) == ([], "WAITING")
    second = advance(steps, "b")
    assert (second.skipped, steps.steps["c"].status) == ([2], "SKIPPED")
    # A cancelled step counts as failed, like a failed one.
    assert steps.accounted == [(1, 1), (2, 1)]


def test_ready_steps_wait_while_the_workflow_is_paused() -> None:
    steps = chain("a", "b")
    steps.end(a="COMPLETED")
    steps.workflow_status = "PAUSED"
    done = advance(steps, "a")
    assert done == Advanced(settled=[0], skipped=[], enqueued=0, status="PAUSED")
    assert steps.enqueued == []
    assert steps.status() == {"a": "COMPLETED", "b": "READY"}


def test_a_step_already_settled_changes_nothing() -> None:
    steps = chain("a", "b")
    steps.end(a="COMPLETED")
    advance(steps, "a")
    steps.statements.clear()
    again = advance(steps, "a")
    assert again == Advanced()
    assert again.status is None
    assert steps.statements == ["lock_workflow", "plan_as_lookups", "settle_steps"]
    assert steps.accounted == [(1, 0)]


def test_a_step_whose_task_has_not_ended_is_not_settled() -> None:
    steps = chain("a", "b")
    assert advance(steps, "a") == Advanced()
    assert steps.status() == {"a": "ENQUEUED", "b": "WAITING"}


def test_a_workflow_that_is_gone_is_left_alone() -> None:
    steps = chain("a", "b")
    steps.end(a="COMPLETED")
    steps.workflow = None
    assert advance(steps, "a") == Advanced()
    assert steps.statements == ["lock_workflow"]
