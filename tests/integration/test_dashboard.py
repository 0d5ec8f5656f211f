"""`tether dashboard`: the page and its JSON, read from a real database with a real worker."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.conftest import REPO, WorkerFactory
from tether import PostgresConfig, RecoveryConfig
from tether.broker import PostgresBroker
from tether.periodic import sync_declared
from tether.web import dashboard
from tether.web.dashboard import DashboardServer

WAIT = 30.0


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def serve(broker: PostgresBroker) -> DashboardServer:
    server = DashboardServer(("127.0.0.1", 0), broker, RecoveryConfig())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_status_json_shows_queues_workers_and_failures(basic: ModuleType, workers: WorkerFactory) -> None:
    worker = workers.start("tests.apps.basic:app", "--queues", "default", "--processes", "1")
    for _ in range(3):
        basic.add.with_options(queue="low").send(1, 2)  # nobody serves `low`: stays PENDING
    failed = basic.fail.send("BOOM", "the <b>message</b> & more")
    assert failed.get(timeout=WAIT).err.code == "BOOM"

    server = serve(basic.app.broker)
    try:
        code, headers, body = get(server.url + "api/status")
        assert code == 200 and headers["Content-Type"] == "application/json"
        status = json.loads(body)
        counts = {(c["queue"], c["status"]): c["n"] for c in status["counts"]}
        assert counts == {("low", "PENDING"): 3, ("default", "FAILED"): 1}
        assert [w["id"] for w in status["workers"]] == [worker.worker_id]
        assert status["stale_tasks"] == [] and status["running_stale_threshold_s"] == 300
        [failure] = status["recent_failures"]
        assert (failure["id"], failure["name"], failure["error_code"]) == (str(failed.id), "fail", "BOOM")
        assert failure["error_message"] == "the <b>message</b> & more"  # data, shipped as data

        code, headers, page = get(server.url)
        assert code == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        assert b"<title>tether dashboard</title>" in page and b"api/status" in page
        assert b"innerHTML" not in page  # values are set as text, never parsed as HTML
        assert "script-src 'unsafe-inline'" in headers["Content-Security-Policy"]
        assert get(server.url + "nope")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


def test_the_status_json_lists_the_schedules(basic: ModuleType) -> None:
    schedule = basic.app.periodic(
        "*/5 * * * *", basic.add, name="add-5m", args=(1, 2), timezone="Europe/Berlin"
    )
    try:
        with basic.app.broker.connection() as conn:
            sync_declared(conn, [schedule], ["default"])  # what a starting worker does
        assert basic.app.pause_schedule("add-5m")
        server = serve(basic.app.broker)
        try:
            [shown] = json.loads(get(server.url + "api/status")[2])["schedules"]
            assert (shown["name"], shown["task_name"], shown["cron"], shown["timezone"]) == (
                "add-5m",
                "add",
                "*/5 * * * *",
                "Europe/Berlin",
            )
            assert shown["paused"] is True and shown["next_slot"] is not None and shown["slots_sent"] == 0
            assert b'id="schedules"' in get(server.url)[2]
        finally:
            server.shutdown()
            server.server_close()
    finally:
        basic.app.schedules.clear()


def test_pages_open_at_once_share_one_read_of_the_database(
    basic: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dashboard, "SNAPSHOT_MAX_AGE_S", 60.0)
    server = serve(basic.app.broker)
    try:
        first = get(server.url + "api/status")[2]
        basic.add.with_options(queue="low").send(1, 2)
        assert get(server.url + "api/status")[2] == first  # the same read, generated_at and all
        monkeypatch.setattr(dashboard, "SNAPSHOT_MAX_AGE_S", 0.0)
        fresh = json.loads(get(server.url + "api/status")[2])
        assert fresh["counts"] == [{"queue": "low", "status": "PENDING", "n": 1}]
        assert fresh["generated_at"] > json.loads(first)["generated_at"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_database_that_went_away_is_a_503_that_names_it() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql://tether:secret@127.0.0.1:{port}/nowhere"
    broker = PostgresBroker(PostgresConfig(database_url=url, connect_timeout_s=1), auto_migrate=False)
    server = serve(broker)
    try:
        code, _, body = get(server.url + "api/status")
        assert code == 503
        error = json.loads(body)["error"]
        assert f"127.0.0.1:{port}/nowhere" in error and "secret" not in error
        assert get(server.url)[0] == 200  # the page itself still loads, and says it cannot read
    finally:
        server.shutdown()
        server.server_close()
        broker.close()


@pytest.mark.parametrize("stop_with", [signal.SIGINT, signal.SIGTERM])
def test_the_command_serves_until_interrupted(
    database_url: str, db: psycopg.Connection[Any], stop_with: signal.Signals
) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "tether", "dashboard", "--port", "0", "--database-url", database_url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert process.stderr is not None
        assert line.startswith("tether dashboard on http://127.0.0.1:"), line + process.stderr.read()
        url = line.split(" on ", 1)[1].split(" ", 1)[0]
        code, _, body = get(url + "api/status")
        assert code == 200 and "counts" in json.loads(body)
        process.send_signal(stop_with)
        assert process.wait(timeout=WAIT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_port_in_use_is_refused_with_a_message(database_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = ["dashboard", "--port", str(port), "--database-url", database_url]
        done = subprocess.run(
            [sys.executable, "-m", "tether", *command],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
