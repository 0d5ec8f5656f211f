"""``tether dashboard``: the server. Routes requests, serves the page, guards the actions.

The standard library's ThreadingHTTPServer serves one static page (HTML, CSS and
JavaScript files shipped in tether/web/static) that draws itself from JSON endpoints, so
a web framework would add a dependency and nothing else. GET requests only read
(tether.web.api); actions are POST requests with a JSON body and the dashboard's token in
a header (tether.web.auth, tether.web.actions), each logged at INFO with what it changed
and the client's address, never with the token. Without a token the dashboard is
read-only. It binds to 127.0.0.1 unless told otherwise, because task arguments, errors
and hostnames are not for everyone; beyond loopback it needs a token. Every request
must name the dashboard in its Host header (tether.web.hosts: DNS rebinding).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from tether.broker import PostgresBroker
from tether.broker.status import status_snapshot
from tether.config import RecoveryConfig
from tether.errors import DatabaseUnreachableError, InvalidOptionError
from tether.web import actions, api, charts
from tether.web.auth import READ_ONLY_NOTE, Access, Refusal, is_loopback
from tether.web.charts import Charts
from tether.web.hosts import HostCheck
from tether.web.jsonout import ApiError, encode
from tether.web.metrics import DashboardMetrics

log = logging.getLogger("tether.web")

RECENT_FAILURES = 20
# However many pages are open, the database is asked at most this often: the counts
# read the whole task table.
SNAPSHOT_MAX_AGE_S = 1.0
MAX_BODY = 64 * 1024
# This server's own files and fetches back to it; no inline script or style, no frames.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}

Query = dict[str, list[str]]
Reader = Callable[["DashboardServer", Query, "re.Match[str]"], Any]


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True  # a browser's keep-alive connection must not hold up Ctrl-C

    def __init__(
        self,
        address: tuple[str, int],
        broker: PostgresBroker,
        recovery: RecoveryConfig,
        *,
        token: str | None = None,
        private_reads: bool = False,
        queues: Sequence[str] = (),
        allowed_hosts: Sequence[str] = (),
        chart_sample_s: float = charts.SAMPLE_S,
    ) -> None:
        self.access = Access(token, private_reads=private_reads)  # before binding: may refuse
        # Before binding too: a bad --allowed-host is refused with nothing opened.
        self.hosts = HostCheck.for_bind(address[0], allowed_hosts, loopback=is_loopback(address[0]))
        super().__init__(address, DashboardHandler)
        self.broker = broker
        self.recovery = recovery
        self.queues = tuple(queues)  # the app's declared queues: listed even without tasks
        web = resources.files("tether.web")
        self.page = web.joinpath("dashboard.html").read_bytes()
        self.static = {
            entry.name: (STATIC_TYPES[suffix], entry.read_bytes())
            for entry in web.joinpath("static").iterdir()
            if (suffix := "." + entry.name.rpartition(".")[2]) in STATIC_TYPES
        }
        self._lock = threading.Lock()
        self._cached: tuple[float, bytes] | None = None
        self.metrics = DashboardMetrics(broker)
        self.charts = Charts(broker, sample_s=chart_sample_s)
        self.charts.start()

    def server_close(self) -> None:
        # Also called by the base class's __init__ when the bind fails, before the charts exist.
        charts_ = self.__dict__.get("charts")
        if charts_ is not None:
            charts_.stop()
        super().server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """An error while answering a request: through the dashboard's log (so in its format,
        JSON too), not socketserver's traceback printed to stderr. A client that went away
        before its answer was written (a closed tab, a test reading only the status) is
        no error of the dashboard's: a DEBUG line."""
        error = sys.exc_info()[1]
        if isinstance(error, (BrokenPipeError, ConnectionResetError)):
            log.debug("dashboard: %s went away before its answer was written", client_address[0])
            return
        log.error("dashboard: error answering %s", client_address[0], exc_info=error)

    def status_json(self) -> bytes:
        """The snapshot as JSON, read afresh unless one younger than SNAPSHOT_MAX_AGE_S exists."""
        with self._lock:  # concurrent requests wait for one read instead of each making their own
            if self._cached is not None and time.monotonic() - self._cached[0] < SNAPSHOT_MAX_AGE_S:
                return self._cached[1]
            snapshot = status_snapshot(
                self.broker,
                self.recovery.running_stale_threshold_ms,
                failures=RECENT_FAILURES,
                with_schedules=True,
            )
            shown = {**dataclasses.asdict(snapshot), "generated_at": datetime.now(UTC)}
            body = json.dumps(shown, default=str).encode()
            self._cached = (time.monotonic(), body)
            return body

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host!s}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}/"


# -- the read endpoints: path pattern -> what answers it -------------------------------------------


def _meta(server: DashboardServer, query: Query, match: re.Match[str]) -> Any:
    can_act = server.access.can_act
    return {
        "can_act": can_act,
        "note": None if can_act else READ_ONLY_NOTE,
        "reads_need_token": server.access.private_reads,
        "actions": sorted(actions.ACTIONS),
    }


GET_ROUTES: list[tuple[re.Pattern[str], Reader]] = [
    (re.compile(r"/api/meta"), _meta),
    (re.compile(r"/api/tasks"), lambda s, q, m: api.tasks_page(s.broker, q)),
    (re.compile(r"/api/tasks/(?P<id>[^/]+)"), lambda s, q, m: api.task_page(s.broker, m["id"])),
    (re.compile(r"/api/workflows"), lambda s, q, m: api.workflows_page(s.broker, q)),
    (re.compile(r"/api/workflows/(?P<id>[^/]+)"), lambda s, q, m: api.workflow_page(s.broker, m["id"])),
    (re.compile(r"/api/queues"), lambda s, q, m: api.queues_page(s.broker, s.queues)),
    (re.compile(r"/api/workers"), lambda s, q, m: api.workers_page(s.broker, q)),
    (re.compile(r"/api/charts"), lambda s, q, m: s.charts.answer(api.text(q, "range") or "1h")),
]
ACTION_PATH = re.compile(r"/api/actions/(?P<name>[a-z-]+)")
CHECK_PATH = "/api/auth/check"


def _challenge(refusal: Refusal) -> dict[str, str]:
    return {"WWW-Authenticate": 'Bearer realm="tether dashboard"'} if refusal.code == 401 else {}


class DashboardHandler(BaseHTTPRequestHandler):
    server: DashboardServer

    def do_GET(self) -> None:  # the name http.server dispatches GET requests to
        if self._host_refused():
            return
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        if path == "/":
            self._reply(200, "text/html; charset=utf-8", self.server.page)
            return
        if path.startswith("/static/"):
            found = self.server.static.get(path.removeprefix("/static/"))
            if found is None:
                self._reply(404, "text/plain; charset=utf-8", b"not found\n")
            else:
                self._reply(200, *found)
            return
        if (path.startswith("/api/") and path != "/api/meta") or path == "/metrics":
            refusal = self.server.access.read_refusal(self.headers)
            if refusal is not None:
                log.info(
                    "dashboard refused a read of %s from %s: %s",
                    path,
                    self.client_address[0],
                    refusal.message,
                )
                self._json(refusal.code, {"error": refusal.message}, _challenge(refusal))
                return
        if path == "/api/status":
            try:
                body = self.server.status_json()
            except Exception as exc:
                # The database went away: the page says so and keeps polling.
                log.warning("dashboard could not read the status: %s", exc)
                self._json(503, {"error": str(exc)})
                return
            self._reply(200, "application/json", body)
            return
        if path == "/metrics":
            self._reply(200, *self.server.metrics.exposition(self.headers.get("Accept")))
            return
        for pattern, reader in GET_ROUTES:
            match = pattern.fullmatch(path)
            if match is not None:
                self._answer(reader, parse_qs(parts.query), match)
                return
        self._reply(404, "text/plain; charset=utf-8", b"not found\n")

    def do_POST(self) -> None:  # the name http.server dispatches POST requests to
        if self._host_refused():
            return
        path = urlsplit(self.path).path
        match = ACTION_PATH.fullmatch(path)
        if path != CHECK_PATH and (match is None or match["name"] not in actions.ACTIONS):
            self._json(404, {"error": f"no action at {path}"})
            return
        name = "auth-check" if match is None else match["name"]
        client = self.client_address[0]
        refusal = self.server.access.refusal(self.headers)
        if refusal is not None:
            log.warning("dashboard refused %s from %s: %s", name, client, refusal.message)
            self._json(refusal.code, {"error": refusal.message}, _challenge(refusal))
            return
        try:
            body = self._body()
        except ApiError as exc:
            self._json(exc.code, {"error": exc.message})
            return
        if match is None:
            self._json(200, {"ok": True})
            return
        self._act(name, body, client)

    def _host_refused(self) -> bool:
        """Refuse (and say so) a request whose Host does not name this dashboard."""
        refusal = self.server.hosts.refusal(self.headers.get_all("Host") or [])
        if refusal is None:
            return False
        log.warning(
            "dashboard refused %s %s from %s: %s",
            self.command,
            urlsplit(self.path).path,
            self.client_address[0],
            refusal.message,
        )
        self._json(refusal.code, {"error": refusal.message})
        return True

    def _act(self, name: str, body: dict[str, Any], client: str) -> None:
        by = f"dashboard:{client}"
        try:
            acted = actions.ACTIONS[name](self.server, body, by)
        except (ApiError, InvalidOptionError) as exc:
            code, message = (exc.code, exc.message) if isinstance(exc, ApiError) else (400, str(exc))
            log.info("dashboard action %s from %s refused: %s", name, client, message)
            self._json(code, {"error": message})
            return
        except DatabaseUnreachableError as exc:
            log.warning("dashboard action %s from %s failed: %s", name, client, exc)
            self._json(503, {"error": str(exc)})
            return
        except Exception:
            log.exception("dashboard action %s from %s failed", name, client)
            self._json(500, {"error": f"the action {name} failed; the dashboard's log says why"})
            return
        log.info("dashboard action %s on %s from %s: %s", name, acted.target, client, acted.message)
        self._json(200, {"ok": True, **acted.reply()})

    def _body(self) -> dict[str, Any]:
        kind = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            raise ApiError(415, "send the action as JSON (Content-Type: application/json)")
        try:
            length = int(self.headers.get("Content-Length") or "")
        except ValueError:
            raise ApiError(411, "Content-Length is required") from None
        if not 0 <= length <= MAX_BODY:
            raise ApiError(413, f"the body is over {MAX_BODY} bytes")
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw)
        except ValueError:
            raise ApiError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def _answer(self, reader: Reader, query: Query, match: re.Match[str]) -> None:
        try:
            value = reader(self.server, query, match)
        except ApiError as exc:
            self._json(exc.code, {"error": exc.message})
        except DatabaseUnreachableError as exc:
            log.warning("dashboard could not read: %s", exc)
            self._json(503, {"error": str(exc)})
        except Exception:
            log.exception("dashboard read %s failed", urlsplit(self.path).path)
            self._json(500, {"error": "the read failed; the dashboard's log says why"})
        else:
            self._json(200, value)

    def _json(self, code: int, value: Any, headers: dict[str, str] | None = None) -> None:
        self._reply(code, "application/json", encode(value), headers)

    def _reply(
        self, code: int, content_type: str, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Resource-Policy", "same-origin")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # the base class's signature
        # The request line and status only: headers (where the token travels) are never logged.
        log.debug("%s %s", self.address_string(), format % args)
