"""The dashboard in a real headless browser: Debian's chromium driven by Playwright.

Each test gets a real `tether dashboard` process (``python -m tether dashboard``) on the
run's database, real worker processes (tests/harness.py), and a fresh browser context.
Playwright's own browser download is never used: the browser is the system's chromium
(TETHER_CHROMIUM names another binary). A missing browser fails the tests, with how to
install it; they are never skipped (scripts/test installs it when run as root).

With TETHER_SCREENSHOTS=1 the tests that take screenshots write them into docs/images/
(docs/dashboard.md shows them); otherwise into the test's temporary folder.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright, sync_playwright

from tests.conftest import REPO

CHROMIUM = os.environ.get("TETHER_CHROMIUM", "/usr/bin/chromium")
TOKEN = "browser-test-token-5c1d0e"
WAIT = 30.0


def chromium_path() -> str:
    found = shutil.which(CHROMIUM)
    if found is None:
        pytest.fail(
            f"no chromium at {CHROMIUM}: the dashboard's browser tests need it (they are never "
            "skipped). Install it with `sudo apt-get install chromium` (Debian, Ubuntu), or set "
            "TETHER_CHROMIUM to a Chromium or Chrome binary. scripts/test installs it when run as root.",
            pytrace=False,
        )
    return found


# Package scope, not session: Playwright's sync API runs an event loop in the main thread
# while it is open, and the asyncio tests that run after tests/browser need it closed.
@pytest.fixture(scope="package")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="package")
def browser(playwright: Playwright) -> Iterator[Browser]:
    # As root, chromium refuses to start without --no-sandbox; a container may lack the
    # user namespaces its sandbox needs as well.
    args = ["--no-sandbox"] if os.geteuid() == 0 or os.environ.get("TETHER_CHROMIUM_NO_SANDBOX") else []
    browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=args)
    try:
        yield browser
    finally:
        browser.close()


@dataclass
class PageErrors:
    """What went wrong inside the page: uncaught exceptions and console errors."""

    messages: list[str] = field(default_factory=list)

    def console(self, message: ConsoleMessage) -> None:
        # A refused action is an answer the page shows, not a page error: the browser
        # logs the 4xx of its fetch all the same.
        if message.type == "error" and "status of 4" not in message.text:
            self.messages.append(f"console: {message.text}")


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(WAIT * 1000)
    page = context.new_page()
    errors = PageErrors()
    page.on("console", errors.console)
    page.on("pageerror", lambda exc: errors.messages.append(f"exception: {exc}"))
    try:
        yield page
    finally:
        context.close()
    assert errors.messages == [], errors.messages


@pytest.fixture(scope="session")
def ui_app(database_url: str) -> Iterator[ModuleType]:
    module = importlib.import_module("tests.browser.app")
    assert module.app.config.broker.database_url == database_url
    try:
        yield module
    finally:
        module.app.close()  # its pool and result listener, before the database is dropped


@pytest.fixture
def ui(ui_app: ModuleType, db: psycopg.Connection[Any]) -> ModuleType:
    """tests/browser/app.py bound to the run's database, on clean tables."""
    return ui_app


@dataclass
class DashboardProcess:
    """A `tether dashboard` process: started, read for its URL, stopped by its pid."""

    database_url: str
    log_dir: Path
    token: str | None
    url: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def out_path(self) -> Path:
        return self.log_dir / "dashboard.out"

    @property
    def err_path(self) -> Path:
        return self.log_dir / "dashboard.log"

    def start(self, *args: str) -> DashboardProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("TETHER_DASHBOARD_TOKEN", None)
        if self.token is not None:
            env["TETHER_DASHBOARD_TOKEN"] = self.token
        cmd = [sys.executable, "-m", "tether", "--log-level", "DEBUG", "dashboard", "--port", "0"]
        cmd += ["--database-url", self.database_url, *args]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True
            )
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            first = self.out_path.read_text().split("\n", 1)[0]
            if first.startswith("tether dashboard on "):
                self.url = first.split(" on ", 1)[1].split(" ", 1)[0]
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"the dashboard did not start:\n{self.out_path.read_text()}\n{self.log()}")

    def log(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the group id is its pid
            self.proc.wait()


def _dashboard(database_url: str, tmp_path: Path, token: str | None) -> Iterator[DashboardProcess]:
    folder = tmp_path / ("dashboard" if token else "dashboard-read-only")
    folder.mkdir()
    process = DashboardProcess(database_url, folder, token).start("--app", "tests.browser.app:app")
    try:
        yield process
    finally:
        process.stop()
        # The token travels in headers only: it is never in the dashboard's log, even at DEBUG.
        if token is not None:
            assert token not in process.log() and token not in process.out_path.read_text()


@pytest.fixture
def dashboard(database_url: str, tmp_path: Path) -> Iterator[DashboardProcess]:
    """A dashboard with the token TOKEN: the page can act once it is entered."""
    yield from _dashboard(database_url, tmp_path, TOKEN)


@pytest.fixture
def read_only_dashboard(database_url: str, tmp_path: Path) -> Iterator[DashboardProcess]:
    yield from _dashboard(database_url, tmp_path, None)


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where screenshots go: docs/images with TETHER_SCREENSHOTS=1, else the test's folder."""
    if os.environ.get("TETHER_SCREENSHOTS") == "1":
        folder = REPO / "docs" / "images"
        folder.mkdir(exist_ok=True)
        return folder
    return tmp_path


def unlock(page: Page, token: str = TOKEN) -> None:
    """Enter the dashboard's token in the page (kept in sessionStorage for the tab)."""
    page.fill("#token", token)
    page.click("text=Unlock actions")
    page.wait_for_selector("#can-act")
