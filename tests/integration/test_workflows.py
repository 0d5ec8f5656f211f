"""Workflows with real workers: data flow, joins, skips, both error policies, cancel, pause/resume.

One worker (2 processes) on the `default` queue serves the module; steps routed to
`other` wait there until a test starts a worker for that queue (or cancels them).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import clean_connection, load_app_module, runs, workflow_row
from tests.apps.support import workflow_steps as steps
from tests.conftest import WorkerFactory, WorkerProcess, wait_until
from tether import ErrorCode, StepStatus, TaskStatus, WorkflowStatus
from tether.cancelling import CancelReply

# In the smoke set (.ci/run's Python 3.12 run): workflows, end to end.
pytestmark = pytest.mark.smoke

APP = "tests.apps.flows:app"
WAIT = 60.0


@pytest.fixture(scope="module")
def conn(database_url: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    with clean_connection(database_url) as c:
        yield c


@pytest.fixture(scope="module")
def flows(database_url: str, conn: psycopg.Connection[Any]) -> ModuleType:
    return load_app_module("flows", database_url)


@pytest.fixture(scope="module")
def worker(
    database_url: str, conn: psycopg.Connection[Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    factory = WorkerFactory(database_url, Path(tmp_path_factory.mktemp("workflow-worker")))
    try:
        w = factory.start(APP, "--queues", "default", "--processes", "2")
        yield w
        assert w.stop() == 0, w.log()
    finally:
        factory.cleanup()


def token() -> str:
    return uuid.uuid4().hex


# -- data flow -------------------------------------------------------------------------


def test_diamond_passes_results_along(flows: ModuleType, worker: WorkerProcess, conn: Any) -> None:
    top = flows.number.node(args=(3,), name="top")
    left = flows.add.node(kwargs={"b": 10}, args_from={"a": top}, name="left")
    right = flows.add.node(kwargs={"b": 100}, args_from={"a": top}, name="right")
    bottom = flows.add.node(args_from={"a": left, "b": right}, name="bottom")
    handle = flows.app.workflow("diamond", [top, left, right, bottom]).start()

    result = handle.get(timeout=WAIT)

    assert result.is_ok, result
    assert result.ok == (3 + 10) + (3 + 100)
    assert handle.status() is WorkflowStatus.COMPLETED
    rows = steps(conn, handle.id)
    assert {n: r["status"] for n, r in rows.items()} == dict.fromkeys(rows, "COMPLETED")
    assert {n: r["task_status"] for n, r in rows.items()} == dict.fromkeys(rows, "COMPLETED")
    # bottom started only after both sides had finished
    assert rows["bottom"]["enqueued_at"] >= max(rows["left"]["finished_at"], rows["right"]["finished_at"])
    wf = workflow_row(conn, handle.id)
    assert (wf["steps_total"], wf["steps_done"], wf["steps_failed"]) == (4, 4, 0)
    assert wf["finished_at"] is not None
    results = handle.results()
    assert {n: r.ok for n, r in results.items() if r is not None} == {
        "top": 3,
        "left": 13,
        "right": 103,
        "bottom": 116,
    }


def test_values_keep_their_types_between_steps(flows: ModuleType, worker: WorkerProcess) -> None:
    made = flows.box.node(args=("crate", 7))
    measured = flows.measure.node(args_from={"item": made})
    handle = flows.app.workflow("typed-flow", [made, measured]).start()
    assert handle.get(timeout=WAIT).ok == "crate:7"


def test_chain_runs_in_order(flows: ModuleType, worker: WorkerProcess, conn: Any) -> None:
    nodes = [flows.number.node(args=(1,), name="n0")]
    for i in range(1, 6):
        nodes.append(flows.add.node(kwargs={"b": i}, args_from={"a": nodes[-1]}, name=f"n{i}"))
    handle = flows.app.workflow("chain", nodes).start()
    assert handle.get(timeout=WAIT).ok == 1 + 1 + 2 + 3 + 4 + 5
    rows = steps(conn, handle.id)
    for i in range(1, 6):
        assert rows[f"n{i}"]["enqueued_at"] >= rows[f"n{i - 1}"]["finished_at"]


def test_several_final_steps_give_a_dict(flows: ModuleType, worker: WorkerProcess) -> None:
    root = flows.number.node(args=(2,), name="root")
    a = flows.add.node(kwargs={"b": 1}, args_from={"a": root}, name="a")
    b = flows.add.node(kwargs={"b": 2}, args_from={"a": root}, name="b")
    handle = flows.app.workflow("two-sinks", [root, a, b]).start()
    assert handle.get(timeout=WAIT).ok == {"a": 3, "b": 4}
    named = flows.app.workflow("named-output", [root, a, b], output="a").start()
    assert named.get(timeout=WAIT).ok == 3


# -- failures --------------------------------------------------------------------------


def test_fail_policy_skips_dependents_and_finishes_the_rest(
    flows: ModuleType, worker: WorkerProcess, conn: Any
) -> None:
    tok_after, tok_side, tok_report = token(), token(), token()
    root = flows.number.node(args=(1,), name="root")
    broken = flows.fail.node(after=[root], name="broken")
    after = flows.add.node(args=(1,), kwargs={"token": tok_after}, after=[broken], name="after")
    after2 = flows.add.node(args=(1,), after=[after], name="after2")
    side = flows.add.node(kwargs={"b": 5, "token": tok_side}, args_from={"a": root}, name="side")
    report = flows.report.node(
        kwargs={"token": tok_report}, args_from={"upstream": broken}, run_anyway=True, name="report"
    )
    handle = flows.app.workflow("fails", [root, broken, after, after2, side, report]).start()

    result = handle.get(timeout=WAIT)

    assert result.is_err
    assert result.err is not None and result.err.code == ErrorCode.WORKFLOW_FAILED
    assert result.err.data["failed_steps"] == {"broken": {"code": "BROKEN", "message": "failed on purpose"}}
    rows = steps(conn, handle.id)
    assert rows["broken"]["status"] == "FAILED"
    assert rows["after"]["status"] == rows["after2"]["status"] == "SKIPPED"
    assert rows["after"]["task_status"] is None  # never became a task
    assert rows["after"]["error_code"] == "DEPENDENCY_FAILED"
    assert rows["side"]["status"] == "COMPLETED"
    assert rows["report"]["status"] == "COMPLETED"
    assert handle.results()["report"].ok == "err BROKEN"  # type: ignore[union-attr]
    assert (runs(conn, tok_after), runs(conn, tok_side), runs(conn, tok_report)) == (0, 1, 1)
    assert handle.status() is WorkflowStatus.FAILED
    wf = workflow_row(conn, handle.id)
    assert (wf["steps_done"], wf["steps_failed"]) == (6, 1)


def test_exception_in_a_step_fails_the_workflow(flows: ModuleType, worker: WorkerProcess) -> None:
    root = flows.add.node(args=("not a number",))  # "..." + 0 raises TypeError
    tail = flows.add.node(args=(1,), after=[root])
    result = flows.app.workflow("bad-step", [root, tail]).start().get(timeout=WAIT)
    assert result.err is not None
    assert result.err.data["failed_steps"]["wf.add[0]"]["code"] == ErrorCode.UNHANDLED_EXCEPTION


def test_pause_policy_holds_new_steps_until_resumed(
    flows: ModuleType, worker: WorkerProcess, conn: Any
) -> None:
    tok = token()
    broken = flows.fail.node(name="broken")
    slow = flows.sleep.node(args=(1.0,), name="slow")
    after_slow = flows.add.node(args=(1,), kwargs={"token": tok}, after=[slow], name="after_slow")
    handle = flows.app.workflow("pauses", [broken, slow, after_slow], on_error="pause").start()

    wait_until(lambda: handle.status() is WorkflowStatus.PAUSED, WAIT, message="workflow paused")
    # slow goes on to the end; its dependent is held READY, not enqueued
    wait_until(
        lambda: steps(conn, handle.id)["after_slow"]["status"] == "READY", WAIT, message="dependent held"
    )
    assert steps(conn, handle.id)["after_slow"]["task_status"] is None
    assert handle.get(timeout=0.3).err.code == ErrorCode.WAIT_TIMEOUT  # type: ignore[union-attr]
    assert runs(conn, tok) == 0

    assert handle.resume() is True
    result = handle.get(timeout=WAIT)
    assert result.err is not None and result.err.code == ErrorCode.WORKFLOW_FAILED
    assert runs(conn, tok) == 1
    assert steps(conn, handle.id)["after_slow"]["status"] == "COMPLETED"
    assert handle.resume() is False  # finished: nothing to resume


# -- joins -----------------------------------------------------------------------------


def test_join_any_starts_on_the_first_success(flows: ModuleType, worker: WorkerProcess, conn: Any) -> None:
    fast = flows.number.node(args=(5,), name="fast")
    parked = flows.number.with_options(queue="other").node(args=(6,), name="parked")  # nobody serves it
    either = flows.first.node(args_from={"a": fast, "b": parked}, join="any", name="either")
    handle = flows.app.workflow("any-join", [fast, parked, either], output="either").start()

    wait_until(lambda: steps(conn, handle.id)["either"]["status"] == "COMPLETED", WAIT, message="either ran")
    assert handle.results()["either"].ok == 5  # type: ignore[union-attr]
    assert handle.status() is WorkflowStatus.RUNNING  # parked still pending
    assert handle.cancel() is True
    result = handle.get(timeout=WAIT)
    assert result.err is not None and result.err.code == ErrorCode.WORKFLOW_CANCELLED
    rows = steps(conn, handle.id)
    assert rows["parked"]["status"] == "CANCELLED" and rows["parked"]["task_status"] == "CANCELLED"


def test_join_any_skips_when_no_dependency_completes(
    flows: ModuleType, worker: WorkerProcess, conn: Any
) -> None:
    a = flows.fail.node(name="a")
    b = flows.fail.node(name="b")
    either = flows.first.node(after=[a, b], join="any", name="either")
    handle = flows.app.workflow("any-none", [a, b, either]).start()
    assert handle.get(timeout=WAIT).is_err
    assert steps(conn, handle.id)["either"]["status"] == "SKIPPED"


# -- cancel ----------------------------------------------------------------------------


def test_cancel_stops_pending_steps_and_lets_running_ones_finish(
    flows: ModuleType, worker: WorkerProcess, conn: Any
) -> None:
    tok_run, tok_never = token(), token()
    running = flows.sleep.node(args=(1.0,), kwargs={"token": tok_run}, name="running")
    queued = flows.number.with_options(queue="other").node(args=(1,), name="queued")
    later = flows.add.node(args=(1,), kwargs={"token": tok_never}, after=[running], name="later")
    handle = flows.app.workflow("cancelled", [running, queued, later]).start()
    wait_until(lambda: runs(conn, tok_run) == 1, WAIT, message="the long step started")

    assert handle.cancel() is True
    assert handle.status() is WorkflowStatus.CANCELLED
    assert handle.get(timeout=WAIT).err.code == ErrorCode.WORKFLOW_CANCELLED  # type: ignore[union-attr]
    # the running step finishes and settles; nothing new starts
    wait_until(
        lambda: steps(conn, handle.id)["running"]["status"] == "COMPLETED", WAIT, message="running settled"
    )
    rows = steps(conn, handle.id)
    assert rows["queued"]["task_status"] == "CANCELLED"
    assert rows["later"]["status"] == "CANCELLED" and rows["later"]["task_status"] is None
    assert runs(conn, tok_never) == 0
    assert workflow_row(conn, handle.id)["steps_done"] == 3
    assert handle.cancel() is False


def test_cancelling_a_step_task_counts_as_a_failed_step(flows: ModuleType, conn: Any) -> None:
    parked = flows.number.with_options(queue="other").node(args=(1,), name="parked")
    after = flows.add.node(args=(1,), after=[parked], name="after")
    handle = flows.app.workflow("step-cancel", [parked, after]).start()
    assert handle.task("parked").cancel() is CancelReply.CANCELLED
    result = handle.get(timeout=WAIT)
    assert result.err is not None and result.err.data["failed_steps"]["parked"]["code"] == "TASK_CANCELLED"
    assert steps(conn, handle.id)["after"]["status"] == "SKIPPED"


def test_status_of_an_unknown_workflow(flows: ModuleType, conn: Any) -> None:
    from tether.errors import WorkflowNotFoundError

    ghost = flows.app.workflow_handle(uuid.uuid4())
    with pytest.raises(WorkflowNotFoundError):
        ghost.status()
    assert ghost.get(timeout=1).err.code == ErrorCode.WORKFLOW_NOT_FOUND  # type: ignore[union-attr]


async def test_async_twins(flows: ModuleType, worker: WorkerProcess) -> None:
    a = flows.number.node(args=(4,))
    b = flows.add.node(kwargs={"b": 1}, args_from={"a": a})
    handle = await flows.app.workflow("async", [a, b]).start_async()
    result = await handle.get_async(timeout=WAIT)
    assert result.ok == 5
    assert await handle.status_async() is WorkflowStatus.COMPLETED
    assert (await handle.results_async())["wf.add"].ok == 5  # type: ignore[union-attr]
    assert await handle.cancel_async() is False
    info = await handle.info_async()
    assert [s.status for s in info.steps] == [StepStatus.COMPLETED] * 2
    assert info.steps[1].depends_on == ("wf.number",)
    assert info.steps[1].task_status is TaskStatus.COMPLETED
