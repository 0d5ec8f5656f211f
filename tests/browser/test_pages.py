"""The dashboard's pages in a real browser: the overview, the task list with its filters and
pages, a task (and its durable sleep), a workflow, queues and workers, and the read-only mode."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
from playwright.sync_api import Page, expect

from tests.browser.conftest import TOKEN, WAIT, DashboardProcess, unlock
from tests.conftest import WorkerFactory, wait_until

APP = "tests.browser.app:app"
expect.set_options(timeout=WAIT * 1000)


def test_the_main_page_shows_queues_workers_and_failures(
    ui: ModuleType, workers: WorkerFactory, dashboard: DashboardProcess, page: Page, screenshots: Path
) -> None:
    worker = workers.start(APP, "--queues", "default", "--processes", "2")
    for n in range(3):
        assert ui.add.send(n, 1).get(timeout=WAIT).ok == n + 1
    failed = ui.fail.send("BAD_INPUT", "the <b>input</b> was bad")
    assert failed.get(timeout=WAIT).err.code == "BAD_INPUT"
    ui.add.with_options(queue="images").send(1, 1)  # nobody serves `images`: stays PENDING

    page.goto(dashboard.url)
    expect(page.locator("#counts")).to_contain_text("images")
    expect(page.locator("#workers")).to_contain_text(worker.worker_id or "?")
    failures = page.locator("#failures")
    expect(failures).to_contain_text("BAD_INPUT")
    # Data is shown as text: the message's markup is not markup.
    expect(failures).to_contain_text("the <b>input</b> was bad")
    assert failures.locator("b").count() == 0
    expect(page.locator("#state")).to_contain_text("refreshes every 2 s")
    page.screenshot(path=str(screenshots / "dashboard-overview.png"))

    # The failure links to its task.
    failures.get_by_role("link", name=re.compile(str(failed.id)[:8])).click()
    expect(page).to_have_url(re.compile(f"#/task/{failed.id}$"))
    expect(page.locator(".page-task h2")).to_contain_text("ui.fail")


def test_the_task_list_filters_and_pages_by_keyset(
    ui: ModuleType, workers: WorkerFactory, dashboard: DashboardProcess, page: Page, screenshots: Path
) -> None:
    workers.start(APP, "--queues", "default", "--processes", "2")
    done = [ui.add.send(n, n) for n in range(5)]
    boom = [ui.fail.send("BOOM") for _ in range(3)]
    other = ui.fail.send("OTHER")
    for handle in [*done, *boom, other]:
        handle.get(timeout=WAIT)
    parked = ui.add.with_options(queue="images").send(7, 7)

    page.goto(dashboard.url + "#/tasks")
    rows = page.locator("#task-list tbody tr")
    expect(rows).to_have_count(10)
    assert str(parked.id)[:8] in rows.first.inner_text()  # newest first

    page.select_option("#filter-status", "FAILED")
    page.fill("#filter-error_code", "BOOM")
    page.click("text=Apply")
    expect(page).to_have_url(re.compile(r"#/tasks\?status=FAILED&error_code=BOOM$"))
    expect(rows).to_have_count(3)
    for row in rows.all():
        assert "BOOM" in row.inner_text() and "FAILED" in row.inner_text()
    page.screenshot(path=str(screenshots / "dashboard-tasks.png"))

    page.fill("#filter-error_code", "")
    page.select_option("#filter-status", "")
    page.fill("#filter-queue", "images")
    page.click("text=Apply")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("PENDING")

    # Pages of 4, by keyset: 4, 4, 2, every task once, newest first.
    page.goto(dashboard.url + "#/tasks?limit=4")
    seen: list[str] = []
    for size in (4, 4, 2):
        expect(rows).to_have_count(size)
        seen += [row.locator("a.id").get_attribute("title") or "" for row in rows.all()]
        if size == 4:
            first = rows.first.locator("a.id").get_attribute("title") or ""
            page.click("#next-page")
            # The page shown has as many rows: wait until the next one has replaced them.
            expect(rows.first.locator("a.id")).not_to_have_attribute("title", first)
    expect(page.locator("#next-page")).to_have_count(0)
    everything = [str(h.id) for h in [*done, *boom, other, parked]]
    assert seen == sorted(everything, reverse=True)
    page.click("#first-page")
    expect(rows).to_have_count(4)
    assert rows.first.locator("a.id").get_attribute("title") == seen[0]


def test_a_task_page_shows_its_error_traceback_attempts_and_heartbeats(
    ui: ModuleType,
    workers: WorkerFactory,
    dashboard: DashboardProcess,
    page: Page,
    db: psycopg.Connection[Any],
    screenshots: Path,
) -> None:
    worker = workers.start(APP, "--queues", "default", "--processes", "1")
    handle = ui.boom.send("kaput <i>here</i>")
    assert handle.get(timeout=WAIT).err.code == "UNHANDLED_EXCEPTION"
    # A heartbeat row to show (the worker writes them for tasks that run long enough).
    db.execute(
        "INSERT INTO tether_heartbeats (task_id, sender_id, role, hostname, pid)"
        " VALUES (%s, %s, 'runner', 'h1', 42)",
        (handle.id, worker.worker_id),
    )

    page.goto(f"{dashboard.url}#/task/{handle.id}")
    expect(page.locator(".page-task h2")).to_contain_text("ui.boom")
    fields = page.locator("#task-fields")
    expect(fields.locator("tr[data-field=status]")).to_contain_text("FAILED")
    expect(fields.locator("tr[data-field=error_code]")).to_contain_text("UNHANDLED_EXCEPTION")
    expect(page.locator("#task-args")).to_contain_text("kaput <i>here</i>")
    assert page.locator("#task-args i").count() == 0  # an argument is text, never markup
    traceback = page.locator("#task-result pre.traceback")
    expect(traceback).to_contain_text("Traceback (most recent call last)")
    expect(traceback).to_contain_text("RuntimeError: kaput <i>here</i>")
    attempts = page.locator("#attempts tbody tr")
    expect(attempts).to_have_count(1)
    expect(attempts.first).to_contain_text("UNHANDLED_EXCEPTION")
    expect(attempts.first).to_contain_text(worker.worker_id or "?")
    expect(page.locator("#heartbeats tbody tr")).to_contain_text(["runner"])
    # Without the token entered, no action is offered.
    expect(page.locator("#task-actions button")).to_have_count(0)
    page.screenshot(path=str(screenshots / "dashboard-task.png"), full_page=True)


def test_a_task_page_shows_its_sleep_until_it_resumes(
    ui: ModuleType, workers: WorkerFactory, read_only_dashboard: DashboardProcess, page: Page
) -> None:
    workers.start(APP, "--queues", "default", "--processes", "1")
    handle = ui.naps.send(6)
    suspension = wait_until(lambda: handle.info().suspension, WAIT, message="the task to sleep")
    until = suspension.run_at.isoformat(sep=" ", timespec="seconds")

    page.goto(f"{read_only_dashboard.url}#/task/{handle.id}")
    expect(page.locator("#task-fields tr[data-field=status]")).to_contain_text("PENDING")
    line = page.locator("#task-fields tr[data-field=suspension] td")
    expect(line).to_have_text(f"sleeping until {until} (after step 'fetch')")
    # The page refreshes: once the sleep ended and the task completed, the line is gone.
    expect(page.locator("#task-fields tr[data-field=status]")).to_contain_text("COMPLETED")
    expect(line).to_have_count(0)


def test_a_workflow_page_draws_its_steps_and_links_them(
    ui: ModuleType, workers: WorkerFactory, dashboard: DashboardProcess, page: Page, screenshots: Path
) -> None:
    workers.start(APP, "--queues", "default", "--processes", "2")
    add = ui.add
    top = add.node(args=(1, 2), name="top")
    left = add.node(kwargs={"b": 10}, args_from={"a": top}, name="left")
    right = add.node(kwargs={"b": 100}, args_from={"a": top}, name="right")
    join = add.with_options(queue="images").node(args_from={"a": left, "b": right}, name="join")
    flow = ui.app.workflow("diamond", [top, left, right, join]).start()

    page.goto(f"{dashboard.url}#/workflow/{flow.id}")
    unlock(page)
    expect(page.locator(".page-workflow h2")).to_contain_text("diamond")
    graph = page.locator("#workflow-graph")
    expect(graph.locator(".step")).to_have_count(4)
    # join waits on `images`, which nobody serves; the three before it completed.
    expect(graph.locator(".step.COMPLETED")).to_have_count(3)
    expect(graph.locator("svg.edges path")).to_have_count(4)  # top->left, top->right, left->join, right->join
    layers = graph.locator(".layer")
    expect(layers).to_have_count(3)
    assert layers.nth(1).locator(".step").all_inner_texts()[0].startswith("left")
    expect(page.locator("#steps tbody tr")).to_have_count(4)
    page.screenshot(path=str(screenshots / "dashboard-workflow.png"), full_page=True)

    graph.locator("[data-node=join]").click()
    expect(page).to_have_url(re.compile(r"#/task/"))
    expect(page.locator("#task-fields tr[data-field=workflow]")).to_contain_text("step join of diamond")

    # Workflow actions: pause, resume, cancel (with its confirmation).
    page.go_back()
    page.click("#pause-workflow")
    expect(page.locator("#workflow-fields tr[data-field=status]")).to_contain_text("PAUSED")
    page.click("#resume-workflow")
    expect(page.locator("#workflow-fields tr[data-field=status]")).to_contain_text("RUNNING")
    page.click("#cancel-workflow")
    page.click("text=Yes, cancel it")
    expect(page.locator("#workflow-fields tr[data-field=status]")).to_contain_text("CANCELLED")
    expect(page.locator("#flash")).to_contain_text(f"workflow {flow.id} cancelled")
    assert f"dashboard action cancel-workflow on workflow {flow.id} from 127.0.0.1" in dashboard.log()


def test_the_workers_and_queues_pages(
    ui: ModuleType, workers: WorkerFactory, dashboard: DashboardProcess, page: Page
) -> None:
    worker = workers.start(APP, "--queues", "default", "--processes", "1")
    running = ui.until_cancelled.send(60)
    wait_until(lambda: running.status().value == "RUNNING", WAIT, message="the task to run")

    page.goto(dashboard.url + "#/workers")
    expect(page.locator("#worker-list")).to_contain_text(worker.worker_id or "?")
    held = page.locator("#in-flight tbody tr")
    expect(held).to_have_count(1)
    expect(held.first).to_contain_text("ui.until_cancelled")
    expect(held.first).to_contain_text("RUNNING")

    page.click("nav >> text=Queues")
    queues = page.locator("#queues")
    expect(queues.locator("tbody tr")).to_have_count(2)  # default, and images (declared, no task)
    expect(queues.locator("tbody tr").first).to_contain_text("default")
    expect(queues.locator("tbody tr").nth(1)).to_contain_text("images")
    expect(queues.locator("button")).to_have_count(0)  # no token entered: no action
    running.cancel()


def test_read_only_mode_says_so_and_offers_no_action(
    ui: ModuleType, read_only_dashboard: DashboardProcess, page: Page, db: psycopg.Connection[Any]
) -> None:
    failed = ui.fail.send("NOPE")
    db.execute("UPDATE tether_tasks SET status = 'FAILED' WHERE id = %s", (failed.id,))
    page.goto(read_only_dashboard.url)
    expect(page.locator("#read-only")).to_have_text(
        "read-only: start with --token / TETHER_DASHBOARD_TOKEN to act"
    )
    expect(page.locator("#token")).to_have_count(0)
    for route in (f"#/task/{failed.id}", "#/queues", "#/tasks?status=FAILED"):
        page.goto(read_only_dashboard.url + route)
        expect(page.locator("main .page")).to_have_count(1)
        expect(page.locator("main button:not([type=submit])").filter(has_not_text="Refresh")).to_have_count(0)
    expect(page.locator("#retry-matching")).to_have_count(0)


def test_a_wrong_token_unlocks_nothing(ui: ModuleType, dashboard: DashboardProcess, page: Page) -> None:
    page.goto(dashboard.url + "#/queues")
    unlock_attempt = page.locator("#token")
    unlock_attempt.fill("not-the-token")
    page.click("text=Unlock actions")
    expect(page.locator("#flash")).to_contain_text("token refused: wrong dashboard token")
    expect(page.locator("#can-act")).to_have_count(0)
    assert page.evaluate("sessionStorage.length") == 0
    assert "dashboard refused auth-check from 127.0.0.1: wrong dashboard token" in dashboard.log()


def test_beyond_loopback_the_page_asks_for_the_token_before_it_shows_anything(
    ui: ModuleType, database_url: str, tmp_path: Path, page: Page
) -> None:
    handle = ui.add.with_options(queue="images").send(1, 2)
    public = DashboardProcess(database_url, tmp_path, TOKEN).start("--host", "0.0.0.0")
    try:
        url = public.url.replace("0.0.0.0", "127.0.0.1")
        page.goto(f"{url}#/task/{handle.id}")
        expect(page.locator("#needs-token")).to_contain_text("enter its token")
        expect(page.locator("#task-fields")).to_have_count(0)
        unlock(page)
        expect(page.locator("#task-fields tr[data-field=status]")).to_contain_text("PENDING")
        page.click("#lock")  # forget the token: the data goes away with it
        expect(page.locator("#needs-token")).to_be_visible()
    finally:
        public.stop()
    assert TOKEN not in public.log()


# 25,000 finished tasks of about 1.6 kB each (40 MB: more pages than the counts' sample of
# 2,000, more rows than a task list's scan of 20,000): queue "rare" every 2,000th.
LARGE_HISTORY = """
INSERT INTO tether_tasks (id, name, queue, status, args, run_at, sent_at, enqueued_at, updated_at)
SELECT (lpad(to_hex((extract(epoch FROM ts) * 1000)::bigint), 12, '0') || '7'
        || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid,
       'ui.add', CASE WHEN i % 2000 = 0 THEN 'rare' ELSE 'default' END, 'COMPLETED',
       jsonb_build_array(i, repeat('x', 1500)), ts, ts, ts, ts
FROM (SELECT i, md5(i::text) AS h, now() - interval '1 day' + i * interval '1 second' AS ts
      FROM generate_series(1, 25000) AS i) AS made
"""


def test_on_a_large_table_counts_are_marked_estimates_and_lists_search_further(
    ui: ModuleType, dashboard: DashboardProcess, page: Page, db: psycopg.Connection[Any]
) -> None:
    db.execute(LARGE_HISTORY)
    pending = ui.add.send(1, 2)  # nobody serves default here: it stays PENDING, counted exactly

    page.goto(dashboard.url)
    counts = page.locator("#counts")
    expect(counts.locator("a.estimate").first).to_contain_text("≈")  # COMPLETED: sampled
    expect(counts.locator("tbody tr").filter(has_text="default").locator("a.num").first).to_have_text("1")
    expect(page.locator("#counts-estimated")).to_contain_text("estimated from a sample")
    page.click("nav >> text=Queues")
    expect(page.locator("#queues a.estimate").first).to_contain_text("≈")
    expect(page.locator("#queues-estimated")).to_contain_text("estimated from a sample")

    # 12 tasks of queue rare, one every 2,000: the first page reads 20,000 rows and finds 10.
    page.goto(dashboard.url + "#/tasks?queue=rare")
    rows = page.locator("#task-list tbody tr")
    expect(rows).to_have_count(10)
    expect(page.locator("#searched-to")).to_contain_text("older tasks are not searched yet")
    page.click("#search-further")
    expect(rows).to_have_count(2)
    expect(page.locator("#searched-to")).to_have_count(0)
    expect(page.locator("#next-page")).to_have_count(0)
    assert pending.status().value == "PENDING"
