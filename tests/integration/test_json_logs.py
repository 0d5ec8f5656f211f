"""A real worker writing JSON log lines (`--log-format json`, or TETHER_LOG_FORMAT=json): every
line of its processes parses, and every line about a task carries the task's id, attempt,
queue and name, and the worker's id, whether the worker's main process wrote it (a crash),
its child (a failure), or the task's own code (its logger, in a sync or an async child)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.apps.support import load_app_module, task_row
from tests.conftest import REPO, WorkerFactory, WorkerProcess, wait_until

APP = "tests.apps.logs:app"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "EXPIRED"}


@pytest.fixture
def logs(database_url: str, db: psycopg.Connection[Any]) -> ModuleType:
    return load_app_module("logs", database_url)


def json_lines(worker: WorkerProcess) -> list[dict[str, Any]]:
    """Every line the worker's processes wrote, each parsed: one that is not a JSON object fails."""
    lines = [line for line in worker.log().splitlines() if line.strip()]
    assert lines, "the worker wrote nothing"
    parsed = []
    for line in lines:
        entry = json.loads(line)
        assert isinstance(entry, dict), line
        parsed.append(entry)
    return parsed


def about(entries: list[dict[str, Any]], task_id: Any) -> list[dict[str, Any]]:
    return [e for e in entries if e.get("task_id") == str(task_id)]


def ended(db: psycopg.Connection[Any], handles: list[Any]) -> bool:
    return all(task_row(db, h.id)["status"] in TERMINAL for h in handles)


def assert_task_fields(entry: dict[str, Any], handle: Any, name: str, queue: str, worker_id: str) -> None:
    assert entry["task_id"] == str(handle.id), entry
    assert entry["attempt"] == 1, entry
    assert entry["task_name"] == name, entry
    assert entry["queue"] == queue, entry
    assert entry["worker_id"] == worker_id, entry


def test_a_worker_s_lines_are_json_objects_with_the_task_fields_on_every_task_line(
    logs: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(APP, "--processes", "1", "--log-format", "json")
    me = worker.worker_id
    assert me is not None
    said = logs.say.with_options(queue="loud").send("hello")
    failed = logs.fail.send("line one")
    died = logs.die.send()
    wait_until(lambda: ended(db, [said, failed, died]), message="the three tasks to end")
    worker.stop()
    entries = json_lines(worker)

    for e in entries:
        # Every line: when (UTC, ISO 8601), how bad, who, what, and the worker it belongs to.
        at = datetime.fromisoformat(e["timestamp"])
        assert at.utcoffset() == timedelta(0), e
        assert e["level"] in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}, e
        assert e["logger"] and isinstance(e["message"], str), e
        assert e["worker_id"] == me, e
        assert isinstance(e["pid"], int), e
    started = [e for e in entries if e["message"].startswith(f"worker {me} started: queues=")]
    assert len(started) == 1 and started[0]["pid"] == worker.pid and "task_id" not in started[0]

    # The task's own line, from its child (another process), with its task's fields.
    (spoken,) = [e for e in about(entries, said.id) if e["logger"] == "tests.apps.logs"]
    assert spoken["message"] == "the task says hello" and spoken["level"] == "INFO"
    assert spoken["pid"] != worker.pid
    assert_task_fields(spoken, said, "say", "loud", me)

    # A failure, said by the child that ran it.
    (raised,) = about(entries, failed.id)
    assert raised["logger"] == "tether.worker.execute" and "raised ValueError" in raised["message"]
    assert_task_fields(raised, failed, "fail", "default", me)
    assert task_row(db, failed.id)["error_code"] == "UNHANDLED_EXCEPTION"

    # A crash, said by the main process: the child's exit and what became of its task.
    crash = about(entries, died.id)
    assert {e["level"] for e in crash} == {"ERROR", "WARNING"}, crash
    assert all(e["pid"] == worker.pid and e["logger"] == "tether.worker.dispatch" for e in crash)
    assert any("exited with code 7 holding 1 task(s)" in e["message"] for e in crash), crash
    assert any("FAILED with WORKER_CRASHED" in e["message"] for e in crash), crash
    for e in crash:
        assert_task_fields(e, died, "die", "default", me)
    assert task_row(db, died.id)["error_code"] == "WORKER_CRASHED"


def test_tether_log_format_json_reaches_an_async_child_whose_overlapping_tasks_each_log_as_themselves(
    logs: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    worker = workers.start(
        APP, "--processes", "1", "--async-processes", "1", env={"TETHER_LOG_FORMAT": "json"}
    )
    me = worker.worker_id
    assert me is not None
    first, second = logs.say_async.send_many([("first", 2.0), ("second", 2.0)])
    wait_until(lambda: ended(db, [first, second]), message="both async tasks to end")
    worker.stop()
    entries = json_lines(worker)

    spoken = [e for e in entries if e["logger"] == "tests.apps.logs"]
    assert len(spoken) == 4, spoken
    for handle, words in ((first, "first"), (second, "second")):
        mine = about(spoken, handle.id)
        assert [e["message"] for e in mine] == [f"before the pause: {words}", f"after the pause: {words}"]
        for e in mine:
            assert_task_fields(e, handle, "say_async", "default", me)
            assert e["process_name"].startswith("tether-async-child"), e
    # They overlapped in the one async child: each line still names its own task.
    assert len({e["pid"] for e in spoken}) == 1
    order = [e["message"] for e in spoken]
    assert order.index("before the pause: second") < order.index("after the pause: first"), order


def tether(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tether", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.server_agnostic
def test_a_bad_log_format_is_refused_naming_the_option_or_the_setting(database_url: str) -> None:
    for args in (
        ["worker", APP, "--log-format", "xml"],
        ["dashboard", "--log-format", "xml"],
        ["--log-format", "xml", "status"],
    ):
        done = tether(*args)
        assert done.returncode == 2 and done.stdout == "", done
        assert "Invalid value for '--log-format': 'xml' is not one of 'human', 'json'" in done.stderr, done
    done = tether("status", "--database-url", database_url, env={"TETHER_LOG_FORMAT": "xml"})
    assert done.returncode == 1 and done.stdout == "", done
    assert "log format (TETHER_LOG_FORMAT) must be one of human, json, got 'xml'" in done.stderr, done


@pytest.mark.server_agnostic
def test_the_dashboard_logs_json_when_asked(database_url: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "tether", "dashboard", "--port", "0", "--log-format", "json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TETHER_DATABASE_URL": database_url},
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        line = process.stdout.readline()
        assert line.startswith("tether dashboard on http://127.0.0.1:"), line + process.stderr.read()
        port = int(line.split(" on ", 1)[1].split(" ", 1)[0].rstrip("/").rsplit(":", 1)[1])
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.putrequest("GET", "/api/status", skip_host=True)
        connection.putheader("Host", "elsewhere.example")  # refused, and the refusal is logged
        connection.endheaders()
        assert connection.getresponse().status == 421
        connection.close()
        process.terminate()
        assert process.wait(timeout=30) == 0
        lines = [json.loads(text) for text in process.stderr.read().splitlines() if text.strip()]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    (refused,) = [e for e in lines if "refused GET /api/status" in e["message"]]
    assert (refused["level"], refused["logger"]) == ("WARNING", "tether.web")
    assert "elsewhere.example" in refused["message"] and "task_id" not in refused
