"""The session_closed rule (RecoveryConfig.session_closed_threshold_ms): a worker killed as a
whole, seen by another worker's reaper through its listener session, long before the stale
thresholds.

The killed worker runs in its own pid namespace (``unshare --pid``): as on another host, no
process of the test's namespace can judge it by its pid, so only the reaper can. The stale
thresholds are 30 s here: a decision within a few seconds can only be the new rule's.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from tests.chaos.conftest import (
    APP,
    check_history,
    db_now,
    last_heartbeat,
    migrated_for_chaos,
    run_pids,
    runs,
    terminate,
    token,
    worker_row,
)
from tests.conftest import WorkerFactory, wait_until
from tests.harness import WorkerProcess
from tether import AppConfig, PostgresConfig
from tether.db.embedded import EmbeddedServer

HEARTBEAT_MS, CLOSED_MS, STALE_MS = 1000, 1500, 30_000
SETTINGS: dict[str, str] = {
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": str(HEARTBEAT_MS),
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": str(HEARTBEAT_MS),
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": str(STALE_MS),
    "TETHER_RUNNING_STALE_THRESHOLD_MS": str(STALE_MS),
    "TETHER_CHECK_INTERVAL_MS": "1000",
}
OPTED_IN = {**SETTINGS, "TETHER_SESSION_CLOSED_THRESHOLD_MS": str(CLOSED_MS)}
# The last beat came at most an interval before the kill; the rule may act 1.5 s after it, and
# the pass that sees the closed session comes within a check interval. Slack for a loaded
# machine; the stale threshold (30 s) is far beyond.
DECIDED_WITHIN = timedelta(seconds=5)


@dataclass
class NamespacedWorker(WorkerProcess):
    """A `tether worker` that is pid 1 of a pid namespace of its own (registered as pid 1)."""

    def _registered_id(self, conn: psycopg.Connection[Any]) -> str | None:
        row = conn.execute(
            "SELECT id FROM tether_workers WHERE pid = 1 AND hostname = %s AND status = 'active'",
            (socket.gethostname(),),
        ).fetchone()
        return None if row is None else str(row[0])


def start_namespaced(workers: WorkerFactory, env: dict[str, str], *args: str) -> NamespacedWorker:
    # A pid namespace needs CAP_SYS_ADMIN: an ordinary user gets it in a user namespace of its
    # own. Root does not take one: inside it, root could not reach the embedded server's socket,
    # which belongs to the server's own user (tests/hosts.py's AS_SERVER) behind a 0700 folder.
    as_user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    command = [
        *("unshare", *as_user, "--pid", "--fork", "--mount-proc", "--"),
        *(sys.executable, "-m", "tether", "--log-level", "INFO", "worker", APP, *args),
    ]
    worker = NamespacedWorker(
        APP,
        workers.database_url,
        workers.tmp / f"namespaced-{len(workers.started)}.log",
        env={**os.environ, "TETHER_DATABASE_URL": workers.database_url, "PYTHONUNBUFFERED": "1", **env},
        command=command,
        check_url=workers.direct_url,
    ).start()
    workers.started.append(worker)  # killed at the end by the factory, by its pid
    worker.wait_registered()
    return worker


def session_of(db: Any, worker_id: str) -> tuple[int | None, Any]:
    row = worker_row(db, worker_id)
    return row["listener_pid"], row["listener_backend_start"]


def task_status(db: Any, task_id: Any) -> str:
    return str(db.execute("SELECT status FROM tether_tasks WHERE id = %s", (task_id,)).fetchone()["status"])


def settled_row(db: Any, task_id: Any, message: str) -> Any:
    """The task's row once it is no longer RUNNING (within 20 s)."""
    return wait_until(
        lambda: (
            (r := db.execute("SELECT * FROM tether_tasks WHERE id = %s", (task_id,)).fetchone())["status"]
            != "RUNNING"
            and r
        ),
        timeout=20,
        message=message,
    )


def passes(db: Any) -> int:
    return int(db.execute("SELECT passes FROM tether_reaper").fetchone()["passes"])


def run_on(db: Any, chaos: ModuleType, worker_id: str) -> tuple[Any, str]:
    tok = token()
    task = chaos.app.tasks["hold"].send(tok, 120)
    wait_until(
        lambda: (
            (
                r := db.execute(
                    "SELECT status, claimed_by_worker_id FROM tether_tasks WHERE id = %s", (task.id,)
                ).fetchone()
            )["status"]
            == "RUNNING"
            and r["claimed_by_worker_id"] == worker_id
            and last_heartbeat(db, task.id, "runner") is not None
        ),
        timeout=30,
        message="the task to run on the namespaced worker, with a runner heartbeat",
    )
    return task, tok


@pytest.mark.timing
def test_a_killed_worker_is_judged_by_its_closed_session(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    a = start_namespaced(workers, OPTED_IN, "--processes", "1")
    assert a.worker_id is not None
    listener_pid, started = session_of(db, a.worker_id)
    assert listener_pid is not None and started is not None  # recorded when it listened
    task, tok = run_on(db, chaos, a.worker_id)
    b = workers.start(APP, "--processes", "1", env=SETTINGS)  # the rule is A's choice, not B's

    killed_at = db_now(db)
    a.kill()  # SIGKILL to A's process group: the namespace's pid 1 and its children

    row = settled_row(db, task.id, "the killed worker's task to be settled")
    assert row["status"] == "FAILED" and row["error_code"] == "WORKER_CRASHED", row
    assert row["failed_at"] - killed_at < DECIDED_WITHIN, (row["failed_at"], killed_at)
    last_beat = last_heartbeat(db, task.id, "runner")
    assert last_beat is not None
    # Not before the worker was silent for its threshold; long before the stale one.
    assert row["failed_at"] - last_beat >= timedelta(milliseconds=CLOSED_MS)
    assert row["failed_at"] - last_beat < timedelta(milliseconds=STALE_MS)
    row, (attempt,) = check_history(db, task.id)  # one attempt row, the crash
    assert (attempt["attempt"], attempt["worker_id"], attempt["error_code"]) == (
        1,
        a.worker_id,
        "WORKER_CRASHED",
    )
    assert "listener session" in attempt["error_message"], attempt["error_message"]
    assert runs(db, tok) == 1
    dead = worker_row(db, a.worker_id)
    assert dead["status"] == "inactive" and dead["inactive_at"] <= row["failed_at"]
    assert worker_row(db, b.worker_id)["status"] == "active"
    assert "(session_closed)" in b.log()
    # Counted under its own rule (B adds its tally with its next heartbeat).
    wait_until(
        lambda: (
            db.execute(
                "SELECT coalesce(sum(n), 0) AS n FROM tether_recovery_minutes WHERE rule = 'session_closed'"
            ).fetchone()["n"]
            == 1
        ),
        timeout=10,
        message="the session_closed rule's count",
    )


@pytest.mark.timing
@pytest.mark.parametrize("case", ["setting off", "recorded on another server incarnation"])
def test_no_early_decision_without_the_rule(
    db: Any, chaos: ModuleType, workers: WorkerFactory, case: str
) -> None:
    a = start_namespaced(workers, SETTINGS if case == "setting off" else OPTED_IN, "--processes", "1")
    assert a.worker_id is not None
    if case == "setting off":
        assert session_of(db, a.worker_id) == (None, None)  # nothing recorded: the rule never applies
    else:
        # As after a restart or a failover: every session of the old incarnation is gone.
        db.execute(
            "UPDATE tether_workers SET server_started_at = server_started_at - interval '1 hour'"
            " WHERE id = %s",
            (a.worker_id,),
        )
    task, _tok = run_on(db, chaos, a.worker_id)
    workers.start(APP, "--processes", "1", env=OPTED_IN)
    a.kill()
    # Wait until the rule could have acted (A silent past its threshold), then for two more
    # of the fleet's passes: the task is still RUNNING, left to the 30 s stale threshold.
    wait_until(
        lambda: db.execute(
            "SELECT now() - last_heartbeat_at > %s AS silent FROM tether_workers WHERE id = %s",
            (timedelta(milliseconds=CLOSED_MS), a.worker_id),
        ).fetchone()["silent"],
        timeout=10,
        message="the killed worker to be silent past the session threshold",
    )
    seen = passes(db)
    wait_until(lambda: passes(db) >= seen + 2, timeout=10, message="two more reaper passes")
    row = db.execute("SELECT status FROM tether_tasks WHERE id = %s", (task.id,)).fetchone()
    assert row["status"] == "RUNNING", row  # (A itself is marked inactive after 3 s: bookkeeping)


@pytest.mark.timing
def test_a_live_worker_whose_listener_session_is_terminated_is_not_judged_dead(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    a = start_namespaced(workers, OPTED_IN, "--processes", "1")
    assert a.worker_id is not None
    task, tok = run_on(db, chaos, a.worker_id)
    old = session_of(db, a.worker_id)
    seen, terminated_at = passes(db), db_now(db)
    assert db.execute("SELECT pg_terminate_backend(%s) AS done", (old[0],)).fetchone()["done"]
    # The listener reconnects and records its new session, the one the server has.
    new = wait_until(
        lambda: (s := session_of(db, a.worker_id)) != old and s[0] is not None and s,
        timeout=10,
        message="the listener's new session to be recorded",
    )
    live = db.execute("SELECT backend_start FROM pg_stat_activity WHERE pid = %s", (new[0],)).fetchone()
    assert live is not None and live["backend_start"] == new[1]
    # Its heartbeats went on: past twice the session threshold and three passes, nothing changed.
    wait_until(
        lambda: passes(db) >= seen + 3 and db_now(db) - terminated_at > timedelta(milliseconds=2 * CLOSED_MS),
        timeout=20,
        message="three reaper passes, past twice the session threshold",
    )
    row = db.execute(
        "SELECT status, claimed_by_worker_id FROM tether_tasks WHERE id = %s", (task.id,)
    ).fetchone()
    assert (row["status"], row["claimed_by_worker_id"]) == ("RUNNING", a.worker_id), row
    assert worker_row(db, a.worker_id)["status"] == "active"
    assert runs(db, tok) == 1
    assert a.alive()


@pytest.mark.timing
def test_a_worker_frozen_across_a_server_restart_is_not_judged_by_its_old_session(
    private_server: EmbeddedServer, chaos: ModuleType, tmp_path: Path, stopped_groups: list[int]
) -> None:
    """A restart ends every session, the frozen worker's too, and it cannot beat: only the
    incarnation its row names (the old one) keeps the rule from taking it for dead."""
    from tests.apps.chaos import build

    url = private_server.create_database("chaos")
    migrated_for_chaos(url)
    app = build(AppConfig(queues=["default"], broker=PostgresConfig(database_url=url)))
    (tmp_path / "private").mkdir()
    factory = WorkerFactory(url, tmp_path / "private")
    env = {**OPTED_IN, "TETHER_DATABASE_URL": url}
    conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)
    try:
        a = factory.start(APP, "--processes", "1", env=env)
        assert a.worker_id is not None
        tok = token()
        task = app.tasks["hold"].send(tok, 12)
        wait_until(
            lambda: (
                conn.execute("SELECT status FROM tether_tasks WHERE id = %s", (task.id,)).fetchone()["status"]
                == "RUNNING"
            ),
            timeout=30,
            message="the task to run on A",
        )
        b = factory.start(APP, "--processes", "1", env=env)
        assert b.worker_id is not None
        old = conn.execute("SELECT pg_postmaster_start_time() AS t").fetchone()["t"]
        assert worker_row(conn, a.worker_id)["server_started_at"] == old
        os.killpg(a.pid, signal.SIGSTOP)  # A and its child: no beat, no reconnect
        stopped_groups.append(a.pid)
        conn.close()

        private_server.restart()

        conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)
        new = conn.execute("SELECT pg_postmaster_start_time() AS t").fetchone()["t"]
        assert new > old
        wait_until(
            lambda: worker_row(conn, b.worker_id)["server_started_at"] == new,
            timeout=30,
            message="B to record its session on the restarted server",
        )
        # A's session is gone and its heartbeat past the threshold: the rule would act, but
        # for the incarnation. Three of B's passes later, A's task is still RUNNING, A's.
        seen = passes(conn)
        wait_until(
            lambda: (
                passes(conn) >= seen + 3
                and conn.execute(
                    "SELECT now() - last_heartbeat_at > %s AS silent FROM tether_workers WHERE id = %s",
                    (timedelta(milliseconds=2 * CLOSED_MS), a.worker_id),
                ).fetchone()["silent"]
            ),
            timeout=30,
            message="three passes of B's reaper with A silent past twice the threshold",
        )
        row = conn.execute(
            "SELECT status, claimed_by_worker_id FROM tether_tasks WHERE id = %s", (task.id,)
        ).fetchone()
        assert (row["status"], row["claimed_by_worker_id"]) == ("RUNNING", a.worker_id), row

        os.killpg(a.pid, signal.SIGCONT)
        wait_until(
            lambda: worker_row(conn, a.worker_id)["server_started_at"] == new,
            timeout=30,
            message="A to record its session on the restarted server",
        )
        row = wait_until(
            lambda: (
                (r := conn.execute("SELECT * FROM tether_tasks WHERE id = %s", (task.id,)).fetchone())[
                    "status"
                ]
                in ("COMPLETED", "FAILED")
                and r
            ),
            timeout=60,
            message="the task to end",
        )
        assert (row["status"], row["claimed_by_worker_id"]) == ("COMPLETED", a.worker_id), row
        row, (attempt,) = check_history(conn, task.id)  # one attempt: never judged dead
        assert attempt["attempt"] == 1 and attempt["outcome"] == "COMPLETED"
        assert runs(conn, tok) == 1
        assert "(session_closed)" not in b.log()
    finally:
        conn.close()
        app.close()
        factory.cleanup()


@pytest.mark.timing
def test_a_live_worker_cut_off_with_its_session_closed_freezes_its_task_before_the_rule_acts(
    db: Any, chaos: ModuleType, workers: WorkerFactory, worker_role: tuple[str, str]
) -> None:
    """The one case that turns the rule against a live worker: the server ends its listener
    session while the worker cannot reach the server to beat (here its role loses LOGIN and
    its sessions are terminated). The rule then acts 1.5 s after its last beat, not 30 s; the
    worker must have frozen its child by then, so the code does not run on past the decision."""
    role, role_url = worker_role
    a = workers.start(APP, "--processes", "1", env={**OPTED_IN, "TETHER_DATABASE_URL": role_url})
    assert a.worker_id is not None
    tok = token()
    task = chaos.app.tasks["hold_then_mark"].send(tok, 30)
    wait_until(
        lambda: task_status(db, task.id) == "RUNNING" and runs(db, tok) == 1,
        timeout=30,
        message="the task to run on A",
    )
    (child,) = run_pids(db, tok)
    workers.start(APP, "--processes", "1", env=OPTED_IN)

    db.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))
    assert terminate(db, role) >= 2  # its listener's session among them

    frozen_at: list[datetime] = []

    def frozen_or_settled() -> bool:
        if psutil.Process(child).status() == psutil.STATUS_STOPPED:
            frozen_at.append(db_now(db))
            return True
        return task_status(db, task.id) != "RUNNING"

    wait_until(
        frozen_or_settled, timeout=20, interval=0.005, message="A to freeze its child, or the task to end"
    )
    assert frozen_at, f"the task was settled while A's child still ran\n{a.log()}"
    row = settled_row(db, task.id, "the rule to settle A's task")
    assert (row["status"], row["error_code"]) == ("FAILED", "WORKER_CRASHED"), row
    assert frozen_at[0] <= row["failed_at"], (frozen_at[0], row["failed_at"])
    row, (attempt,) = check_history(db, task.id)
    assert "listener session" in attempt["error_message"]
    assert "isolating itself" in a.log()
    assert runs(db, tok + ":done") == 0  # its code never ran on past the freeze

    # Back: A kills the child whose task was settled elsewhere, and writes nothing over it.
    db.execute(sql.SQL("ALTER ROLE {} LOGIN").format(sql.Identifier(role)))
    wait_until(lambda: "claiming resumes" in a.log(), timeout=20, message="A to rejoin")
    wait_until(lambda: not psutil.pid_exists(child), timeout=20, message="A to kill its child")
    assert check_history(db, task.id)[0]["status"] == "FAILED"
    assert runs(db, tok + ":done") == 0
