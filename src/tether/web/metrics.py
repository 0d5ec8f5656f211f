"""``GET /metrics`` of the dashboard: the queues' state for Prometheus (docs/monitoring.md).

The dashboard runs no task, so it serves what the database says, read once per scrape:
tasks per queue and status, each queue's lag, workers by status. A worker's endpoint
(--metrics-port) adds its own counters (outcomes, recoveries, claims, heartbeats).
Beyond loopback the token guards it like every read: Prometheus sends it as a bearer token
(``authorization: {credentials: ...}`` in its scrape config).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from tether.broker import PostgresBroker
from tether.broker.types import Conn
from tether.metrics.queue_state import QueueStateCollector


class DashboardMetrics:
    def __init__(self, broker: PostgresBroker) -> None:
        self.broker = broker
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(QueueStateCollector(self._connect))

    @contextlib.contextmanager
    def _connect(self) -> Iterator[Conn]:
        with self.broker.connection() as conn:
            yield conn

    def exposition(self, accept: str | None) -> tuple[str, bytes]:
        """(content type, body) in the format the scraper accepts."""
        encoder, content_type = choose_encoder(accept or "")
        return content_type, encoder(self.registry)
