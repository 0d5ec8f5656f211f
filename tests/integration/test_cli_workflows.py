"""`tether workflows`, `tether workflow ID` and the workflow pass of `tether recover`, run for real.

Most workflows here run no code: their steps go to queue `other`, which no worker serves, and
a step's task is ended by an UPDATE; ``tether.recover_stuck_workflows`` then advances the
workflow as a worker would have. That gives every step status (WAITING, ENQUEUED, COMPLETED,
FAILED, SKIPPED, CANCELLED, READY) and every workflow status without timing. One test runs a
workflow on a real worker.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from rich.console import Console

import tether
import tether.cli
import tether.cli.common
from tests.apps.support import ensure_ledger, load_app_module
from tests.cli_support import run, run_json, tether_command
from tests.conftest import WorkerFactory

Conn = psycopg.Connection[Any]
APP = "tests.apps.flows:app"
WAIT = 60.0
STAMP = {"COMPLETED": "completed_at", "FAILED": "failed_at"}


@pytest.fixture
def flows(database_url: str, db: Conn) -> Iterator[ModuleType]:
    ensure_ledger(db)
    yield load_app_module("flows", database_url)


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables wide enough that no cell is cut (the commands print through tether.cli.common.console)."""
    monkeypatch.setattr(tether.cli.common, "console", Console(width=200))


def tree(output: str) -> list[str]:
    """The step tree printed by `tether workflow ID`: its lines from `steps (N)` on."""
    lines = [line.rstrip() for line in output.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("steps ("))
    return [line for line in lines[start:] if line]


def cells(line: str, bar: str = "│") -> list[str]:
    """The cells of one table row as printed (none if the line is not a row)."""
    line = line.strip()
    if not (line.startswith(bar) and line.endswith(bar)):
        return []
    return [c.strip() for c in line[1:-1].split(bar)]


def end_task(db: Conn, handle: Any, node: str, *, ok: Any = None, err: str | None = None) -> None:
    """End a step's task by SQL (as a worker that died before advancing the workflow leaves it)."""
    status = "FAILED" if err else "COMPLETED"
    result = {"err": {"code": err, "message": "failed on purpose", "data": None}} if err else {"ok": ok}
    row = db.execute(
        f"UPDATE tether_tasks SET status = %s, result = %s::jsonb, error_code = %s, attempt = 1,"
        f" {STAMP[status]} = now(), updated_at = now() WHERE id = %s AND status = 'PENDING' RETURNING id",
        (status, json.dumps(result), err, handle.task(node).id),
    ).fetchone()
    assert row is not None, f"the task of step {node} is not PENDING"


def finish(
    db: Conn, flows: ModuleType, handle: Any, node: str, *, ok: Any = None, err: str | None = None
) -> None:
    end_task(db, handle, node, ok=ok, err=err)
    assert tether.recover_stuck_workflows(flows.app).steps == 1


def step_rows(db: Conn, workflow_id: Any) -> dict[str, dict[str, Any]]:
    rows = db.execute(
        "SELECT s.node_name, s.status, t.status AS task_status FROM tether_workflow_tasks s"
        " LEFT JOIN tether_tasks t ON t.id = s.task_id WHERE s.workflow_id = %s",
        (workflow_id,),
    ).fetchall()
    return {r["node_name"]: dict(r) for r in rows}


def diamond(flows: ModuleType, name: str = "diamond") -> Any:
    """top -> left, right -> join, all parked on `other`."""
    number, add = flows.number.with_options(queue="other"), flows.add.with_options(queue="other")
    top = number.node(args=(3,), name="top")
    left = add.node(kwargs={"b": 10}, args_from={"a": top}, name="left")
    right = add.node(kwargs={"b": 100}, args_from={"a": top}, name="right")
    join = add.node(args_from={"a": left, "b": right}, name="join")
    return flows.app.workflow(name, [top, left, right, join]).start()


def failing(flows: ModuleType, name: str = "fails") -> Any:
    """root -> broken -> after; report runs anyway after broken; either joins any of after, report."""
    other = {"queue": "other"}
    root = flows.number.with_options(**other).node(args=(1,), name="root")
    broken = flows.fail.with_options(**other).node(after=[root], name="broken")
    after = flows.add.with_options(**other).node(args=(1,), after=[broken], name="after")
    report = flows.report.with_options(**other).node(
        args_from={"upstream": broken}, run_anyway=True, name="report"
    )
    either = flows.first.with_options(**other).node(
        args_from={"a": after, "b": report}, join="any", name="either"
    )
    return flows.app.workflow(name, [root, broken, after, report, either]).start()


def paused(db: Conn, flows: ModuleType, name: str = "pauses") -> Any:
    """on_error='pause': broken fails, slow completes, and its dependent is held READY."""
    broken = flows.fail.with_options(queue="other").node(name="broken")
    slow = flows.number.with_options(queue="other").node(args=(2,), name="slow")
    held = flows.add.with_options(queue="other").node(args_from={"a": slow}, name="held")
    handle = flows.app.workflow(name, [broken, slow, held], on_error="pause").start()
    finish(db, flows, handle, "broken", err="BROKEN")
    finish(db, flows, handle, "slow", ok=2)
    assert handle.status() is tether.WorkflowStatus.PAUSED
    return handle


# -- tether workflows ---------------------------------------------------------------------------


def test_workflows_lists_each_status_newest_first_with_filters(
    database_url: str, flows: ModuleType, db: Conn
) -> None:
    running = diamond(flows)
    finish(db, flows, running, "top", ok=3)
    single = flows.number.with_options(queue="other").node(args=(5,), name="only")
    completed = flows.app.workflow("single", [single]).start()
    finish(db, flows, completed, "only", ok=5)
    failed = failing(flows)
    finish(db, flows, failed, "root", ok=1)
    finish(db, flows, failed, "broken", err="BROKEN")
    finish(db, flows, failed, "report", ok="err BROKEN")
    finish(db, flows, failed, "either", ok="err BROKEN")
    held = paused(db, flows)
    cancelled = diamond(flows, "etl [/nightly]")  # a name rich would read as markup
    assert cancelled.cancel()

    listed = run_json(database_url, "workflows")
    newest_first = [cancelled, held, failed, completed, running]
    assert [w["id"] for w in listed] == [str(h.id) for h in newest_first]
    by_id = {w["id"]: w for w in listed}
    assert {w["id"]: w["status"] for w in listed} == {
        str(running.id): "RUNNING",
        str(completed.id): "COMPLETED",
        str(failed.id): "FAILED",
        str(held.id): "PAUSED",
        str(cancelled.id): "CANCELLED",
    }
    assert set(listed[0]) == {
        "id",
        "name",
        "status",
        "on_error",
        "steps_total",
        "steps_done",
        "steps_failed",
        "created_at",
        "updated_at",
        "paused_at",
        "finished_at",
    }
    f = by_id[str(failed.id)]
    assert (f["name"], f["on_error"], f["steps_done"], f["steps_total"], f["steps_failed"]) == (
        "fails",
        "fail",
        5,
        5,
        1,
    )
    assert f["finished_at"] is not None and by_id[str(running.id)]["finished_at"] is None
    assert (by_id[str(held.id)]["on_error"], by_id[str(held.id)]["steps_done"]) == ("pause", 2)

    for status, handle in [
        ("RUNNING", running),
        ("completed", completed),
        ("Failed", failed),
        ("paused", held),
        ("CANCELLED", cancelled),
    ]:
        assert [w["id"] for w in run_json(database_url, "workflows", "--status", status)] == [str(handle.id)]
    assert [w["id"] for w in run_json(database_url, "workflows", "--name", "diamond")] == [str(running.id)]
    assert run_json(database_url, "workflows", "--name", "no such workflow") == []
    assert [w["id"] for w in run_json(database_url, "workflows", "--limit", "2")] == [
        str(cancelled.id),
        str(held.id),
    ]

    table = run(database_url, "workflows").stdout
    assert table.splitlines()[0].strip() == "Workflows"
    header = next(line for line in table.splitlines() if "steps" in line)
    assert cells(header, "┃") == [
        "id",
        "name",
        "status",
        "steps",
        "failed",
        "created",
        "finished",
    ]
    row = next(line for line in table.splitlines() if str(failed.id) in line)
    assert cells(row)[1:5] == ["fails", "FAILED", "5/5", "1"]
    row = next(line for line in table.splitlines() if str(held.id) in line)
    assert cells(row)[1:5] == ["pauses", "PAUSED", "2/3", "1"]
    assert "etl [/nightly]" in table


@pytest.mark.server_agnostic
def test_workflows_refuses_an_unknown_status(database_url: str, db: Conn) -> None:
    result = CliRunner().invoke(
        tether.cli.cli, ["workflows", "--status", "DONE", "--database-url", database_url]
    )
    assert result.exit_code == 2
    assert "Invalid value for '--status'" in result.output and "'DONE' is not one of" in result.output
    assert "running" in result.output.lower() and "cancelled" in result.output.lower()


# -- tether workflow ID -------------------------------------------------------------------------


@pytest.mark.server_agnostic
def test_workflow_shows_a_diamond_as_a_tree(database_url: str, flows: ModuleType, db: Conn) -> None:
    handle = diamond(flows)
    finish(db, flows, handle, "top", ok=3)

    out = run(database_url, "workflow", str(handle.id)).stdout
    # `join` is under its first dependency in full, under the other as a reference.
    assert tree(out) == [
        "steps (4)",
        "└── top  wf.number  COMPLETED  task COMPLETED, attempt 1",
        "    ├── left  wf.add  ENQUEUED  task PENDING",
        "    │   └── join  wf.add  WAITING",
        "    └── right  wf.add  ENQUEUED  task PENDING",
        "        └── ↳ join (see above)",
    ]
    assert f"Workflow {handle.id}" in out
    fields = {c[0]: c[1] for line in out.splitlines() if len(c := cells(line)) == 2}
    assert fields["name"] == "diamond" and fields["status"] == "RUNNING" and fields["on_error"] == "fail"
    assert fields["steps"] == "1 of 4 done, 0 failed"
    assert fields["created_at"].startswith("20") and fields["finished_at"] == ""


@pytest.mark.server_agnostic
def test_workflow_shows_failures_skips_markers_and_results(
    database_url: str, flows: ModuleType, db: Conn
) -> None:
    handle = failing(flows)
    finish(db, flows, handle, "root", ok=1)
    finish(db, flows, handle, "broken", err="BROKEN")

    assert tree(run(database_url, "workflow", str(handle.id)).stdout) == [
        "steps (5)",
        "└── root  wf.number  COMPLETED  task COMPLETED, attempt 1",
        "    └── broken  wf.fail  FAILED  task FAILED, attempt 1  BROKEN",
        "        ├── after  wf.add  SKIPPED  DEPENDENCY_FAILED",
        "        │   └── either  wf.first  WAITING  join=any",
        "        └── report  wf.report  ENQUEUED  task PENDING  run_anyway",
        "            └── ↳ either (see above)",
    ]

    finish(db, flows, handle, "report", ok="err BROKEN")
    finish(db, flows, handle, "either", ok="err BROKEN")
    out = run(database_url, "workflow", str(handle.id)).stdout
    assert tree(out)[4:6] == [
        "        │   └── either  wf.first  COMPLETED  task COMPLETED, attempt 1  join=any",
        "        └── report  wf.report  COMPLETED  task COMPLETED, attempt 1  run_anyway",
    ]

    info = run_json(database_url, "workflow", str(handle.id))
    assert info["id"] == str(handle.id) and info["name"] == "fails"
    assert (info["status"], info["on_error"]) == ("FAILED", "fail")
    assert (info["steps_total"], info["steps_done"], info["steps_failed"]) == (5, 5, 1)
    assert info["finished_at"] is not None and info["paused_at"] is None
    steps = {s["name"]: s for s in info["steps"]}
    assert [s["name"] for s in info["steps"]] == ["root", "broken", "after", "report", "either"]
    assert {n: s["depends_on"] for n, s in steps.items()} == {
        "root": [],
        "broken": ["root"],
        "after": ["broken"],
        "report": ["broken"],
        "either": ["after", "report"],
    }
    assert {n: (s["status"], s["task_status"]) for n, s in steps.items()} == {
        "root": ("COMPLETED", "COMPLETED"),
        "broken": ("FAILED", "FAILED"),
        "after": ("SKIPPED", None),
        "report": ("COMPLETED", "COMPLETED"),
        "either": ("COMPLETED", "COMPLETED"),
    }
    assert steps["root"]["result"] == {"ok": 1}
    assert steps["broken"]["result"] == {
        "err": {"code": "BROKEN", "message": "failed on purpose", "data": None}
    }
    assert steps["broken"]["error_code"] == "BROKEN" and steps["broken"]["attempt"] == 1
    assert steps["after"]["result"]["err"]["code"] == "DEPENDENCY_FAILED"
    assert steps["after"]["error_code"] == "DEPENDENCY_FAILED" and steps["after"]["attempt"] is None
    assert steps["either"]["result"] == {"ok": "err BROKEN"}
    assert (steps["either"]["join"], steps["either"]["run_anyway"]) == ("any", False)
    assert (steps["report"]["join"], steps["report"]["run_anyway"]) == ("all", True)
    assert steps["root"]["task_name"] == "wf.number"
    assert steps["root"]["task_id"] == str(handle.task("root").id)
    assert steps["after"]["enqueued_at"] is None and steps["after"]["finished_at"] is not None


@pytest.mark.server_agnostic
def test_the_tree_has_one_line_per_root_and_per_edge(database_url: str, flows: ModuleType, db: Conn) -> None:
    number = flows.number.with_options(queue="other")
    nodes: list[Any] = []
    for i in range(8):  # every node waits for all the ones before it: 28 edges
        nodes.append(number.node(args=(i,), name=f"n{i}", after=list(nodes)))
    handle = flows.app.workflow("dense", nodes).start()

    lines = tree(run(database_url, "workflow", str(handle.id)).stdout)
    assert len(lines) == 1 + 1 + 28
    for i in range(8):
        assert sum(f"n{i}  wf.number" in line for line in lines) == 1  # in full once
        # a reference under each dependency but the first
        assert sum(line.endswith(f"↳ n{i} (see below)") for line in lines) == max(0, i - 1)
    assert lines[1] == "└── n0  wf.number  ENQUEUED  task PENDING"


@pytest.mark.server_agnostic
def test_a_long_chain_continues_at_the_top_level(
    database_url: str, flows: ModuleType, db: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tether.cli.common, "console", Console(width=80))  # 10 levels deep at most
    add = flows.add.with_options(queue="other")
    nodes = [flows.number.with_options(queue="other").node(args=(0,), name="c0")]
    for i in range(1, 14):
        nodes.append(add.node(args=(i,), after=[nodes[-1]], name=f"c{i}"))
    handle = flows.app.workflow("chain", nodes).start()

    lines = tree(run(database_url, "workflow", str(handle.id)).stdout)
    assert len(lines) == 1 + 14 + 1
    assert lines[10].endswith("└── c9  wf.add  WAITING")
    assert lines[11].endswith("└── ↳ c10 (continued below)")
    assert lines[12] == "└── c10  wf.add  WAITING  (continued from c9)"
    assert lines[-1] == "            └── c13  wf.add  WAITING"
    assert max(map(len, lines)) <= 80


@pytest.mark.server_agnostic
def test_workflow_with_a_bad_or_unknown_id(database_url: str, db: Conn) -> None:
    bad = tether_command(database_url, "workflow", "not-a-uuid")
    assert bad.returncode == 1
    assert "workflow id 'not-a-uuid' is not a UUID" in bad.stderr
    assert "Traceback" not in bad.stderr + bad.stdout

    missing_id = uuid.uuid4()
    missing = tether_command(database_url, "workflow", str(missing_id))
    assert missing.returncode == 1
    assert f"no workflow with id {missing_id}" in missing.stderr
    assert "Traceback" not in missing.stderr + missing.stdout

    both = CliRunner().invoke(
        tether.cli.cli, ["workflow", str(missing_id), "--cancel", "--resume", "--database-url", database_url]
    )
    assert both.exit_code == 2 and "--cancel and --resume cannot be used together" in both.output


def test_workflow_resume_and_cancel(database_url: str, flows: ModuleType, db: Conn) -> None:
    held = paused(db, flows)
    assert "held  wf.add  READY" in run(database_url, "workflow", str(held.id)).stdout

    out = run(database_url, "workflow", str(held.id), "--resume").stdout
    assert out.splitlines()[0] == (
        f"workflow {held.id} resumed: 1 step(s) that became ready while it was paused were enqueued; "
        "it is now RUNNING"
    )
    assert "held  wf.add  ENQUEUED  task PENDING" in out
    assert step_rows(db, held.id)["held"] == {
        "node_name": "held",
        "status": "ENQUEUED",
        "task_status": "PENDING",
    }
    again = run(database_url, "workflow", str(held.id), "--resume").stdout
    assert again.splitlines()[0] == f"workflow {held.id} is RUNNING: nothing to resume (it is not PAUSED)"
    assert run_json(database_url, "workflow", str(held.id), "--resume")["resumed"] is False

    # A step whose task is running finishes; the others are cancelled.
    handle = diamond(flows)
    finish(db, flows, handle, "top", ok=3)
    db.execute(
        "UPDATE tether_tasks SET status = 'RUNNING', attempt = 1, started_at = now(),"
        " claimed_by_worker_id = 'elsewhere' WHERE id = %s",
        (handle.task("left").id,),
    )
    out = run(database_url, "workflow", str(handle.id), "--cancel").stdout
    assert out.splitlines()[0] == (
        f"workflow {handle.id} cancelled: 2 step(s) that had not started were cancelled, "
        "1 step(s) already running will finish"
    )
    assert tree(out) == [
        "steps (4)",
        "└── top  wf.number  COMPLETED  task COMPLETED, attempt 1",
        "    ├── left  wf.add  ENQUEUED  task RUNNING, attempt 1",
        "    │   └── join  wf.add  CANCELLED  TASK_CANCELLED",
        "    └── right  wf.add  CANCELLED  task CANCELLED  TASK_CANCELLED",
        "        └── ↳ join (see above)",
    ]
    assert handle.status() is tether.WorkflowStatus.CANCELLED
    again_json = run_json(database_url, "workflow", str(handle.id), "--cancel")
    assert again_json["cancelled"] is False and again_json["status"] == "CANCELLED"
    again = run(database_url, "workflow", str(handle.id), "--cancel").stdout
    assert (
        again.splitlines()[0]
        == f"workflow {handle.id} is CANCELLED: nothing to cancel (it has already ended)"
    )
    assert "cancelled" not in run_json(database_url, "workflow", str(handle.id))


def test_workflow_run_by_a_worker(
    database_url: str, flows: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    workers.start(APP, "--queues", "default", "--processes", "1")
    top = flows.number.node(args=(3,), name="top")
    left = flows.add.node(kwargs={"b": 10}, args_from={"a": top}, name="left")
    right = flows.add.node(kwargs={"b": 100}, args_from={"a": top}, name="right")
    bottom = flows.add.node(args_from={"a": left, "b": right}, name="bottom")
    made = flows.box.node(args=("crate", 7), name="made")
    handle = flows.app.workflow("worked", [top, left, right, bottom, made], output="bottom").start()
    assert handle.get(timeout=WAIT).ok == 116

    assert tree(run(database_url, "workflow", str(handle.id)).stdout) == [
        "steps (5)",
        "├── top  wf.number  COMPLETED  task COMPLETED, attempt 1",
        "│   ├── left  wf.add  COMPLETED  task COMPLETED, attempt 1",
        "│   │   └── bottom  wf.add  COMPLETED  task COMPLETED, attempt 1",
        "│   └── right  wf.add  COMPLETED  task COMPLETED, attempt 1",
        "│       └── ↳ bottom (see above)",
        "└── made  wf.box  COMPLETED  task COMPLETED, attempt 1",
    ]
    info = run_json(database_url, "workflow", str(handle.id))
    assert (info["status"], info["steps_done"], info["steps_failed"]) == ("COMPLETED", 5, 0)
    results = {s["name"]: s["result"] for s in info["steps"]}
    # A dataclass comes back as its fields.
    assert results == {
        "top": {"ok": 3},
        "left": {"ok": 13},
        "right": {"ok": 103},
        "bottom": {"ok": 116},
        "made": {"ok": {"label": "crate", "size": 7}},
    }
    assert [w["status"] for w in run_json(database_url, "workflows")] == ["COMPLETED"]


# -- tether recover -----------------------------------------------------------------------------


def test_recover_settles_stuck_steps_and_finishes_workflows(
    database_url: str, flows: ModuleType, db: Conn
) -> None:
    handle = diamond(flows)
    end_task(db, handle, "top", ok=3)  # stuck: the workflow was not advanced
    single = flows.app.workflow("single", [flows.number.with_options(queue="other").node(args=(5,))]).start()
    end_task(db, single, "wf.number", ok=5)

    dry = run(database_url, "recover", "--dry-run").stdout
    assert "2 stuck workflow step(s) in 2 workflow(s) would be settled" in dry
    assert "Workflows with stuck steps (dry run: nothing changed)" in dry
    assert step_rows(db, handle.id)["top"]["status"] == "ENQUEUED"
    assert single.status() is tether.WorkflowStatus.RUNNING
    dry_json = run_json(database_url, "recover", "--dry-run")
    assert dry_json["workflows"]["steps_settled"] == 2 and dry_json["workflows"]["finished"] == []
    assert sorted(
        (w["id"], w["name"], w["stuck_steps"], w["status"]) for w in dry_json["workflows"]["workflows"]
    ) == sorted([(str(handle.id), "diamond", 1, "RUNNING"), (str(single.id), "single", 1, "RUNNING")])

    done = run_json(database_url, "recover")
    assert done["workflows"]["steps_settled"] == 2
    assert done["workflows"]["finished"] == [str(single.id)]
    assert {w["id"]: w["status"] for w in done["workflows"]["workflows"]} == {
        str(handle.id): "RUNNING",
        str(single.id): "COMPLETED",
    }
    assert {n: r["status"] for n, r in step_rows(db, handle.id).items()} == {
        "top": "COMPLETED",
        "left": "ENQUEUED",
        "right": "ENQUEUED",
        "join": "WAITING",
    }
    assert single.status() is tether.WorkflowStatus.COMPLETED

    nothing = run(database_url, "recover").stdout
    assert "0 stuck workflow step(s) were settled, 0 workflow(s) were finished" in nothing
    assert "Workflows reconciled" not in nothing

    # The safety net: an open workflow whose steps have all ended (changed by hand) is finished.
    db.execute(
        "UPDATE tether_workflows SET status = 'RUNNING', finished_at = NULL WHERE id = %s", (single.id,)
    )
    dry = run(database_url, "recover", "--dry-run").stdout
    assert (
        "0 stuck workflow step(s) in 0 workflow(s) would be settled, "
        "1 workflow(s) whose steps have all ended would be finished" in dry
    )
    out = run(database_url, "recover").stdout
    assert "0 stuck workflow step(s) were settled, 1 workflow(s) were finished" in out
    assert "Workflows reconciled" in out and str(single.id) in out and "COMPLETED" in out
    assert single.status() is tether.WorkflowStatus.COMPLETED


def test_recover_settles_the_step_of_a_task_it_fails(database_url: str, flows: ModuleType, db: Conn) -> None:
    """A step whose task the task pass fails (its runner went silent) settles in the same run."""
    handle = diamond(flows)
    db.execute(
        "UPDATE tether_tasks SET status = 'RUNNING', attempt = 1, claimed_by_worker_id = 'gone',"
        " claimed_at = now() - interval '1 hour', started_at = now() - interval '1 hour' WHERE id = %s",
        (handle.task("top").id,),
    )

    dry = run(database_url, "recover", "--dry-run", "--running-threshold-ms", "1000").stdout
    assert "1 stale task(s) would be recovered" in dry
    assert step_rows(db, handle.id)["top"]["task_status"] == "RUNNING"

    out = run(database_url, "recover", "--running-threshold-ms", "1000").stdout
    assert "1 stale task(s) were recovered" in out
    assert "1 stuck workflow step(s) were settled, 1 workflow(s) were finished" in out
    assert {n: r["status"] for n, r in step_rows(db, handle.id).items()} == {
        "top": "FAILED",
        "left": "SKIPPED",
        "right": "SKIPPED",
        "join": "SKIPPED",
    }
    assert handle.status() is tether.WorkflowStatus.FAILED
    assert (
        "└── top  wf.number  FAILED  task FAILED, attempt 1  WORKER_CRASHED"
        in run(database_url, "workflow", str(handle.id)).stdout
    )
