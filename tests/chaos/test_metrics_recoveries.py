"""tether_recoveries_total moves as the rows say, rule by rule, when real workers die or hang.

Each test scrapes the worker that did the recovering (its --metrics-port; ports 19120-19129)
and compares its counters with the task and attempt rows the recovery wrote (and, for the
reaper's rules, with the counts the dashboard's chart reads, tether_recovery_minutes).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from psycopg import sql

from tests.apps.support import attempt_rows, ensure_ledger, load_app_module, task_row
from tests.chaos.conftest import (
    APP,
    FAST,
    check_history,
    last_heartbeat,
    runs,
    terminate,
    token,
    wait_all,
    wait_status,
)
from tests.conftest import WorkerFactory, wait_until
from tests.metrics_scrape import Samples, scrape, value

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "EXPIRED"}


def recoveries(samples: Samples) -> dict[str, float]:
    return {
        dict(labels)["rule"]: v for (name, labels), v in samples.items() if name == "tether_recoveries_total"
    }


def recorded(db: Any) -> dict[str, int]:
    """The recoveries per rule in tether_recovery_minutes (the dashboard's chart)."""
    rows = db.execute("SELECT rule, sum(n)::int AS n FROM tether_recovery_minutes GROUP BY rule").fetchall()
    return {r["rule"]: r["n"] for r in rows}


def a_holds_two_running_and_two_claimed(
    db: Any, chaos: ModuleType, workers: WorkerFactory, env: dict[str, str]
):  # type: ignore[no-untyped-def]
    hold, hold_retry = chaos.app.tasks["hold"], chaos.app.tasks["hold_retry"]
    a = workers.start(APP, "--processes", "2", "--prefetch", "2", env=env)
    t_fail, t_retry = token(), token()
    fail = hold.send(t_fail, 120)
    retry = hold_retry.send(t_retry, 120, 0)
    claimed = [hold.send(token(), 0), hold.send(token(), 0)]

    def holds_all() -> bool:
        rows = [task_row(db, h.id) for h in (fail, retry, *claimed)]
        return (
            runs(db, t_fail) == 1
            and runs(db, t_retry) == 1
            and [r["status"] for r in rows] == ["RUNNING", "RUNNING", "CLAIMED", "CLAIMED"]
            and all(r["claimed_by_worker_id"] == a.worker_id for r in rows)
        )

    wait_until(holds_all, message="A to run two tasks and hold two CLAIMED")
    return a, fail, retry, claimed


@pytest.mark.timing
def test_the_survivor_counts_each_stale_rule_as_its_reaper_applied_it(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    a, fail, retry, claimed = a_holds_two_running_and_two_claimed(db, chaos, workers, FAST)
    port = 19120
    b = workers.start(APP, "--processes", "2", "--metrics-port", str(port), env=FAST)
    url = f"http://127.0.0.1:{port}/metrics"
    wait_until(lambda: last_heartbeat(db, fail.id, "runner") is not None, timeout=10, message="a runner beat")
    a.kill()  # SIGKILL to A's whole process group: only B's reaper is left to recover

    wait_all(db, [h.id for h in (fail, retry, *claimed)], TERMINAL, timeout=30)
    row = wait_status(db, fail.id, TERMINAL)
    assert (row["status"], row["error_code"]) == ("FAILED", "WORKER_CRASHED")
    _, attempts = check_history(db, retry.id)
    assert [(x["error_code"], x["will_retry"]) for x in attempts] == [("WORKER_CRASHED", True), (None, False)]
    for h in claimed:  # requeued: its first claim left no attempt row, it ran on its second
        row, (attempt,) = check_history(db, h.id)
        assert row["attempt"] == 2 and attempt["attempt"] == 2 and attempt["worker_id"] == b.worker_id
    assert all("no runner heartbeat" in x["error_message"] for x in attempt_rows(db, fail.id))

    samples = wait_until(
        lambda: (s := scrape(url)) and value(s, "tether_workers_deactivated_total") == 1 and s,
        timeout=15,
        message="B's reaper to mark A inactive",
    )
    assert recoveries(samples) == {
        "stale_running_failed": 1,
        "stale_running_retried": 1,
        "stale_claimed_requeued": 2,
        "expired": 0,
        "workflow_step_reconciled": 0,
        "session_closed": 0,  # A did not opt in: only the stale rules judge it
        "dead_child": 0,
        "hung_child": 0,
        "time_limit": 0,
        "cancelled_while_running": 0,
        "startup_reconciliation": 0,  # A was alive when B started
        "self_isolation": 0,
    }
    # The dashboard's chart reads the same counts from tether_recovery_minutes, which B writes
    # with its next heartbeat (docs/dashboard.md#charts).
    counted = {rule: n for rule, n in recoveries(samples).items() if n}
    wait_until(lambda: recorded(db) == counted, timeout=10, message=f"{counted} in tether_recovery_minutes")
    wait_until(  # the database's side of a scrape is read at most once a second
        lambda: value(scrape(url), "tether_workers", status="inactive") == 1, message="A inactive in a scrape"
    )
    # B ran the retry and the two requeued tasks: its children's outcomes, counted by B.
    assert (
        value(
            samples, "tether_tasks_finished_total", queue="default", task="hold", outcome="completed", code=""
        )
        == 2
    )
    assert (
        value(
            samples,
            "tether_tasks_finished_total",
            queue="default",
            task="hold_retry",
            outcome="completed",
            code="",
        )
        == 1
    )


@pytest.mark.timing
def test_startup_reconciliation_counts_the_tasks_of_the_dead_worker_it_recovered(
    db: Any, chaos: ModuleType, workers: WorkerFactory
) -> None:
    a, fail, retry, _ = a_holds_two_running_and_two_claimed(db, chaos, workers, {})  # default thresholds
    a.kill()
    port = 19121
    b = workers.start(APP, "--processes", "2", "--metrics-port", str(port))
    row = wait_status(db, fail.id, TERMINAL, timeout=15)
    assert (row["status"], row["error_code"]) == ("FAILED", "WORKER_CRASHED")
    (attempt,) = attempt_rows(db, fail.id)
    assert "on this host is gone" in attempt["error_message"]
    assert attempt_rows(db, retry.id)[0]["will_retry"]
    # Counted once the recovery's transaction is back in the event loop, just after the rows.
    samples = wait_until(
        lambda: (
            (s := scrape(f"http://127.0.0.1:{port}/metrics"))
            and value(s, "tether_recoveries_total", rule="startup_reconciliation") == 4  # 2 + 1 + 1
            and s
        ),
        timeout=10,
        message="startup_reconciliation to count 4",
    )
    for rule in ("stale_running_failed", "stale_running_retried", "stale_claimed_requeued", "dead_child"):
        assert value(samples, "tether_recoveries_total", rule=rule) == 0, rule
    assert f"{2} task(s) requeued, 1 retried, 1 failed" in b.log()


@pytest.mark.timing
def test_a_child_whose_event_loop_blocks_is_counted_as_hung(
    database_url: str, db: Any, workers: WorkerFactory
) -> None:
    ensure_ledger(db)
    aio = load_app_module("aio", database_url)
    port = 19122
    workers.start(
        "tests.apps.aio:app",
        "--processes",
        "0",
        "--async-processes",
        "1",
        "--metrics-port",
        str(port),
        env=FAST,
    )
    blocker = aio.block.send(60)
    row = wait_status(db, blocker.id, TERMINAL, timeout=20)
    (attempt,) = attempt_rows(db, blocker.id)
    assert (row["status"], attempt["error_code"]) == ("FAILED", "WORKER_CRASHED")
    assert "event loop was blocked" in attempt["error_message"]
    # Counted once the crash recording's thread is back in the event loop, just after the row.
    samples = wait_until(
        lambda: (
            (s := scrape(f"http://127.0.0.1:{port}/metrics"))
            and value(s, "tether_recoveries_total", rule="hung_child") == 1
            and s
        ),
        timeout=10,
        message="hung_child to count 1",
    )
    assert value(samples, "tether_recoveries_total", rule="dead_child") == 0


@pytest.mark.timing
@pytest.mark.direct_only("the worker's own login role is refused and its sessions ended")
def test_a_worker_cut_off_from_the_database_counts_the_work_it_stopped_and_still_answers_scrapes(
    db: Any, chaos: ModuleType, workers: WorkerFactory, worker_role: tuple[str, str]
) -> None:
    role, role_url = worker_role
    hold = chaos.app.tasks["hold"]
    port = 19123
    a = workers.start(
        APP,
        "--processes",
        "2",
        "--prefetch",
        "1",
        "--metrics-port",
        str(port),
        env={**FAST, "TETHER_DATABASE_URL": role_url},
    )
    handles = [hold.send(token(), 30), hold.send(token(), 30), hold.send(token(), 0)]

    def a_holds_all() -> bool:
        rows = [task_row(db, h.id) for h in handles]
        return [r["status"] for r in rows] == ["RUNNING", "RUNNING", "CLAIMED"] and all(
            r["claimed_by_worker_id"] == a.worker_id for r in rows
        )

    wait_until(a_holds_all, message="A to run two tasks and hold one CLAIMED")
    db.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))
    terminate(db, role)
    wait_until(lambda: "isolating itself" in a.log(), timeout=20, message="A to isolate itself")
    # Three tasks stopped: the two running ones frozen with their children, and the claimed
    # one frozen in the child it was handed to ahead, or dropped if it was still unhanded.
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert value(samples, "tether_recoveries_total", rule="self_isolation") == 3
    held = value(samples, "tether_worker_tasks_in_flight")
    assert held in (2, 3), held  # frozen ones stay held until the worker rejoins
    assert value(samples, "tether_heartbeat_failures_total") >= 1
    # The database's side could not be read; the worker's own counters still answer.
    assert value(samples, "tether_scrape_errors_total") >= 1
    assert value(samples, "tether_tasks", queue="default", status="RUNNING") is None
