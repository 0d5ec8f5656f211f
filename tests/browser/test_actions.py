"""The dashboard's actions, clicked in a real browser against real workers: cancel a running
task, retry a failed one (from its last recorded step, or from scratch; and a batch by
filter), pause and resume a queue, recover the task of a killed worker."""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Page, expect

from tests.apps.support import task_row
from tests.browser.conftest import TOKEN, WAIT, DashboardProcess, unlock
from tests.conftest import WorkerFactory, wait_until

APP = "tests.browser.app:app"
expect.set_options(timeout=WAIT * 1000)

#: Recovery in seconds: heartbeats every second, stale after two (RecoveryConfig reads TETHER_*).
FAST_RECOVERY = {
    "TETHER_CLAIMER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_RUNNER_HEARTBEAT_INTERVAL_MS": "1000",
    "TETHER_CLAIMED_STALE_THRESHOLD_MS": "2000",
    "TETHER_RUNNING_STALE_THRESHOLD_MS": "2000",
}


def status_cell(page: Page) -> Any:
    return page.locator("#task-fields tr[data-field=status]")


def test_cancel_a_running_task_and_see_it_end_cancelled(
    ui: ModuleType,
    workers: WorkerFactory,
    dashboard: DashboardProcess,
    page: Page,
    db: psycopg.Connection[Any],
) -> None:
    workers.start(APP, "--queues", "default", "--processes", "1")
    handle = ui.until_cancelled.send(120)
    wait_until(lambda: handle.status().value == "RUNNING", WAIT, message="the task to run")

    page.goto(f"{dashboard.url}#/task/{handle.id}")
    expect(status_cell(page)).to_contain_text("RUNNING")
    unlock(page)
    assert page.evaluate("sessionStorage.getItem('tether-dashboard-token')") == TOKEN
    assert TOKEN not in page.url
    page.click("#cancel-task")
    expect(page.locator(".confirm")).to_contain_text("Ask its code to stop?")
    page.click("text=Yes, cancel it")
    expect(page.locator("#flash")).to_contain_text("cancel requested")
    expect(status_cell(page)).to_contain_text("CANCELLED")
    expect(page.locator("#task-fields tr[data-field=cancel_requested]")).to_contain_text(
        "by dashboard:127.0.0.1"
    )
    expect(page.locator("#task-actions #cancel-task")).to_have_count(0)  # nothing left to cancel

    row = task_row(db, handle.id)
    assert row["status"] == "CANCELLED" and row["cancel_requested_by"] == "dashboard:127.0.0.1"
    assert f"dashboard action cancel-task on task {handle.id} from 127.0.0.1" in dashboard.log()


def test_retry_a_failed_task_and_see_it_complete(
    ui: ModuleType, workers: WorkerFactory, dashboard: DashboardProcess, page: Page
) -> None:
    workers.start(APP, "--queues", "default", "--processes", "1")
    handle = ui.fails_once.send("one")
    assert handle.get(timeout=WAIT).err.code == "NOT_YET"

    page.goto(f"{dashboard.url}#/task/{handle.id}")
    expect(status_cell(page)).to_contain_text("FAILED")
    unlock(page)
    page.click("#retry-task")
    expect(page.locator("#flash")).to_contain_text(f"task {handle.id} retried")
    expect(status_cell(page)).to_contain_text("COMPLETED")
    expect(page.locator("#task-result")).to_contain_text("one worked on attempt 2")
    attempts = page.locator("#attempts tbody tr")
    expect(attempts).to_have_count(2)
    expect(attempts.first).to_contain_text("NOT_YET")
    expect(page.locator("#task-actions button")).to_have_count(0)
    assert f"dashboard action retry-task on task {handle.id} from 127.0.0.1: task {handle.id} retried" in (
        dashboard.log()
    )


def test_a_task_page_lists_its_steps_and_retries_it_from_scratch(
    ui: ModuleType, workers: WorkerFactory, dashboard: DashboardProcess, page: Page
) -> None:
    workers.start(APP, "--queues", "default", "--processes", "1")
    handle = ui.steps_fail_once.send("sums")
    assert handle.get(timeout=WAIT).err.code == "NOT_YET"
    first = handle.info().attempts[0].attempt

    page.goto(f"{dashboard.url}#/task/{handle.id}")
    expect(status_cell(page)).to_contain_text("FAILED")
    steps = page.locator("#steps tbody tr")
    expect(steps).to_have_count(2)
    # name, occurrence, attempt, when, bytes of the result's JSON as stored (jsonb's text)
    size = len('{"rows": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "label": "sums"}')
    expect(steps.nth(0).locator("td")).to_have_text(
        ["fetch", "0", str(first), re.compile(r"\d{4}-"), str(size)]
    )
    expect(steps.nth(1).locator("td")).to_have_text(["total", "0", str(first), re.compile(r"\d{4}-"), "2"])
    expect(page.locator("#retry-from-scratch")).to_have_count(0)  # actions need the token
    unlock(page)
    expect(page.locator("#retry-task")).to_have_attribute("title", "resumes after its 2 recorded step(s)")
    page.click("#retry-from-scratch")
    expect(page.locator(".confirm")).to_contain_text(
        "Delete its 2 recorded step(s) and run every step again?"
    )
    page.click("text=Yes, from scratch")
    expect(page.locator("#flash")).to_contain_text(f"task {handle.id} retried from scratch")
    expect(status_cell(page)).to_contain_text("COMPLETED")
    second = handle.info().attempt
    assert second > first
    # Both steps ran again in the new attempt: their records were deleted with the retry.
    expect(steps.nth(0).locator("td").nth(2)).to_have_text(str(second))
    expect(steps.nth(1).locator("td").nth(2)).to_have_text(str(second))
    assert [(s.name, s.attempt) for s in handle.info().steps] == [("fetch", second), ("total", second)]
    expect(page.locator("#task-actions button")).to_have_count(0)


def test_retry_every_failed_task_a_filter_matches_after_a_dry_run(
    ui: ModuleType, workers: WorkerFactory, dashboard: DashboardProcess, page: Page, screenshots: Path
) -> None:
    worker = workers.start(APP, "--queues", "default", "--processes", "2")
    once = [ui.fails_once.send(f"bulk-{n}") for n in range(3)]
    other = ui.fail.send("OTHER")
    for handle in [*once, other]:
        assert handle.get(timeout=WAIT).is_err

    page.goto(f"{dashboard.url}#/tasks?status=FAILED&error_code=NOT_YET")
    unlock(page)
    expect(page.locator("#task-list tbody tr")).to_have_count(3)
    page.click("#retry-matching")
    preview = page.locator("#retry-preview")
    expect(preview).to_contain_text("dry run: 3 task(s) match {status FAILED, error code NOT_YET}")
    expect(preview.locator("a.id")).to_have_count(3)  # the sample
    page.screenshot(path=str(screenshots / "dashboard-bulk-retry.png"))
    for handle in once:  # the dry run changed nothing
        assert handle.status().value == "FAILED"
    page.click("#confirm-retry")
    expect(page.locator("#flash")).to_contain_text("retried 3 of 3 task(s)")
    for handle in once:
        wait_until(lambda h=handle: h.status().value == "COMPLETED", WAIT, message=f"{handle.id} to complete")
    assert other.status().value == "FAILED"
    page.click("text=Refresh")
    expect(page.locator("#task-list tbody td.empty")).to_have_text("no task matches")
    assert (
        "dashboard action retry-tasks on tasks matching {status FAILED, error code NOT_YET}"
        in dashboard.log()
    )
    worker.check_alive()


def test_pause_a_queue_and_see_no_claim_then_resume(
    ui: ModuleType,
    workers: WorkerFactory,
    dashboard: DashboardProcess,
    page: Page,
    db: psycopg.Connection[Any],
    screenshots: Path,
) -> None:
    workers.start(APP, "--queues", "default,images", "--processes", "1")
    assert ui.add.with_options(queue="images").send(1, 1).get(timeout=WAIT).ok == 2

    page.goto(dashboard.url + "#/queues")
    unlock(page)
    images = page.locator("#queues tbody tr", has_text="images")
    images.get_by_role("button", name="Pause").click()
    expect(page.locator("#flash")).to_contain_text("queue images paused")
    expect(images).to_contain_text("paused")
    expect(images).to_contain_text("by dashboard:127.0.0.1")

    held = ui.add.with_options(queue="images").send(2, 2)
    free = ui.add.send(3, 3)  # another queue of the same worker goes on
    assert free.get(timeout=WAIT).ok == 6
    time.sleep(3)  # workers claim in milliseconds: three seconds of nothing is no claim
    row = task_row(db, held.id)
    assert (row["status"], row["attempt"], row["claimed_at"]) == ("PENDING", 0, None)
    expect(images).to_contain_text("1")  # one PENDING shown
    page.screenshot(path=str(screenshots / "dashboard-queues.png"))

    images.get_by_role("button", name="Resume").click()
    expect(page.locator("#flash")).to_contain_text("queue images resumed")
    assert held.get(timeout=WAIT).ok == 4
    expect(images).to_contain_text("active")
    log = dashboard.log()
    assert "dashboard action pause-queue on queue images from 127.0.0.1: queue images paused" in log
    assert "dashboard action resume-queue on queue images from 127.0.0.1: queue images resumed" in log


def test_recover_the_task_of_a_killed_worker_after_a_dry_run(
    ui: ModuleType,
    workers: WorkerFactory,
    page: Page,
    db: psycopg.Connection[Any],
    database_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Recovery in seconds (the worker's heartbeats, the dashboard's thresholds: TETHER_*).
    for name, value in FAST_RECOVERY.items():
        monkeypatch.setenv(name, value)
    worker = workers.start(APP, "--queues", "default", "--processes", "1")
    handle = ui.until_cancelled.send(120)
    wait_until(lambda: handle.status().value == "RUNNING", WAIT, message="the task to run")
    worker.kill()  # SIGKILL to its process group: no worker is left to reap the task
    (tmp_path / "dashboard").mkdir()
    dashboard = DashboardProcess(database_url, tmp_path / "dashboard", TOKEN).start("--app", APP)
    try:
        page.goto(dashboard.url)
        unlock(page)
        expect(page.locator("#stale")).to_contain_text(str(handle.id)[:8])  # silent past 2 s
        page.click("#recover")
        preview = page.locator("#recover-preview")
        expect(preview).to_contain_text("dry run: 1 stale task(s) would be recovered")
        expect(preview).to_contain_text("FAILED (WORKER_CRASHED)")
        assert task_row(db, handle.id)["status"] == "RUNNING"  # the dry run changed nothing
        page.click("#confirm-recover")
        expect(page.locator("#flash")).to_contain_text("1 stale task(s) were recovered")
        expect(page.locator("#stale td.empty")).to_have_text("none")
        row = task_row(db, handle.id)
        assert (row["status"], row["error_code"]) == ("FAILED", "WORKER_CRASHED")
        assert "dashboard action recover on stale tasks and workflows from 127.0.0.1" in dashboard.log()
    finally:
        dashboard.stop()
