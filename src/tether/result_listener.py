"""Routes 'task finished' notifications to the handles waiting in this process.

One background thread per process LISTENs on 'tether_done' and wakes the waiter
for that task id. Waiters also re-read the row every result_poll_interval_ms,
so a lost notification (connection drop, server restart) only delays a result.
Behind a transaction pooler with no listen_url (docs/pgbouncer.md) nothing listens:
waiters find their result by that poll alone.
How a handle waits with it is in result_wait.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from tether.broker import PostgresBroker, notifications
from tether.broker.types import DatabaseError
from tether.db import read_only

log = logging.getLogger("tether.result_listener")

Wake = Callable[[], None]


class ResultListener:
    def __init__(self, broker: PostgresBroker) -> None:
        self._broker = broker
        self._lock = threading.Lock()
        self._waiters: dict[str, list[Wake]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.listening = threading.Event()

    def subscribe(self, task_id: str, wake: Wake) -> None:
        with self._lock:
            self._waiters.setdefault(task_id, []).append(wake)
            if self._broker.listen_url is None:
                return  # behind a transaction pooler with no listen_url: the waiter polls
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="tether-result-listener", daemon=True)
                self._thread.start()

    def unsubscribe(self, task_id: str, wake: Wake) -> None:
        with self._lock:
            wakes = self._waiters.get(task_id)
            if wakes and wake in wakes:
                wakes.remove(wake)
                if not wakes:
                    del self._waiters[task_id]

    def wait_listening(self, timeout: float) -> bool:
        return self.listening.wait(timeout)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                with self._broker.connect_listener() as conn:
                    refusals = read_only.refusals()
                    notifications.listen(conn, notifications.DONE_CHANNEL)
                    self.listening.set()
                    # What finished before LISTEN took effect notified nobody (the first
                    # connection, or a reconnection): every waiter looks at its row again.
                    self._wake_all()
                    backoff = 0.1
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self._wake(note.payload)
                        if read_only.refusals() > refusals:
                            # This process met a read-only server (a failover): this session
                            # may sit on the old primary, where nothing new is announced.
                            raise read_only.ServerReadOnlyError("a failover was seen by this process")
                        with self._lock:
                            if not self._waiters:
                                # Nobody waits: let the thread and its connection go.
                                self._thread = None
                                self.listening.clear()
                                return
            except (DatabaseError, OSError, ConnectionError) as exc:
                self.listening.clear()
                log.warning("result listener lost its connection (%s); retrying in %.1fs", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _wake_all(self) -> None:
        with self._lock:
            task_ids = list(self._waiters)
        for task_id in task_ids:
            self._wake(task_id)

    def _wake(self, task_id: str) -> None:
        with self._lock:
            wakes = list(self._waiters.get(task_id, ()))
        for wake in wakes:
            try:
                wake()
            except RuntimeError as exc:  # e.g. the waiter's event loop already closed
                log.debug("could not wake a waiter for %s: %s", task_id, exc)
