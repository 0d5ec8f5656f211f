"""`tether dashboard`: the page and its JSON, read from a real database with a real worker."""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from tests.conftest import REPO, WorkerFactory
from tether import PostgresConfig, RecoveryConfig
from tether.broker import PostgresBroker
from tether.periodic import sync_declared
from tether.web import dashboard
from tether.web.auth import TokenError, is_loopback, read_token
from tether.web.dashboard import DashboardServer

WAIT = 30.0


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def serve(
    broker: PostgresBroker, token: str | None = None, *, private_reads: bool = False
) -> DashboardServer:
    server = DashboardServer(
        ("127.0.0.1", 0), broker, RecoveryConfig(), token=token, private_reads=private_reads
    )
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
        assert b"<title>tether dashboard</title>" in page and b'src="static/main.js"' in page
        # Only this server's own files run: no inline script or style, no frames.
        csp = headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert headers["X-Frame-Options"] == "DENY"
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
            assert b'id: "schedules"' in server.static["overview.js"][1]  # the overview's table
        finally:
            server.shutdown()
            server.server_close()
    finally:
        basic.app.schedules.clear()


@pytest.mark.server_agnostic
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
        assert fresh["counts"] == [{"queue": "low", "status": "PENDING", "n": 1, "estimated": False}]
        assert fresh["generated_at"] > json.loads(first)["generated_at"]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.server_agnostic
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


@pytest.mark.server_agnostic
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


@pytest.mark.server_agnostic
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


# -- the page's files --------------------------------------------------------------------------


@pytest.mark.server_agnostic
def test_the_scripts_set_text_never_html(basic: ModuleType) -> None:
    server = serve(basic.app.broker)
    try:
        names = sorted(server.static)
        assert "main.js" in names and "dashboard.css" in names
        for name in names:
            code, headers, body = get(server.url + "static/" + name)
            assert code == 200 and body == server.static[name][1]
            assert headers["Content-Type"].startswith(
                "text/javascript" if name.endswith(".js") else "text/css"
            )
            for sink in (b"innerHTML", b"outerHTML", b"insertAdjacentHTML", b"document.write", b"eval("):
                assert sink not in body, (name, sink)  # values are set as text, never parsed as HTML
        assert get(server.url + "static/nope.js")[0] == 404
        assert get(server.url + "static/../dashboard.py")[0] == 404
    finally:
        server.shutdown()
        server.server_close()


# -- the read endpoints --------------------------------------------------------------------------


def api(server: DashboardServer, path: str) -> tuple[int, Any]:
    code, _, body = get(server.url + path)
    return code, json.loads(body)


def test_the_task_list_filters_and_pages_by_keyset(basic: ModuleType, db: psycopg.Connection[Any]) -> None:
    handles = [basic.add.send(n, n) for n in range(5)]
    parked = [basic.add.with_options(queue="low").send(9, 9) for _ in range(2)]
    failed = basic.fail.send("BOOM")
    db.execute(
        "UPDATE tether_tasks SET status = 'FAILED', error_code = 'BOOM', failed_at = now() WHERE id = %s",
        (failed.id,),
    )
    newest_first = sorted((str(h.id) for h in [*handles, *parked, failed]), reverse=True)
    server = serve(basic.app.broker)
    try:
        seen: list[str] = []
        cursor = ""
        for size in (3, 3, 2):
            code, page = api(server, "api/tasks?limit=3" + (f"&before={cursor}" if cursor else ""))
            assert code == 200 and len(page["tasks"]) == size
            seen += [t["id"] for t in page["tasks"]]
            cursor = page["next"]
        assert cursor is None and seen == newest_first

        _, page = api(server, "api/tasks?queue=low")
        assert sorted(t["id"] for t in page["tasks"]) == sorted(str(h.id) for h in parked)
        _, page = api(server, "api/tasks?status=FAILED&error_code=BOOM")
        [row] = page["tasks"]
        assert (row["id"], row["name"], row["status"]) == (str(failed.id), "fail", "FAILED")
        _, page = api(server, "api/tasks?status=pending,failed&name=fail")
        assert [t["id"] for t in page["tasks"]] == [str(failed.id)]
        _, page = api(server, "api/tasks?status=COMPLETED")
        assert page == {"tasks": [], "next": None, "searched_to": None, "scan": 20_000}

        # The time range is the time each id was made (UUIDv7): all of them are from the last minute.
        since = quote((datetime.now(UTC) - timedelta(minutes=1)).isoformat())
        assert len(api(server, f"api/tasks?since={since}")[1]["tasks"]) == 8
        assert api(server, f"api/tasks?until={since}")[1]["tasks"] == []

        for bad, says in [
            ("status=DONE", "status 'DONE' is not one of"),
            ("before=xyz", "before 'xyz' is not a UUID"),
            ("limit=0", "limit must be from 1 to 200"),
            ("since=2024-01-01T00:00", "has no time zone"),
            ("since=2024-01-02T00:00Z&until=2024-01-01T00:00Z", "since must be before until"),
        ]:
            code, answer = api(server, "api/tasks?" + bad)
            assert code == 400 and says in answer["error"], (bad, answer)
    finally:
        server.shutdown()
        server.server_close()


def test_one_task_with_its_attempts_heartbeats_and_workflow(
    basic: ModuleType, workers: WorkerFactory
) -> None:
    workers.start("tests.apps.basic:app", "--queues", "default", "--processes", "1")
    handle = basic.boom.send("kaput")
    assert handle.get(timeout=WAIT).err.code == "UNHANDLED_EXCEPTION"
    server = serve(basic.app.broker)
    try:
        code, shown = api(server, f"api/tasks/{handle.id}")
        assert code == 200
        task = shown["task"]
        assert (task["id"], task["status"], task["args"]) == (str(handle.id), "FAILED", ["kaput"])
        assert "RuntimeError: kaput" in task["result"]["err"]["data"]["traceback"]
        assert task["workflow_id"] is None and task["cancel_requested_at"] is None
        [attempt] = shown["attempts"]
        assert (attempt["attempt"], attempt["outcome"], attempt["error_code"]) == (
            1,
            "FAILED",
            "UNHANDLED_EXCEPTION",
        )
        assert isinstance(shown["heartbeats"], list)

        assert api(server, f"api/tasks/{uuid.uuid4()}")[0] == 404
        assert api(server, "api/tasks/not-a-uuid") == (400, {"error": "task id 'not-a-uuid' is not a UUID"})
        assert api(server, f"api/workflows/{uuid.uuid4()}")[0] == 404
        code, listing = api(server, "api/workers?all=1")
        assert code == 200 and len(listing["workers"]) == 1 and listing["in_flight"] == []
    finally:
        server.shutdown()
        server.server_close()


# -- actions: POST only, with the token in a header --------------------------------------------------


def post(
    server: DashboardServer,
    path: str,
    body: Any = None,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    content_type: str = "application/json",
) -> tuple[int, dict[str, str], Any]:
    sent = {"Content-Type": content_type, **(headers or {})}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(server.url + path, data=data, headers=sent, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=WAIT) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


@pytest.mark.server_agnostic
def test_an_action_without_the_right_token_changes_nothing(
    basic: ModuleType, db: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tether")
    token = "s3cret-" + uuid.uuid4().hex
    parked = basic.add.with_options(queue="low").send(1, 2)  # PENDING: a cancel would end it
    cancel = {"task_id": str(parked.id)}
    server = serve(basic.app.broker, token)
    read_only = serve(basic.app.broker)
    try:
        code, headers, answer = post(server, "api/actions/cancel-task", cancel)
        assert code == 401 and "needs the dashboard token" in answer["error"]
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert post(server, "api/actions/cancel-task", cancel, token="wrong")[0] == 403
        assert post(server, "api/actions/cancel-task", cancel, headers={"X-Tether-Token": "wrong"})[0] == 403
        # The right token from a page of another site: refused (a cross-site request).
        code, _, answer = post(server, "api/actions/cancel-task", cancel, token=token,
                               headers={"Origin": "http://evil.example"})  # fmt: skip
        assert code == 403 and "another site" in answer["error"]
        # A form post (not JSON) is refused, and a GET never acts.
        assert (
            post(server, "api/actions/cancel-task", cancel, token=token, content_type="text/plain")[0] == 415
        )
        assert get(server.url + "api/actions/cancel-task")[0] == 404
        # Without a token the dashboard is read-only: even the right one is refused.
        code, _, answer = post(read_only, "api/actions/cancel-task", cancel, token=token)
        assert (
            code == 403 and answer["error"] == "read-only: start with --token / TETHER_DASHBOARD_TOKEN to act"
        )
        assert read_only.access.can_act is False and api(read_only, "api/meta")[1]["can_act"] is False
        assert parked.status().value == "PENDING"  # nothing above changed anything

        origin = server.url.rstrip("/")
        assert post(server, "api/auth/check", token=token, headers={"Origin": origin})[0] == 200
        code, _, answer = post(server, "api/actions/cancel-task", cancel, headers={"X-Tether-Token": token})
        assert code == 200 and answer["changed"] is True and answer["reply"] == "cancelled"
        assert parked.status().value == "CANCELLED"
        code, _, answer = post(server, "api/actions/cancel-task", cancel, token=token)
        assert code == 200 and answer["changed"] is False and answer["reply"] == "already_ended"
        code, _, answer = post(server, "api/actions/cancel-task", {"task_id": "nope"}, token=token)
        assert code == 400 and answer["error"] == "task_id 'nope' is not a UUID"
        assert post(server, "api/actions/cancel-task", {"task_id": str(uuid.uuid4())}, token=token)[0] == 404
        assert post(server, "api/actions/format-disk", {}, token=token)[0] == 404
    finally:
        for s in (server, read_only):
            s.shutdown()
            s.server_close()
    logged = caplog.text
    assert (
        f"dashboard action cancel-task on task {parked.id} from 127.0.0.1: task {parked.id} cancelled"
        in logged
    )
    assert "dashboard refused cancel-task from 127.0.0.1: wrong dashboard token" in logged
    assert token not in logged  # never logged, not even at DEBUG


def test_queue_and_workflow_actions_and_a_bulk_dry_run(
    basic: ModuleType, db: psycopg.Connection[Any]
) -> None:
    token = "t0ken-" + uuid.uuid4().hex
    failed = basic.fail.send("BOOM")
    db.execute(
        "UPDATE tether_tasks SET status = 'FAILED', error_code = 'BOOM', failed_at = now(),"
        ' result = \'{"err": {"code": "BOOM", "message": "m", "data": null}}\' WHERE id = %s',
        (failed.id,),
    )
    server = serve(basic.app.broker, token)
    try:
        code, _, answer = post(server, "api/actions/pause-queue", {"queue": "low"}, token=token)
        assert (code, answer["changed"], answer["message"]) == (200, True, "queue low paused")
        [low] = [q for q in api(server, "api/queues")[1]["queues"] if q["queue"] == "low"]
        assert low["paused"] is True and low["paused_by"] == "dashboard:127.0.0.1"
        assert post(server, "api/actions/pause-queue", {"queue": "low"}, token=token)[2]["changed"] is False
        assert post(server, "api/actions/resume-queue", {"queue": "low"}, token=token)[2]["changed"] is True
        code, _, answer = post(server, "api/actions/pause-queue", {"queue": "no spaces"}, token=token)
        assert code == 400 and answer["error"].startswith("queue must be a queue name: ")

        code, _, answer = post(
            server,
            "api/actions/retry-tasks",
            {"filter": {"error_code": "BOOM"}, "dry_run": True},
            token=token,
        )
        assert code == 200 and (answer["matched"], answer["retried"], answer["dry_run"]) == (1, 0, True)
        assert [s["id"] for s in answer["sample"]] == [str(failed.id)]
        assert failed.status().value == "FAILED"
        code, _, answer = post(server, "api/actions/retry-task", {"task_id": str(failed.id)}, token=token)
        assert code == 200 and answer["retried"] is True and failed.status().value == "PENDING"
        assert answer["message"] == f"task {failed.id} retried: PENDING as a new attempt"
        code, _, answer = post(server, "api/actions/retry-task", {"task_id": str(failed.id)}, token=token)
        assert code == 200 and answer["changed"] is False
        assert answer["message"].startswith(f"task {failed.id} not retried: it is PENDING")

        wid = str(uuid.uuid4())
        code, _, answer = post(server, "api/actions/cancel-workflow", {"workflow_id": wid}, token=token)
        assert code == 200 and answer["changed"] is False
    finally:
        server.shutdown()
        server.server_close()


def test_actions_check_names_as_the_api_does(basic: ModuleType, db: psycopg.Connection[Any]) -> None:
    """A malformed queue or task name is refused (400, naming it) and changes nothing; who asks
    is the dashboard's to say (``dashboard:<client address>``), never the request body's."""
    token = "n4mes-" + uuid.uuid4().hex
    failed = basic.fail.send("BOOM")
    pending = basic.add.send(1, 2)
    db.execute("UPDATE tether_tasks SET status = 'FAILED', failed_at = now() WHERE id = %s", (failed.id,))
    before = db.execute("SELECT * FROM tether_tasks ORDER BY id").fetchall()
    server = serve(basic.app.broker, token)
    try:
        for queue in ("", "has space", "images\n", "x" * 65, 5, None):
            for action in ("pause-queue", "resume-queue"):
                code, _, answer = post(server, f"api/actions/{action}", {"queue": queue}, token=token)
                assert code == 400, (action, queue, answer)
                assert answer["error"].startswith("queue must be a queue name: 1 to 64 characters"), answer
        for field, value, rule in (
            ("queue", "has space", "filter.queue must be a queue name"),
            ("name", "9lives", "filter.name must be a task name"),
            ("name", "semi;colon", "filter.name must be a task name"),
        ):
            for dry_run in (True, False):
                body = {"filter": {field: value}, "dry_run": dry_run}
                code, _, answer = post(server, "api/actions/retry-tasks", body, token=token)
                assert code == 400 and answer["error"].startswith(rule), answer
        assert db.execute("SELECT * FROM tether_tasks ORDER BY id").fetchall() == before
        assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}

        forged = {"task_id": str(pending.id), "by": "admin\nINFO tether: forged"}
        code, _, answer = post(server, "api/actions/cancel-task", forged, token=token)
        assert code == 200 and answer["reply"] == "cancelled"
        row = db.execute(
            "SELECT cancel_requested_by FROM tether_tasks WHERE id = %s", (pending.id,)
        ).fetchone()
        assert row == {"cancel_requested_by": "dashboard:127.0.0.1"}
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.server_agnostic
def test_private_reads_need_the_token_too(basic: ModuleType) -> None:
    token = "r3ad-" + uuid.uuid4().hex
    handle = basic.add.with_options(queue="low").send(1, 2)
    with pytest.raises(TokenError, match="needs a token"):
        serve(basic.app.broker, private_reads=True)
    server = serve(basic.app.broker, token, private_reads=True)
    try:
        for path in ("api/status", "api/tasks", f"api/tasks/{handle.id}", "api/queues", "api/workers"):
            code, headers, _ = get(server.url + path)
            assert code == 401 and headers["WWW-Authenticate"].startswith("Bearer"), path
            request = urllib.request.Request(server.url + path, headers={"Authorization": "Bearer wrong"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=WAIT)
            assert refused.value.code == 403
            request = urllib.request.Request(server.url + path, headers={"X-Tether-Token": token})
            with urllib.request.urlopen(request, timeout=WAIT) as response:
                assert response.status == 200, path
        # The page, its files and what the page needs to know to ask for the token stay open.
        assert get(server.url)[0] == 200 and get(server.url + "static/main.js")[0] == 200
        code, meta = api(server, "api/meta")
        assert code == 200 and meta["reads_need_token"] is True and meta["can_act"] is True
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.server_agnostic
def test_the_token_comes_from_one_place_and_a_public_address_needs_one(tmp_path: Path) -> None:
    file = tmp_path / "token"
    file.write_text("from-a-file\n")
    assert read_token(None, file) == "from-a-file"
    assert read_token(" spaced ", None) == "spaced" and read_token(None, None) is None
    for token, token_file, says in [
        ("a", file, "not both"),
        ("  ", None, "empty"),
        (None, tmp_path / "missing", "cannot read the token file"),
        ("tab\there", None, "printable ASCII"),
    ]:
        with pytest.raises(TokenError, match=says):
            read_token(token, token_file)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("192.0.2.7")


@pytest.mark.server_agnostic
def test_the_command_refuses_a_public_address_without_a_token(database_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TETHER_DASHBOARD_TOKEN"}
    command = [sys.executable, "-m", "tether", "dashboard", "--host", "0.0.0.0", "--port", "0"]
    done = subprocess.run(
        [*command, "--database-url", database_url],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=WAIT,
    )
    assert done.returncode != 0
    assert "refusing to listen on '0.0.0.0' without a token" in done.stderr

    file = tmp_path / "token"
    file.write_text("a-token-from-a-file\n")
    process = subprocess.Popen(
        [*command, "--token-file", str(file), "--database-url", database_url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("tether dashboard on http://0.0.0.0:")
        assert process.stdout.readline().startswith(
            "actions enabled; beyond loopback, reading needs the token"
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=WAIT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# -- the Host header (DNS rebinding) -----------------------------------------------------------


class Dashboard:
    """A real `tether dashboard` process, on a free port; stopped with SIGTERM at the end."""

    def __init__(self, database_url: str, *args: str, token: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TETHER_DASHBOARD_TOKEN"}
        if token is not None:
            env["TETHER_DASHBOARD_TOKEN"] = token
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tether",
                "dashboard",
                "--port",
                "0",
                "--database-url",
                database_url,
                *args,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "PYTHONUNBUFFERED": "1"},
        )
        assert self.process.stdout is not None and self.process.stderr is not None
        line = self.process.stdout.readline()
        assert line.startswith("tether dashboard on http://"), line + self.process.stderr.read()
        self.port = int(line.split(" on ", 1)[1].split(" ", 1)[0].rstrip("/").rsplit(":", 1)[1])

    def request(
        self,
        method: str,
        path: str,
        hosts: list[str],
        headers: dict[str, str] | None = None,
        body: Any = None,
    ) -> tuple[int, bytes]:
        """One request to 127.0.0.1:<port> carrying exactly the Host headers ``hosts``."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT)
        try:
            connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for host in hosts:
                connection.putheader("Host", host)
            data = b"" if body is None else json.dumps(body).encode()
            for key, value in {**(headers or {}), "Content-Length": str(len(data))}.items():
                connection.putheader(key, value)
            connection.endheaders(data)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def stop(self) -> str:
        """Stop it (SIGTERM); its log (stderr)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            assert self.process.wait(timeout=WAIT) == 0
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
        assert self.process.stderr is not None
        return self.process.stderr.read()


@pytest.mark.server_agnostic
def test_a_loopback_dashboard_answers_only_requests_that_name_it(
    basic: ModuleType, database_url: str, db: psycopg.Connection[Any]
) -> None:
    """A page that points its own name at 127.0.0.1 (DNS rebinding) sends requests with its
    name in Host, and an Origin to match: refused whatever the path, nothing read or changed."""
    token = "r3bind-" + uuid.uuid4().hex
    handle = basic.add.send(40, 2)
    dashboard = Dashboard(database_url, token=token)
    try:
        port = dashboard.port
        secret = {"Authorization": f"Bearer {token}"}
        for host in [
            f"evil.example:{port}",
            "evil.example",
            f"127.0.0.1.evil.example:{port}",
            f"localhost.evil.example:{port}",
            f"192.0.2.7:{port}",
            f"localhost:{port}@evil.example",
            "",
        ]:
            for path in [
                "/",
                "/static/main.js",
                "/api/meta",
                "/api/status",
                "/api/tasks",
                f"/api/tasks/{handle.id}",
            ]:
                code, body = dashboard.request("GET", path, [host], secret)
                assert code == 421, (host, path, code, body)
                error = json.loads(body)["error"]
                assert "DNS rebinding" in error and "--allowed-host" in error, error
                assert str(handle.id) not in body.decode(), (host, path)
            origin = {"Origin": f"http://{host}", "Content-Type": "application/json", **secret}
            code, body = dashboard.request(
                "POST", "/api/actions/pause-queue", [host], origin, {"queue": "default"}
            )
            assert code == 421, (host, code, body)
            code, _ = dashboard.request(
                "POST", "/api/actions/cancel-task", [host], origin, {"task_id": str(handle.id)}
            )
            assert code == 421
        assert db.execute("SELECT count(*) AS n FROM tether_paused_queues").fetchone() == {"n": 0}
        assert basic.app.handle(handle.id).status() == "PENDING"
        # No Host at all, or two: a request no browser sends.
        assert dashboard.request("GET", "/api/tasks", [], secret)[0] == 400
        assert dashboard.request("GET", "/api/tasks", [f"127.0.0.1:{port}", "evil.example"], secret)[0] == 400

        # The names a browser on this machine (or through an SSH tunnel's port) sends.
        for host in [
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            f"[::1]:{port}",
            "LocalHost",
            "127.0.0.1:9000",
        ]:
            code, body = dashboard.request("GET", "/api/tasks", [host])
            assert code == 200 and str(handle.id) in body.decode(), (host, code, body)
        code, body = dashboard.request(
            "POST",
            "/api/actions/pause-queue",
            [f"localhost:{port}"],
            {"Origin": f"http://localhost:{port}", "Content-Type": "application/json", **secret},
            {"queue": "default"},
        )
        assert code == 200 and json.loads(body)["changed"] is True, body
    finally:
        log = dashboard.stop()
    assert (
        "dashboard refused GET /api/tasks from 127.0.0.1: this dashboard does not answer to the Host" in log
    )


@pytest.mark.server_agnostic
def test_allowed_hosts_add_names_and_beyond_loopback_any_host_needs_the_token(
    basic: ModuleType, database_url: str
) -> None:
    token = "pr0xy-" + uuid.uuid4().hex
    secret = {"X-Tether-Token": token}
    dashboard = Dashboard(database_url, "--allowed-host", "Dash.Example", "--allowed-host", "[2001:db8::5]")
    try:
        for host in ["dash.example", "dash.example:443", "[2001:db8::5]:8443", f"127.0.0.1:{dashboard.port}"]:
            assert dashboard.request("GET", "/api/status", [host])[0] == 200, host
        assert dashboard.request("GET", "/api/status", ["other.example"])[0] == 421
    finally:
        dashboard.stop()

    # Beyond loopback the token guards every read: any Host is answered, and only with it.
    dashboard = Dashboard(database_url, "--host", "0.0.0.0", token=token)
    try:
        assert dashboard.request("GET", "/api/status", ["dash.example"], secret)[0] == 200
        assert dashboard.request("GET", "/api/status", ["dash.example"])[0] == 401
    finally:
        dashboard.stop()
    # ... unless names are given: then only those, loopback names and the listening address.
    dashboard = Dashboard(database_url, "--host", "0.0.0.0", "--allowed-host", "dash.example", token=token)
    try:
        assert dashboard.request("GET", "/api/status", ["dash.example:8080"], secret)[0] == 200
        assert dashboard.request("GET", "/api/status", ["localhost"], secret)[0] == 200
        assert dashboard.request("GET", "/api/status", ["other.example"], secret)[0] == 421
    finally:
        dashboard.stop()

    for bad in ["http://dash.example/", "dash.example:8080", "*.example", ""]:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tether",
                "dashboard",
                "--allowed-host",
                bad,
                "--database-url",
                database_url,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
        assert done.returncode != 0 and f"--allowed-host {bad!r} is not a host name" in done.stderr, (
            done.stderr
        )


def test_the_queues_page_shows_limits_with_their_use(basic: ModuleType, db: psycopg.Connection[Any]) -> None:
    db.execute("INSERT INTO tether_queue_limits (queue, max_in_flight, per_key) VALUES ('low', 4, 2)")
    task = basic.sleep.with_options(queue="low", concurrency_key="tenant-1").send(0)
    db.execute("UPDATE tether_tasks SET status = 'RUNNING' WHERE id = %s", (task.id,))
    server = serve(basic.app.broker)
    try:
        code, answer = api(server, "api/queues")
    finally:
        server.shutdown()
        server.server_close()
    assert code == 200
    [low] = answer["limits"]
    assert (low["queue"], low["max_in_flight"], low["per_key"], low["in_flight"]) == ("low", 4, 2, 1)
    assert (low["busiest_key_in_flight"], low["keys_at_limit"], low["rate_limit"]) == (1, 0, None)
