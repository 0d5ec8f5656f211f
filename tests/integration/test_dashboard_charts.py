"""The overview's charts (`GET /api/charts`): tasks ended per minute by status, recoveries by
rule, depth and lag per queue, from a real worker's rows; what a read costs on a big table;
retention of the recovery counts."""

from __future__ import annotations

import json
import threading
import uuid
from datetime import UTC, datetime, timedelta
from types import ModuleType
from typing import Any

import psycopg
import pytest

from tests.conftest import WorkerFactory, wait_until
from tests.integration.test_dashboard import get
from tether import RecoveryConfig
from tether.broker import PostgresBroker, retention
from tether.broker.queries import q
from tether.metrics import recovery_tally, rules
from tether.web import charts
from tether.web.dashboard import DashboardServer

APP = "tests.apps.basic:app"
WAIT = 30.0
# Heartbeats (which carry the recovery counts) every second, not every 30.
FAST_BEATS = {
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
}


def serve(broker: PostgresBroker) -> DashboardServer:
    server = DashboardServer(("127.0.0.1", 0), broker, RecoveryConfig(), chart_sample_s=0.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def read_charts(server: DashboardServer, range_: str = "1h") -> dict[str, Any]:
    code, _, body = get(server.url + "api/charts?range=" + range_)
    assert code == 200, body
    answer: dict[str, Any] = json.loads(body)
    return answer


def test_the_charts_count_what_the_rows_say_ended_and_what_the_worker_recovered_by_rule(
    basic: ModuleType, db: psycopg.Connection[Any], workers: WorkerFactory
) -> None:
    workers.start(APP, "--processes", "1", "--queues", "default", env=FAST_BEATS)
    handles = [basic.add.send(1, i) for i in range(5)] + [basic.fail.send("MYCODE") for _ in range(2)]
    crashed = basic.crash_child.send(uuid.uuid4().hex)  # its child dies: dead_child
    limited = basic.limited.send(30.0)  # killed at its 0.5 s limit: time_limit
    for h in [*handles, crashed, limited]:
        h.get(timeout=WAIT)
    for i in range(3):
        basic.add.with_options(queue="low").send(1, i)  # nobody serves `low`: it waits
    ended = {
        r["status"]: r["n"]
        for r in db.execute(
            "SELECT status, count(*) AS n FROM tether_tasks"
            " WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED', 'EXPIRED') GROUP BY status"
        )
    }
    assert ended == {"COMPLETED": 5, "FAILED": 4}
    # The worker's tally reaches the table with its next heartbeat.
    wait_until(
        lambda: (
            db.execute("SELECT coalesce(sum(n), 0) AS n FROM tether_recovery_minutes").fetchone()["n"] >= 2
        ),
        message="the recoveries written with a heartbeat",
    )
    recorded = {
        r["rule"]: r["n"]
        for r in db.execute("SELECT rule, sum(n) AS n FROM tether_recovery_minutes GROUP BY 1")
    }
    assert recorded == {rules.DEAD_CHILD: 1, rules.TIME_LIMIT: 1}

    server = serve(basic.app.broker)
    try:
        shown = read_charts(server)
        finished = shown["finished"]
        assert shown["bucket_s"] == 60 and len(finished["at"]) == 60
        assert finished["total"] == {"COMPLETED": 5, "FAILED": 4, "CANCELLED": 0, "EXPIRED": 0}
        assert sum(finished["by_queue"]["default"]) == 9 and list(finished["by_queue"]) == ["default"]
        # The buckets are minutes: the rows' own minutes hold them.
        minutes = {
            int(r["m"].timestamp()): r["n"]
            for r in db.execute(
                "SELECT date_trunc('minute', updated_at) AS m, count(*) AS n FROM tether_tasks"
                " WHERE status IN ('COMPLETED', 'FAILED') GROUP BY 1"
            )
        }
        at = finished["at"]
        per_minute = {
            t: finished["by_status"]["COMPLETED"][i] + finished["by_status"]["FAILED"][i]
            for i, t in enumerate(at)
        }
        assert {t: n for t, n in per_minute.items() if n} == minutes

        recoveries = shown["recoveries"]
        assert recoveries["total"] == {rules.DEAD_CHILD: 1, rules.TIME_LIMIT: 1}
        assert list(recoveries["by_rule"]) == [rules.DEAD_CHILD, rules.TIME_LIMIT]  # RULES' order
        assert recoveries["rules"] == list(rules.RULES)

        queues = shown["queues"]
        assert queues["depth"]["low"][-1] == 3
        assert queues["lag_s"]["low"][-1] is not None and queues["lag_s"]["low"][-1] >= 0
        # The sampler goes on without a page asking: more points come.
        first = len(queues["at"])
        wait_until(lambda: len(read_charts(server)["queues"]["at"]) > first, message="another queue sample")

        day = read_charts(server, "24h")
        assert day["bucket_s"] == 900 and len(day["finished"]["at"]) == 96
        assert (
            day["finished"]["total"]["COMPLETED"] == 5 and day["recoveries"]["total"][rules.DEAD_CHILD] == 1
        )

        code, _, body = get(server.url + "api/charts?range=7d")
        assert code == 400 and b"range '7d' is not one of 1h, 24h" in body
    finally:
        server.shutdown()
        server.server_close()


def test_settled_minutes_are_read_once_and_later_reads_start_at_the_first_unsettled_one(
    basic: ModuleType, db: psycopg.Connection[Any]
) -> None:
    now = datetime.now(UTC)
    # Ten tasks ended 30 minutes ago (settled), two just now.
    fill_terminal(db, 10, now - timedelta(minutes=30))
    fill_terminal(db, 2, now)
    seen = charts.Charts(basic.app.broker)
    try:
        first = seen.answer("1h")
        assert first["finished"]["total"]["COMPLETED"] == 12
        assert first["complete_from"] == first["from"]  # every minute read
        assert len(seen._minutes) >= 57  # every minute of the hour but the last SETTLE_S
        # A row added to a settled minute afterwards is not read again (the answer keeps the
        # settled count); one in an unsettled minute is.
        fill_terminal(db, 1, now - timedelta(minutes=30))
        fill_terminal(db, 3, now)
        seen._answers.clear()
        again = seen.answer("1h")
        assert again["finished"]["total"]["COMPLETED"] == 15
    finally:
        seen.stop()


def test_an_answer_reads_back_for_a_bounded_time_and_the_rest_comes_later(
    basic: ModuleType, db: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    now = datetime.now(UTC)
    fill_terminal(db, 10, now - timedelta(minutes=30))
    fill_terminal(db, 2, now)
    monkeypatch.setattr(charts, "ANSWER_BUDGET_S", 0.0)  # a database too busy to read any back
    seen = charts.Charts(basic.app.broker)
    try:
        shown = seen.answer("1h")
        finished = shown["finished"]
        # Only the live minutes were read: the older ones are not zero, they are not known yet.
        assert seen._minutes == {}
        assert finished["total"]["COMPLETED"] == 2
        known = [i for i, n in enumerate(finished["by_status"]["COMPLETED"]) if n is not None]
        # (the last SETTLE_S, and up to two minutes before while they are not read back)
        assert known and known == list(range(known[0], 60)) and len(known) <= 6
        assert datetime.fromisoformat(str(shown["complete_from"])) > now - timedelta(minutes=6)
        # The sampler's thread reads them back (here: one call, as its tick makes it).
        seen.read_back(charts.BACKGROUND_BUDGET_S)
        seen._answers.clear()
        shown = seen.answer("1h")
        assert shown["finished"]["total"]["COMPLETED"] == 12
        assert None not in shown["finished"]["by_status"]["COMPLETED"]
    finally:
        seen.stop()


def fill_terminal(db: psycopg.Connection[Any], n: int, at: datetime, queue: str = "default") -> None:
    """``n`` COMPLETED tasks that ended at ``at``, written as rows (the history of a big table)."""
    db.execute(
        "INSERT INTO tether_tasks (id, name, queue, status, completed_at, updated_at, sent_at)"
        " SELECT gen_random_uuid(), 'add', %s, 'COMPLETED', %s, %s, %s FROM generate_series(1, %s)",
        (queue, at, at, at, n),
    )


def test_a_chart_read_reads_the_rows_of_its_range_through_the_terminal_index_not_the_history(
    basic: ModuleType, db: psycopg.Connection[Any]
) -> None:
    now = datetime.now(UTC)
    fill_terminal(db, 200_000, now - timedelta(days=3))  # history, outside every range
    fill_terminal(db, 40, now - timedelta(minutes=20))
    db.execute("ANALYZE tether_tasks")
    since = now - timedelta(hours=1)
    [[plan]] = (
        db.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + q("finished_per_bucket"),
            {"since": since, "until": now, "bucket_s": 60},
        )
        .fetchone()
        .values()
    )
    scans = list(nodes(plan["Plan"]))
    reads = [n for n in scans if n.get("Relation Name") == "tether_tasks" or "Index Name" in n]
    assert reads and all(n.get("Index Name") == "tether_tasks_terminal_idx" for n in reads), reads
    # The index range yields the 40 rows of the last hour, not the 200,000 older ones.
    assert max(n["Actual Rows"] for n in reads) == 40


def nodes(plan: dict[str, Any]) -> Any:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def test_retention_prunes_recovery_counts_with_the_terminal_tasks(
    basic: ModuleType, db: psycopg.Connection[Any]
) -> None:
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    old = now - timedelta(hours=800)  # past the 720 h of terminal_record_retention_hours
    db.execute(
        "INSERT INTO tether_recovery_minutes (minute, rule, n) VALUES"
        " (%s, 'dead_child', 2), (%s, 'expired', 1), (%s, 'dead_child', 4)",
        (old, old, now),
    )
    with basic.app.broker.connection() as conn:
        deleted = retention.prune(conn, RecoveryConfig())
    assert deleted.get("recovery_minutes") == 2
    left = db.execute("SELECT minute, rule, n FROM tether_recovery_minutes").fetchall()
    assert [(r["minute"], r["rule"], r["n"]) for r in left] == [(now, "dead_child", 4)]
    with basic.app.broker.connection() as conn:
        assert "recovery_minutes" not in retention.prune(
            conn, RecoveryConfig(terminal_record_retention_hours=None)
        )


@pytest.mark.parametrize("n", [0, -1])
def test_the_tally_ignores_nothing_recovered(n: int) -> None:
    recovery_tally.take()
    recovery_tally.add(rules.DEAD_CHILD, n)
    assert recovery_tally.take() == {}
