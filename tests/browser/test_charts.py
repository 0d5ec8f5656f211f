"""The overview's charts and a task's timeline in a real browser: drawn (uPlot's canvas, the
timeline's SVG), with the legends and counts the rows say."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import WAIT, DashboardProcess
from tests.conftest import WorkerFactory, wait_until
from tether.retrying import retry_task

APP = "tests.browser.app:app"
expect.set_options(timeout=WAIT * 1000)
# Heartbeats (which carry the worker's recovery counts) every second, not every 30.
FAST_BEATS = {
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
}


@pytest.fixture
def history(db: psycopg.Connection[Any]) -> None:
    """An hour of history as rows, so that the picture has a shape: tasks that ended each
    minute (a dip and a burst of failures) and a few recoveries. Written before the dashboard
    starts (a fixture asked for before it): the dashboard reads a minute that is over once,
    and rows written into it later, by hand, are not read again."""
    now = datetime.now(UTC).replace(second=30, microsecond=0)
    for minutes_ago in range(3, 58):
        at = now - timedelta(minutes=minutes_ago)
        done = 40 + (minutes_ago * 7) % 25 - (30 if 20 <= minutes_ago <= 24 else 0)
        failed = 12 if 35 <= minutes_ago <= 37 else minutes_ago % 3
        for status, n, queue in (
            ("COMPLETED", done, "default"),
            ("FAILED", failed, "default"),
            ("COMPLETED", done // 3, "images"),
        ):
            db.execute(
                "INSERT INTO tether_tasks (id, name, queue, status, updated_at, sent_at)"
                " SELECT gen_random_uuid(), 'ui.add', %s, %s, %s, %s FROM generate_series(1, %s)",
                (queue, status, at, at, n),
            )
    for minutes_ago, rule, n in (
        (36, "stale_running_retried", 3),
        (36, "dead_child", 1),
        (12, "time_limit", 2),
    ):
        db.execute(
            "INSERT INTO tether_recovery_minutes (minute, rule, n)"
            " VALUES (date_trunc('minute', %s::timestamptz), %s, %s)",
            (now - timedelta(minutes=minutes_ago), rule, n),
        )


def test_the_overview_charts_tasks_ended_recoveries_by_rule_and_each_queue(
    ui: ModuleType,
    history: None,
    workers: WorkerFactory,
    dashboard: DashboardProcess,
    page: Page,
    db: psycopg.Connection[Any],
    screenshots: Path,
) -> None:
    workers.start(APP, "--queues", "default", "--processes", "1", env=FAST_BEATS)
    for n in range(4):
        assert ui.add.send(n, 1).get(timeout=WAIT).ok == n + 1
    assert ui.fail.send("BAD_INPUT").get(timeout=WAIT).err.code == "BAD_INPUT"
    crashed = ui.crash.send()
    assert crashed.get(timeout=WAIT).err.code == "WORKER_CRASHED"
    for n in range(5):
        ui.add.with_options(queue="images").send(n, n)  # nobody serves `images`: they wait
    wait_until(
        lambda: db.execute(
            "SELECT n FROM tether_recovery_minutes WHERE rule = 'dead_child'"
            " AND minute > now() - interval '2 minutes'"
        ).fetchone(),
        message="the worker's recovery written with its heartbeat",
    )
    ended = {
        r["status"]: r["n"]
        for r in db.execute(
            "SELECT status, count(*) AS n FROM tether_tasks WHERE status IN ('COMPLETED', 'FAILED')"
            " AND updated_at > now() - interval '59 minutes' GROUP BY 1"
        )
    }
    recovered = {
        r["rule"]: r["n"]
        for r in db.execute("SELECT rule, sum(n) AS n FROM tether_recovery_minutes GROUP BY 1")
    }
    assert recovered == {"stale_running_retried": 3, "dead_child": 2, "time_limit": 2}

    page.goto(dashboard.url)
    charts = page.locator("#charts")
    expect(charts).to_have_attribute("data-range", "1h")
    finished = page.locator("#chart-finished")
    expect(finished.locator("canvas")).to_have_count(1)
    legend = finished.locator(".u-legend")
    expect(legend).to_contain_text(f"COMPLETED ({ended['COMPLETED']})")
    expect(legend).to_contain_text(f"FAILED ({ended['FAILED']})")
    assert int(finished.get_attribute("data-points") or 0) > 50
    recoveries = page.locator("#chart-recoveries")
    expect(recoveries.locator("canvas")).to_have_count(1)
    # In the order of tether.metrics.rules.RULES, with the rows' totals.
    expect(recoveries.locator(".u-legend")).to_contain_text(
        re.compile(r"stale_running_retried \(3\).*dead_child \(2\).*time_limit \(2\)")
    )
    for chart in ("#chart-depth", "#chart-lag"):
        expect(page.locator(chart + " canvas")).to_have_count(1)
        expect(page.locator(chart + " .u-legend")).to_contain_text("images")
    assert int(page.locator("#chart-depth").get_attribute("data-points") or 0) >= 1
    charts.scroll_into_view_if_needed()
    charts.screenshot(path=str(screenshots / "dashboard-charts.png"))

    page.click("#range-24h")
    expect(page).to_have_url(re.compile(r"#/\?range=24h$"))
    expect(charts).to_have_attribute("data-range", "24h")
    expect(charts).to_contain_text("last 24 hours")
    expect(page.locator("#chart-finished figcaption")).to_contain_text("per 15 minutes")
    expect(page.locator("#chart-finished .u-legend")).to_contain_text(f"COMPLETED ({ended['COMPLETED']})")


def test_a_task_page_draws_its_attempts_and_heartbeats_on_a_timeline(
    ui: ModuleType,
    workers: WorkerFactory,
    dashboard: DashboardProcess,
    page: Page,
    db: psycopg.Connection[Any],
    screenshots: Path,
) -> None:
    worker = workers.start(APP, "--queues", "default", "--processes", "1")
    handle = ui.fails_once.send("twice")
    assert handle.get(timeout=WAIT).err.code == "NOT_YET"
    retry_task(ui.app.broker, handle.id)
    assert handle.get(timeout=WAIT).ok == "twice worked on attempt 2"
    # Heartbeats over its runs (the worker writes them for tasks that run longer than a beat).
    attempts = db.execute(
        "SELECT started_at, finished_at FROM tether_task_attempts WHERE task_id = %s ORDER BY attempt",
        (handle.id,),
    ).fetchall()
    assert len(attempts) == 2
    beats = 0
    for a in attempts:
        for role, k in (("claimer", 0), ("runner", 1)):
            db.execute(
                "INSERT INTO tether_heartbeats (task_id, sender_id, role, hostname, pid, sent_at)"
                " VALUES (%s, %s, %s, 'h1', 42, %s)",
                (
                    handle.id,
                    worker.worker_id,
                    role,
                    a["started_at"] + (a["finished_at"] - a["started_at"]) * k / 2,
                ),
            )
            beats += 1

    page.goto(f"{dashboard.url}#/task/{handle.id}")
    timeline = page.locator("#timeline")
    expect(timeline.locator("rect.attempt")).to_have_count(2)
    expect(timeline.locator("rect.attempt.FAILED")).to_have_count(1)
    expect(timeline.locator("rect.attempt.COMPLETED")).to_have_count(1)
    expect(timeline.locator("line.beat")).to_have_count(beats)
    expect(timeline.locator("line.beat.runner")).to_have_count(2)
    expect(timeline).to_contain_text("attempt 1")
    expect(timeline).to_contain_text("runner beats")
    page.locator("#task-timeline").screenshot(path=str(screenshots / "dashboard-task-timeline.png"))
