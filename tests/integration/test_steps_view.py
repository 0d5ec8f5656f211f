"""Seeing a task's checkpointed steps, and where a retry by hand resumes (docs/durable-steps.md
#seeing-the-steps and #retrying-from-the-last-step), with real workers.

handle.info(), `tether task ID` and the dashboard list the steps a task recorded (name, the
attempt that ran it, when, its size in bytes); a retry keeps them (the new attempt resumes
after the last) unless from scratch, which deletes them with the requeue; a cancel keeps
them. The kills (a task killed in its second step, then retried by hand) are in
tests/chaos/test_step_kills.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import urllib.error
import urllib.request
from types import ModuleType
from typing import Any

import psycopg
import pytest
from rich.console import Console

import tether.cli.common
from tests.apps.support import attempt_rows, load_app_module, task_row
from tests.chaos.conftest import ensure_chaos_ledger, runs, token
from tests.cli_support import run, run_json
from tests.conftest import WorkerFactory, wait_until
from tether import RecoveryConfig, TaskStepInfo
from tether.errors import InvalidOptionError
from tether.retrying import RetryFilter
from tether.web import api
from tether.web.dashboard import DashboardServer

APP = "tests.apps.steps:app"
SYNC_ONLY = ("--processes", "1", "--async-processes", "0")
WAIT = 30
WIDE = 2002  # bytes of the JSON of 1,000 é (two bytes each) in quotes: 1,002 characters

Conn = psycopg.Connection[Any]


@pytest.fixture
def steps(database_url: str, db: Conn) -> ModuleType:
    ensure_chaos_ledger(db)
    db.execute("TRUNCATE tether_chaos_ledger")
    return load_app_module("steps", database_url)


@pytest.fixture
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables wide enough that no cell is cut (the CLI prints through tether.cli.common.console)."""
    monkeypatch.setattr(tether.cli.common, "console", Console(width=200))


def ended(db: Conn, task_id: Any) -> dict[str, Any]:
    return wait_until(
        lambda: (row := task_row(db, task_id))["status"] in ("COMPLETED", "FAILED", "CANCELLED") and row,
        timeout=WAIT,
        message=f"task {task_id} to end",
    )


def step_rows(db: Conn, task_id: Any) -> int:
    row = db.execute("SELECT count(*) AS n FROM tether_task_steps WHERE task_id = %s", (task_id,)).fetchone()
    return int(row["n"])


def failed(steps: ModuleType, db: Conn) -> tuple[Any, str]:
    """A steps_then_fail task run to its end: FAILED (ONCE) with its two steps recorded."""
    tok = token()
    handle = steps.steps_then_fail.send(tok)
    row = ended(db, handle.id)
    assert (row["status"], row["error_code"]) == ("FAILED", "ONCE"), row
    assert step_rows(db, handle.id) == 2
    return handle, tok


def counts(db: Conn, tok: str) -> list[int]:
    """How many times each step's code ran, and how many attempts reached the end."""
    return [runs(db, f"{tok}:{s}") for s in ("one", "wide", "end")]


def test_info_and_tether_task_list_the_steps_with_their_size_in_bytes(
    steps: ModuleType, db: Conn, workers: WorkerFactory, database_url: str, wide_console: None
) -> None:
    workers.start(APP, *SYNC_ONLY)
    handle, _ = failed(steps, db)
    (attempt,) = attempt_rows(db, handle.id)

    info = handle.info()
    assert all(isinstance(s, TaskStepInfo) for s in info.steps)
    assert [(s.name, s.occurrence, s.attempt, s.size) for s in info.steps] == [
        ("one", 0, attempt["attempt"], 1),
        ("wide", 0, attempt["attempt"], WIDE),  # bytes of UTF-8, not characters
    ]
    # Recorded during the attempt, in database time, in the order they ran.
    first, second = info.steps
    assert attempt["started_at"] <= first.written_at <= second.written_at <= attempt["finished_at"]
    assert asyncio.run(handle.info_async()).steps == info.steps

    shown = run_json(database_url, "task", str(handle.id))
    assert [(s["name"], s["occurrence"], s["attempt"], s["size"]) for s in shown["steps"]] == [
        ("one", 0, attempt["attempt"], 1),
        ("wide", 0, attempt["attempt"], WIDE),
    ]
    assert len(shown["attempts"]) == 1  # beside the attempts
    text = run(database_url, "task", str(handle.id)).stdout
    assert re.search(rf"│ one\s+│ 0\s+│ {attempt['attempt']}\s+│ [\d:. -]+│ 1\s+│", text), text
    assert re.search(rf"│ wide\s+│ 0\s+│ {attempt['attempt']}\s+│ [\d:. -]+│ 2,002\s+│", text), text

    # A task that recorded no step lists none, and its page has no steps table.
    plain = steps.async_step_refused.send()
    assert ended(db, plain.id)["status"] == "COMPLETED"
    assert plain.info().steps == ()
    assert run_json(database_url, "task", str(plain.id))["steps"] == []
    assert "Steps" not in run(database_url, "task", str(plain.id)).stdout


def test_a_retry_keeps_the_steps_and_one_from_scratch_deletes_them_with_the_requeue(
    steps: ModuleType, db: Conn, workers: WorkerFactory, database_url: str
) -> None:
    workers.start(APP, *SYNC_ONLY)
    kept, kept_tok = failed(steps, db)
    scratch, scratch_tok = failed(steps, db)
    # Nothing claims while the queue is paused: each retry's own transaction is seen alone.
    assert steps.app.pause_queue("default", by="test")

    # Bad input names the argument and changes nothing.
    with pytest.raises(InvalidOptionError, match="from_scratch must be a bool, got 'yes'"):
        scratch.retry(from_scratch="yes")
    with pytest.raises(InvalidOptionError, match="from_scratch must be a bool, got None"):
        asyncio.run(scratch.retry_async(from_scratch=None))
    with pytest.raises(InvalidOptionError, match="from_scratch must be a bool, got 1"):
        steps.app.retry_tasks(RetryFilter(), from_scratch=1)
    assert task_row(db, scratch.id)["status"] == "FAILED" and step_rows(db, scratch.id) == 2

    answer = run_json(database_url, "retry", str(kept.id))["tasks"][0]
    assert answer["reason"] == "retried: PENDING as a new attempt"
    assert task_row(db, kept.id)["status"] == "PENDING" and step_rows(db, kept.id) == 2
    answer = run_json(database_url, "retry", str(scratch.id), "--from-scratch")["tasks"][0]
    assert answer["reason"] == "retried from scratch: PENDING as a new attempt, its recorded steps deleted"
    assert task_row(db, scratch.id)["status"] == "PENDING" and step_rows(db, scratch.id) == 0

    assert steps.app.resume_queue("default", by="test")
    assert ended(db, kept.id)["status"] == "COMPLETED"
    assert ended(db, scratch.id)["status"] == "COMPLETED"
    assert counts(db, kept_tok) == [1, 1, 2]  # resumed after both steps
    assert counts(db, scratch_tok) == [2, 2, 2]  # both steps ran again
    second = task_row(db, scratch.id)["attempt"]
    assert {s.attempt for s in scratch.info().steps} == {second}
    assert task_row(db, kept.id)["result"] == {"ok": {"one": 1, "wide": 1000}}

    # In bulk, by filter: the same statement, the same choice.
    bulk, bulk_tok = failed(steps, db)
    assert steps.app.pause_queue("default", by="test")
    done = steps.app.retry_tasks(RetryFilter(name="steps_then_fail"), by="test", from_scratch=True)
    assert (done.matched, done.retried) == (1, 1)
    assert task_row(db, bulk.id)["status"] == "PENDING" and step_rows(db, bulk.id) == 0
    assert steps.app.resume_queue("default", by="test")
    assert ended(db, bulk.id)["status"] == "COMPLETED"
    assert counts(db, bulk_tok) == [2, 2, 2]


def test_a_cancelled_task_keeps_its_steps_and_a_retry_resumes_after_them(
    steps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    """Cancelled in its second step (its code sleeps, so it is killed after its 0.5 s grace)."""
    workers.start(APP, *SYNC_ONLY)
    tok = token()
    handle = steps.three_steps_cancellable.send(tok, 60)
    wait_until(
        lambda: runs(db, f"{tok}:two") == 1 and [s.name for s in handle.info().steps] == ["one"],
        timeout=WAIT,
        message="the task to be inside its second step, its first recorded",
    )
    handle.cancel(by="test")
    row = ended(db, handle.id)
    assert (row["status"], row["error_code"]) == ("CANCELLED", "TASK_CANCELLED"), row
    first = row["attempt"]
    assert [(s.name, s.attempt) for s in handle.info().steps] == [("one", first)]  # kept, to see

    assert handle.retry(by="test").retried
    row = ended(db, handle.id)
    assert row["status"] == "COMPLETED", row
    second = row["attempt"]
    assert row["result"] == {"ok": {"total": 321, "attempt": second}}
    assert [runs(db, f"{tok}:{s}") for s in ("one", "two", "three")] == [1, 2, 1]
    assert [(s.name, s.attempt) for s in handle.info().steps] == [
        ("one", first),
        ("two", second),
        ("three", second),
    ]


def test_a_workflow_step_retried_from_scratch_runs_its_task_steps_again(
    steps: ModuleType, db: Conn, workers: WorkerFactory
) -> None:
    """A workflow node whose task records two steps, then fails: its workflow fails; retried
    by hand it reopens, and its task resumes after its steps (or runs them again)."""
    workers.start(APP, *SYNC_ONLY)
    flows = []
    for _ in range(2):
        tok = token()
        flow = steps.app.workflow(
            "steps-node", [steps.steps_then_fail.node(args=(tok,), name="only")]
        ).start()
        ended_as = flow.get(timeout=WAIT)
        assert ended_as.err is not None and ended_as.err.code == "WORKFLOW_FAILED", ended_as
        flows.append((flow, tok))
    (kept, kept_tok), (scratch, scratch_tok) = flows

    answer = kept.task("only").retry(by="test")
    assert answer.retried and answer.reason.startswith("retried: PENDING as a new attempt; step 'only'")
    answer = scratch.task("only").retry(by="test", from_scratch=True)
    assert answer.retried and answer.reason.startswith(
        "retried from scratch: PENDING as a new attempt, its recorded steps deleted; step 'only'"
    ), answer.reason
    for flow, _ in flows:
        result = flow.get(timeout=WAIT)
        assert result.is_ok and result.ok == {"one": 1, "wide": 1000}, result
    assert counts(db, kept_tok) == [1, 1, 2]
    assert counts(db, scratch_tok) == [2, 2, 2]


# -- the dashboard ----------------------------------------------------------------------------


def serve(broker: Any, token: str) -> DashboardServer:
    server = DashboardServer(("127.0.0.1", 0), broker, RecoveryConfig(), token=token)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def call(server: DashboardServer, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_dashboard_lists_the_steps_and_retries_from_scratch(
    steps: ModuleType, db: Conn, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    workers.start(APP, *SYNC_ONLY)
    handle, tok = failed(steps, db)
    (attempt,) = attempt_rows(db, handle.id)
    secret = "steps-" + token()
    server = serve(steps.app.broker, secret)
    try:
        code, page = call(server, f"api/tasks/{handle.id}")
        assert code == 200, page
        assert [(s["name"], s["occurrence"], s["attempt"], s["size"]) for s in page["steps"]] == [
            ("one", 0, attempt["attempt"], 1),
            ("wide", 0, attempt["attempt"], WIDE),
        ]
        assert page["steps_total"] == 2 and "steps" not in page["task"]
        monkeypatch.setattr(api, "STEPS_SHOWN", 1)  # a long loop's steps: the first ones, and how many
        code, page = call(server, f"api/tasks/{handle.id}")
        assert [s["name"] for s in page["steps"]] == ["one"] and page["steps_total"] == 2

        code, answer = call(
            server, "api/actions/retry-task", {"task_id": str(handle.id), "from_scratch": "yes"}, secret
        )
        assert (code, answer) == (400, {"error": "from_scratch must be true or false"})
        code, answer = call(server, "api/actions/retry-tasks", {"dry_run": False, "from_scratch": 1}, secret)
        assert (code, answer) == (400, {"error": "from_scratch must be true or false"})
        assert task_row(db, handle.id)["status"] == "FAILED" and step_rows(db, handle.id) == 2

        assert steps.app.pause_queue("default", by="test")
        code, answer = call(
            server, "api/actions/retry-task", {"task_id": str(handle.id), "from_scratch": True}, secret
        )
        assert code == 200 and answer["ok"], answer
        assert "retried from scratch" in answer["message"], answer
        assert task_row(db, handle.id)["status"] == "PENDING" and step_rows(db, handle.id) == 0
    finally:
        server.shutdown()
        server.server_close()
    assert steps.app.resume_queue("default", by="test")
    assert ended(db, handle.id)["status"] == "COMPLETED"
    assert counts(db, tok) == [2, 2, 2]
