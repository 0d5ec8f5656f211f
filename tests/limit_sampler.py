"""A thread that samples a queue's in-flight tasks every 20 ms (tests of docs/limits.md): the
most seen at once per concurrency key and in the whole queue."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import psycopg


class InFlightSampler:
    def __init__(self, url: str, queue: str, interval_s: float = 0.02) -> None:
        self.url = url
        self.queue = queue
        self.interval_s = interval_s
        self.max_per_key: Counter[str | None] = Counter()
        self.max_total = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> InFlightSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.is_set():
                rows = conn.execute(
                    "SELECT concurrency_key, count(*) FROM tether_tasks "
                    "WHERE queue = %s AND status IN ('CLAIMED', 'RUNNING') GROUP BY concurrency_key",
                    (self.queue,),
                ).fetchall()
                for key, n in rows:
                    self.max_per_key[key] = max(self.max_per_key[key], n)
                self.max_total = max(self.max_total, sum(n for _, n in rows))
                self.samples += 1
                self._stop.wait(self.interval_s)
