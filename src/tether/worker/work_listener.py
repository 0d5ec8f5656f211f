"""The work listener, a background service (services.py): LISTEN for new work, schedule
changes and operators' requests, and wake the claim loop, the scheduler or the worker.

One tick either (re)connects and LISTENs, then calls ``on_listening`` (notifications sent
while it was not listening are lost, so the worker looks once for what it may have
missed), or hands on the notifications that arrive within ``listen_for_s``. When the
connection drops, the next tick connects again, after 0.1 s, backing off up to 5 s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from psycopg import Notify

from tether.broker import notifications
from tether.broker.types import AsyncConn
from tether.config import AppConfig
from tether.db.connection import AsyncDedicatedConnection
from tether.worker.backoff import Backoff
from tether.worker.services import Service

log = logging.getLogger("tether.worker.work_listener")

# How long one tick waits for notifications. Nothing goes on the wire while it waits, and a
# notification that arrives between two ticks is kept by psycopg for the next one, so the
# length changes nothing but how often the runner's loop turns while the worker is idle.
LISTEN_FOR_S = 60.0


class WorkListener(Service):
    """Calls ``on_work(queue, run_at)`` for every notification of new work on one of
    ``queues`` (``run_at``: the earliest due time announced, Unix seconds in database time;
    None if unreadable), ``on_schedules()`` for every change to a schedule of one of them, and
    ``on_control(verb, arguments)`` for every operator's request (notifications.py lists them)."""

    name = "work listener"
    log = log
    failure_level = logging.WARNING

    def __init__(
        self,
        url: str,
        config: AppConfig,
        queues: set[str],
        *,
        on_work: Callable[[str, float | None], None],
        on_listening: Callable[[], None],
        on_schedules: Callable[[], None],
        on_control: Callable[[str, list[str]], None],
        listen_for_s: float = LISTEN_FOR_S,
    ) -> None:
        super().__init__(Backoff(0.1, 5.0))
        self.connection = AsyncDedicatedConnection(url, config, "listener")
        self.queues = queues
        self.on_work = on_work
        self.on_listening = on_listening
        self.on_schedules = on_schedules
        self.on_control = on_control
        self.listen_for_s = listen_for_s
        self._listening: AsyncConn | None = None  # the connection that LISTENs

    async def tick(self) -> float:
        conn = self._listening
        if conn is None or conn.closed:
            conn = await self.connection.get()
            await notifications.listen_worker_async(conn)
            self._listening = conn
            self.on_listening()
            return 0.0
        async for note in conn.notifies(timeout=self.listen_for_s):
            self._hand_on(note)
        return 0.0

    def _hand_on(self, note: Notify) -> None:
        if note.channel == notifications.CONTROL_CHANNEL:
            verb, *arguments = note.payload.split(" ")
            self.on_control(verb, arguments)
            return
        queue, _, run_at = note.payload.partition(" ")
        if queue not in self.queues:
            return
        if note.channel == notifications.SCHEDULES_CHANNEL:
            self.on_schedules()
        else:
            self.on_work(queue, _epoch(run_at))

    async def close(self) -> None:
        self._listening = None
        await self.connection.close()


def _epoch(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
