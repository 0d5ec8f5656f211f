"""Prometheus metrics (docs/monitoring.md): a real worker with --metrics-port and real children,
scraped while it runs and after; the counts checked against the rows.

Ports: 19110-19129 (the range given to this work; one per test, so tests run side by side).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.conftest import WorkerFactory, wait_until
from tests.metrics_scrape import scrape, total, value
from tether import RecoveryConfig
from tether.broker import PostgresBroker
from tether.web.dashboard import DashboardServer

APP = "tests.apps.basic:app"
WAIT = 30.0
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "EXPIRED")


def metrics_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"


def finished_rows(db: psycopg.Connection[Any]) -> dict[tuple[str, str, str], int]:
    """(task, outcome, code) -> attempts that ended so, as tether_task_attempts says."""
    rows = db.execute(
        "SELECT t.name, a.outcome, coalesce(a.error_code, '') AS code, a.will_retry, count(*) AS n"
        " FROM tether_task_attempts a JOIN tether_tasks t ON t.id = a.task_id"
        " GROUP BY 1, 2, 3, 4"
    ).fetchall()
    found: dict[tuple[str, str, str], int] = {}
    for r in rows:
        outcome = "retried" if r["will_retry"] else r["outcome"].lower()
        found[(r["name"], outcome, r["code"])] = r["n"]
    return found


def test_a_worker_counts_what_its_sync_and_async_children_did_as_the_rows_say(
    basic: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    port = 19110
    worker = workers.start(
        APP, "--processes", "2", "--queues", "default", "--cancel-grace", "0.5", "--metrics-port", str(port)
    )
    url = metrics_url(port)

    # During the run: a task holds a child; the worker and the database both say so.
    holder = basic.sleep.send(60)
    wait_until(
        lambda: (
            db.execute("SELECT status FROM tether_tasks WHERE id = %s", (holder.id,)).fetchone()["status"]
            == "RUNNING"
        ),
        message="the long task to run",
    )
    during = wait_until(
        lambda: (s := scrape(url)) and value(s, "tether_worker_tasks_in_flight") == 1 and s,
        message="the worker to report one task in flight",
    )
    assert value(during, "tether_tasks", queue="default", status="RUNNING") == 1
    assert value(during, "tether_worker_children") == 3  # two sync children and the async one
    holder.cancel()

    handles = (
        [basic.add.send(i, 1) for i in range(10)]
        + [basic.fail.send("MYCODE") for _ in range(3)]
        + [basic.boom.send("no") for _ in range(2)]
        + [basic.echo_async.send("x") for _ in range(4)]  # run by the async child
        + [basic.limited.send(3600)]  # killed at its time limit by the worker
        + [basic.crash_child.send(uuid.uuid4().hex)]  # its child dies (os._exit)
    )
    for handle in handles:
        handle.get(timeout=WAIT)
    wait_until(
        lambda: (
            db.execute(
                "SELECT count(*) AS n FROM tether_tasks WHERE status <> ALL(%s)", (list(TERMINAL),)
            ).fetchone()["n"]
            == 0
        ),
        message="every task to end",
    )
    # (The database's side of a scrape is read at most once a second: wait for a fresh one.)
    samples = wait_until(
        lambda: (
            (s := scrape(url))
            and value(s, "tether_worker_tasks_in_flight") == 0
            and value(s, "tether_tasks", queue="default", status="COMPLETED") is not None
            and value(s, "tether_tasks", queue="default", status="RUNNING") == 0
            # a recovery is counted when its recording is back in the event loop, after its rows
            and total(s, "tether_recoveries_total") >= 3
            and s
        ),
        message="nothing in flight, in the worker and in the database, and three recoveries counted",
    )

    rows = finished_rows(db)
    # Recorded by the children (their DONE and BATCH messages): one count per attempt row.
    for (task, outcome, code), n in rows.items():
        if task in ("limited", "crash_child", "sleep"):
            continue  # recorded by the main process for the dead or cancelled child: recoveries
        got = value(
            samples, "tether_tasks_finished_total", queue="default", task=task, outcome=outcome, code=code
        )
        assert got == n, (task, outcome, code, got, n)
    assert rows[("add", "completed", "")] == 10 and rows[("echo_async", "completed", "")] == 4
    assert rows[("fail", "failed", "MYCODE")] == 3 and rows[("boom", "failed", "UNHANDLED_EXCEPTION")] == 2
    # Each ran once in a child: its run time observed once.
    for task, n in (("add", 10), ("fail", 3), ("boom", 2), ("echo_async", 4)):
        assert value(samples, "tether_task_run_seconds_count", queue="default", task=task) == n, task
    # The worker's kills and its child's death, by rule, as the attempt rows say.
    assert rows[("limited", "failed", "TIME_LIMIT_EXCEEDED")] == 1
    assert value(samples, "tether_recoveries_total", rule="time_limit") == 1
    assert rows[("crash_child", "failed", "WORKER_CRASHED")] == 1
    assert value(samples, "tether_recoveries_total", rule="dead_child") == 1
    # The task cancelled while it ran ignored its cancel (a sync sleep): killed after the grace.
    cancelled = db.execute(
        "SELECT status, error_code FROM tether_tasks WHERE id = %s", (holder.id,)
    ).fetchone()
    assert (cancelled["status"], cancelled["error_code"]) == ("CANCELLED", "TASK_CANCELLED")
    assert value(samples, "tether_recoveries_total", rule="cancelled_while_running") == 1
    for rule in ("hung_child", "stale_claimed_requeued", "stale_running_failed", "expired"):
        assert value(samples, "tether_recoveries_total", rule=rule) == 0, rule
    # Every claim was counted and its wait observed: a claim numbers the task's attempt (a task
    # handed ahead to a child that died goes back unstarted, and is claimed again).
    claims = db.execute("SELECT sum(attempt) AS n FROM tether_tasks").fetchone()["n"]
    assert value(samples, "tether_tasks_claimed_total", queue="default") == claims
    assert value(samples, "tether_task_queue_wait_seconds_count", queue="default") == claims
    assert value(samples, "tether_claim_seconds_count") >= 1
    assert value(samples, "tether_heartbeat_write_seconds_count") >= 1
    assert value(samples, "tether_heartbeat_failures_total") == 0
    # The database's side: the finished tasks, the worker.
    assert value(samples, "tether_scrape_errors_total") == 0, worker.log()
    assert value(samples, "tether_tasks", queue="default", status="COMPLETED") == 14
    assert value(samples, "tether_tasks", queue="default", status="FAILED") == 7
    assert value(samples, "tether_tasks", queue="default", status="PENDING") == 0
    assert value(samples, "tether_workers", status="active") == 1
    assert worker.proc.poll() is None


def test_queue_wait_and_lag_count_from_when_a_task_became_due_not_when_it_was_sent(
    basic: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    port = 19111
    workers.start(APP, "--processes", "1", "--queues", "default", "--metrics-port", str(port))
    url = metrics_url(port)
    # Scheduled 2 s ahead: its intended delay is no wait.
    assert basic.add.schedule(timedelta(seconds=2), 1, 2).get(timeout=WAIT).ok == 3
    samples = scrape(url)
    assert value(samples, "tether_task_queue_wait_seconds_count", queue="default") == 1
    waited = value(samples, "tether_task_queue_wait_seconds_sum", queue="default")
    assert waited is not None and 0 <= waited < 1.0, waited

    # Lag: tasks due in a queue nobody serves grow older; one not due yet is no lag.
    basic.add.with_options(queue="low").schedule(timedelta(hours=1), 1, 1)
    wait_until(  # (a scrape within a second of the last answers from that one's read)
        lambda: value(scrape(url), "tether_tasks", queue="low", status="PENDING") == 1,
        message="the scheduled task in the scrape",
    )
    assert value(scrape(url), "tether_queue_lag_seconds", queue="low") == 0
    basic.add.with_options(queue="low").send(1, 1)
    first = wait_until(
        lambda: (v := value(scrape(url), "tether_queue_lag_seconds", queue="low")) and v,
        message="a lag for queue low",
    )
    later = wait_until(
        lambda: (v := value(scrape(url), "tether_queue_lag_seconds", queue="low")) and v > first + 1 and v,
        timeout=10,
        message="the lag to grow",
    )
    assert later > first
    assert value(scrape(url), "tether_tasks", queue="low", status="PENDING") == 2


def test_a_task_past_good_until_is_counted_expired_by_the_reaper_that_expired_it(
    basic: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    port = 19113
    fast = {"TETHER_CHECK_INTERVAL_MS": "1000"}
    workers.start(APP, "--processes", "1", "--queues", "default", "--metrics-port", str(port), env=fast)
    soon = datetime.now(UTC) + timedelta(seconds=0.5)
    handles = [basic.add.with_options(queue="low", good_until=soon).send(1, i) for i in range(3)]
    wait_until(
        lambda: all(
            db.execute("SELECT status FROM tether_tasks WHERE id = %s", (h.id,)).fetchone()["status"]
            == "EXPIRED"
            for h in handles
        ),
        timeout=15,
        message="the tasks to expire",
    )
    # Counted when the reaper's pass is back in the event loop, just after its commit.
    wait_until(
        lambda: value(scrape(metrics_url(port)), "tether_recoveries_total", rule="expired") == 3,
        timeout=10,
        message="expired to count 3",
    )


@pytest.fixture
def dashboard_server(database_url: str) -> Iterator[DashboardServer]:
    from tether import PostgresConfig

    broker = PostgresBroker(PostgresConfig(database_url=database_url))
    server = DashboardServer(
        ("127.0.0.1", 19112), broker, RecoveryConfig(), token="sekrit", private_reads=True
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        broker.close()


def test_the_dashboard_serves_the_queues_state_behind_its_token(
    basic: ModuleType, dashboard_server: DashboardServer
) -> None:
    for _ in range(3):
        basic.add.with_options(queue="images").send(1, 2)
    url = dashboard_server.url + "metrics"
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as refused:
        scrape(url)
    assert refused.value.code == 401
    samples = scrape(url, {"Authorization": "Bearer sekrit"})
    assert value(samples, "tether_tasks", queue="images", status="PENDING") == 3
    lag = value(samples, "tether_queue_lag_seconds", queue="images")
    assert lag is not None and lag >= 0
    assert total(samples, "tether_scrape_errors_total") == 0
    assert not any(name.startswith("tether_tasks_finished") for name, _ in samples)  # no worker counters
    assert value(samples, "tether_table_bytes", table="tether_tasks") > 0


def test_a_scrape_shows_an_open_transaction_holding_the_horizon_back(
    database_url: str, dashboard_server: DashboardServer
) -> None:
    url, auth = dashboard_server.url + "metrics", {"Authorization": "Bearer sekrit"}
    with psycopg.connect(database_url) as holder:  # not autocommit: the SELECT opens a transaction
        holder.execute("SELECT txid_current()")
        samples = wait_until(
            lambda: (
                (s := scrape(url, auth))
                and (value(s, "tether_db_oldest_transaction_seconds") or 0) >= 2
                and s
            ),
            timeout=15,
            message="the open transaction's age in a scrape",
        )
        assert (value(samples, "tether_db_horizon_xmin_age") or 0) >= 0
        holder.rollback()
    wait_until(
        lambda: (value(scrape(url, auth), "tether_db_oldest_transaction_seconds") or 0) < 2,
        timeout=15,
        message="the transaction's end in a scrape",
    )


def test_a_workflow_step_settled_by_the_reaper_is_counted_reconciled(
    database_url: str, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    from tests.apps.support import ensure_ledger, load_app_module

    ensure_ledger(db)
    flows = load_app_module("flows", database_url)
    port = 19114
    workers.start(
        "tests.apps.flows:app",
        "--processes",
        "1",
        "--queues",
        "default",
        "--metrics-port",
        str(port),
        env={"TETHER_CHECK_INTERVAL_MS": "1000"},
    )
    # The first step goes to `other`, which nobody serves; its task is then ended by SQL, as a
    # process that died between the task's end and the workflow's advance leaves it.
    first = flows.number.with_options(queue="other").node(args=(7,), name="first")
    then = flows.add.node(kwargs={"b": 1}, args_from={"a": first}, name="then")
    handle = flows.app.workflow("stuck", [first, then], output="then").start()
    (task_id,) = [
        r["task_id"]
        for r in db.execute(
            "SELECT task_id FROM tether_workflow_tasks WHERE workflow_id = %s AND node_name = 'first'",
            (handle.id,),
        ).fetchall()
    ]
    db.execute(
        "UPDATE tether_tasks SET status = 'COMPLETED', result = '{\"ok\": 7}'::jsonb, completed_at = now(),"
        " updated_at = now() WHERE id = %s",
        (task_id,),
    )
    assert handle.get(timeout=WAIT).ok == 8  # the reaper settled `first`; `then` ran
    wait_until(
        lambda: (
            value(scrape(metrics_url(port)), "tether_recoveries_total", rule="workflow_step_reconciled") == 1
        ),
        timeout=10,
        message="workflow_step_reconciled to count 1",
    )


def test_a_metrics_port_in_use_stops_the_worker_at_start_naming_the_option(
    db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    import socket

    port = 19115
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port))
        taken.listen()
        worker = workers.start(APP, "--processes", "1", "--metrics-port", str(port), wait=False)
        assert worker.proc.wait(timeout=WAIT) != 0
    assert f"metrics_port: cannot serve metrics on 0.0.0.0:{port}" in worker.log(), worker.log()
    # Refused before it registered: nothing written.
    assert db.execute("SELECT count(*) AS n FROM tether_workers").fetchone()["n"] == 0
