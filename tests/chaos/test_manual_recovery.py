"""What an operator sees and does after a worker is killed with nothing left to recover it.

The only worker is killed -9 (no survivor, so no reaper): ``broker.get_stale_tasks`` lists
its RUNNING tasks as typed rows, the dashboard's recover action (a dry run) says what
recovery would do, and ``tether recover --json`` applies the reaper's rules once, reporting
each task, its action and the silent worker it marked inactive: one manual-recovery function
behind the three doors.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest

from tests.apps.support import task_row
from tests.chaos.conftest import APP, FAST, HEARTBEAT_S, last_heartbeat, runs, token, worker_row
from tests.cli_support import run_json
from tests.conftest import WorkerFactory, wait_until
from tether import RecoveryConfig, StaleTask
from tether.broker import PostgresBroker
from tether.web.dashboard import DashboardServer

DASHBOARD_TOKEN = "recover-test-token"


@contextmanager
def dashboard(broker: PostgresBroker) -> Iterator[DashboardServer]:
    """A dashboard in this process, with the recovery thresholds of the environment (FAST)."""
    server = DashboardServer(("127.0.0.1", 0), broker, RecoveryConfig(), token=DASHBOARD_TOKEN)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def recover_action(server: DashboardServer, *, dry_run: bool) -> dict[str, Any]:
    """POST the dashboard's recover action; its JSON answer."""
    request = urllib.request.Request(
        server.url + "api/actions/recover",
        data=json.dumps({"dry_run": dry_run}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {DASHBOARD_TOKEN}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def test_stale_tasks_of_a_killed_worker_are_listed_then_recovered_by_tether_recover(
    database_url: str, db: Any, chaos: ModuleType, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in FAST.items():  # the in-process CLI reads the same thresholds as the worker
        monkeypatch.setenv(name, value)
    hold, hold_retry = chaos.app.tasks["hold"], chaos.app.tasks["hold_retry"]
    a = workers.start(APP, "--processes", "2", "--prefetch", "1", env=FAST)
    t_fail, t_retry = token(), token()
    fail = hold.send(t_fail, 60)
    retry = hold_retry.send(t_retry, 60, 0)
    claimed = hold.send(token(), 0)  # waits in A's buffer: both children are busy
    wait_until(
        lambda: (
            runs(db, t_fail) == 1
            and runs(db, t_retry) == 1
            and task_row(db, claimed.id)["status"] == "CLAIMED"
            and last_heartbeat(db, fail.id, "runner") is not None
            and last_heartbeat(db, retry.id, "runner") is not None
        ),
        message="A to run two tasks, hold a third CLAIMED, and beat for the running ones",
    )
    a.kill()  # SIGKILL to A's whole process group, by pid

    # Listed once silent past the threshold, with the worker they ran on; nothing changes.
    stale = wait_until(
        lambda: (
            (s := chaos.app.broker.get_stale_tasks_sync(stale_threshold_minutes=1.5 / 60))
            and len(s) == 2
            and s
        ),
        timeout=15,
        message="both RUNNING tasks to be listed as stale",
    )
    assert all(isinstance(t, StaleTask) for t in stale)
    # Earliest start first (then by id). The two children start their tasks at about the same
    # moment, in either order, so the expected order is read from the rows.
    by_start = sorted([fail.id, retry.id], key=lambda i: (task_row(db, i)["started_at"], str(i)))
    assert [t.id for t in stale] == by_start
    for t in stale:
        assert (t.queue, t.attempt, t.worker_id, t.worker_status) == ("default", 1, a.worker_id, "active")
        assert t.worker_pid == a.proc.pid and t.worker_hostname == worker_row(db, a.worker_id)["hostname"]
        assert t.silent_s >= 1.5 and t.started_at is not None and t.last_heartbeat_at is not None
    assert task_row(db, fail.id)["status"] == "RUNNING"

    # A's heartbeat is three intervals old: `tether recover` marks it inactive too.
    wait_until(
        lambda: db.execute(
            "SELECT last_heartbeat_at < now() - make_interval(secs => %s) AS old "
            "FROM tether_workers WHERE id = %s",
            (3 * HEARTBEAT_S + 0.5, a.worker_id),
        ).fetchone()["old"],
        timeout=15,
        message="A's heartbeat to be three intervals old",
    )
    # The dashboard's door, as a dry run: what recovery would do, and nothing changes.
    with dashboard(chaos.app.broker) as server:
        dry = recover_action(server, dry_run=True)
    assert (dry["ok"], dry["changed"], dry["dry_run"]) == (True, False, True)
    assert dry["message"].startswith("dry run: 3 stale task(s) would be recovered")
    assert dry["message"].endswith("; nothing changed")
    assert [(w["id"], w["pid"]) for w in dry["workers_deactivated"]] == [(a.worker_id, a.proc.pid)]
    assert task_row(db, fail.id)["status"] == "RUNNING" and task_row(db, claimed.id)["status"] == "CLAIMED"
    assert worker_row(db, a.worker_id)["status"] == "active"

    done = run_json(
        database_url, "recover", "--claimed-threshold-ms", "1000", "--running-threshold-ms", "1000"
    )
    # The same report from both doors, the same decisions (the CLI's is the real run).
    assert set(dry) - {"ok", "changed", "message"} == set(done)
    assert {t["id"]: t["action"] for t in dry["tasks"]} == {t["id"]: t["action"] for t in done["tasks"]}
    actions = {t["id"]: t for t in done["tasks"]}
    assert set(actions) == {str(fail.id), str(retry.id), str(claimed.id)}
    assert actions[str(fail.id)]["action"] == "FAILED (WORKER_CRASHED)"
    assert actions[str(fail.id)]["retry_delay_s"] is None
    assert actions[str(retry.id)]["action"] == "retry scheduled (WORKER_CRASHED)"
    assert actions[str(retry.id)]["retry_delay_s"] >= 0
    assert actions[str(claimed.id)]["action"] == "requeued (CLAIMED -> PENDING)"
    assert all(t["claimed_by_worker_id"] == a.worker_id and t["attempt"] == 1 for t in done["tasks"])
    assert [(w["id"], w["pid"]) for w in done["workers_deactivated"]] == [(a.worker_id, a.proc.pid)]
    assert done["workers_deactivated"][0]["age_s"] >= 3 * HEARTBEAT_S

    # The rows say the same.
    assert (
        task_row(db, fail.id)["status"] == "FAILED"
        and task_row(db, fail.id)["error_code"] == "WORKER_CRASHED"
    )
    assert task_row(db, retry.id)["status"] == "PENDING" and task_row(db, retry.id)["retry_count"] == 1
    assert task_row(db, claimed.id)["status"] == "PENDING"
    assert worker_row(db, a.worker_id)["status"] == "inactive"
    assert chaos.app.broker.get_stale_tasks_sync(stale_threshold_minutes=1 / 60) == []
    with dashboard(chaos.app.broker) as server:
        again = recover_action(server, dry_run=False)
    assert (again["changed"], again["tasks"], again["workers_deactivated"]) == (False, [], [])
