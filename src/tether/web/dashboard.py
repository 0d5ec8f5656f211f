"""``tether dashboard``: a read-only web page of queues, workers, stale tasks and recent failures.

Served by the standard library's ThreadingHTTPServer. The page is one static HTML file
that fetches ``/api/status`` every few seconds and fills its tables in the browser, so a
web framework would add a dependency and nothing else. The page cannot change anything,
on purpose. Recovery and cancellation stay in the CLI and the Python API, where they can
be scripted and audited. The server binds to 127.0.0.1 unless told otherwise, because
task names, errors and hostnames are not for everyone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from tether.broker import PostgresBroker
from tether.config import RecoveryConfig

log = logging.getLogger("tether.web")

RECENT_FAILURES = 20
# However many pages are open, the database is asked at most this often: the counts
# read the whole task table.
SNAPSHOT_MAX_AGE_S = 1.0
# The page's own inline script and style, and fetches back to this server; nothing else.
CSP = "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True  # a browser's keep-alive connection must not hold up Ctrl-C

    def __init__(self, address: tuple[str, int], broker: PostgresBroker, recovery: RecoveryConfig) -> None:
        super().__init__(address, DashboardHandler)
        self.broker = broker
        self.recovery = recovery
        self.page = resources.files("tether.web").joinpath("dashboard.html").read_bytes()
        self._lock = threading.Lock()
        self._cached: tuple[float, bytes] | None = None

    def status_json(self) -> bytes:
        """The snapshot as JSON, read afresh unless one younger than SNAPSHOT_MAX_AGE_S exists."""
        with self._lock:  # concurrent requests wait for one read instead of each making their own
            if self._cached is not None and time.monotonic() - self._cached[0] < SNAPSHOT_MAX_AGE_S:
                return self._cached[1]
            snapshot = self.broker.status_snapshot(
                self.recovery.running_stale_threshold_ms, failures=RECENT_FAILURES, with_schedules=True
            )
            shown = {**dataclasses.asdict(snapshot), "generated_at": datetime.now(UTC)}
            body = json.dumps(shown, default=str).encode()
            self._cached = (time.monotonic(), body)
            return body

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"


class DashboardHandler(BaseHTTPRequestHandler):
    server: DashboardServer

    def do_GET(self) -> None:  # the name http.server dispatches GET requests to
        path = self.path.split("?", 1)[0]
        if path == "/":
            self._reply(200, "text/html; charset=utf-8", self.server.page)
        elif path == "/api/status":
            try:
                body = self.server.status_json()
            except Exception as exc:
                # The database went away: the page says so and keeps polling.
                log.warning("dashboard could not read the status: %s", exc)
                self._reply(503, "application/json", json.dumps({"error": str(exc)}).encode())
                return
            self._reply(200, "application/json", body)
        else:
            self._reply(404, "text/plain; charset=utf-8", b"not found\n")

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # the base class's signature
        log.debug("%s %s", self.address_string(), format % args)
