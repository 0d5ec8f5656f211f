"""A worker's /metrics endpoint (``tether worker --metrics-port``): its own counters, and the
queues' state read from the database at each scrape."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from tether.app import Tether
from tether.broker.types import Conn
from tether.config import WorkerConfig
from tether.db.connection import DedicatedConnection
from tether.errors import InvalidOptionError
from tether.metrics import hooks
from tether.metrics.labels import Labels
from tether.metrics.queue_state import QueueStateCollector
from tether.metrics.worker import WorkerMetrics

log = logging.getLogger("tether.metrics")


def app_labels(app: Tether) -> Labels:
    """The task names the app registers and the error codes its retry policies name."""
    codes: set[str] = set()
    for task in app.tasks.values():
        if task.retry_policy is not None:
            codes |= task.retry_policy.auto_retry_for
    return Labels(app.tasks, codes)


class WorkerEndpoint:
    """The running endpoint: the worker's metrics, installed as the hooks' sink until close()."""

    def __init__(
        self,
        app: Tether,
        url: str,
        config: WorkerConfig,
        in_flight: Callable[[], float],
        children: Callable[[], float],
    ) -> None:
        assert config.metrics_port is not None
        self.metrics = WorkerMetrics(app_labels(app), in_flight, children)
        self._connection = DedicatedConnection(url, app.config, "metrics")
        self._lock = threading.Lock()
        self.metrics.registry.register(QueueStateCollector(self._connect))
        try:
            self._server, self._thread = start_http_server(
                config.metrics_port, config.metrics_host, self.metrics.registry
            )
        except OSError as exc:
            raise InvalidOptionError(
                f"metrics_port: cannot serve metrics on {config.metrics_host}:{config.metrics_port}: "
                f"{exc.strerror or exc}"
            ) from exc
        hooks.install(self.metrics)
        log.info("metrics served on http://%s:%d/metrics", config.metrics_host, self.port)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @contextlib.contextmanager
    def _connect(self) -> Iterator[Conn]:
        with self._lock:
            try:
                yield self._connection.get()
            except Exception:
                self._connection.close()  # a broken connection is opened afresh at the next scrape
                raise

    def close(self) -> None:
        hooks.install(None)
        server: WSGIServer = self._server
        server.shutdown()
        server.server_close()
        self._thread.join(timeout=5)
        with self._lock:
            self._connection.close()
