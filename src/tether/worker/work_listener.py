"""The work listener, a background service (services.py): LISTEN for new work, schedule
changes and operators' requests, and wake the claim loop, the scheduler or the worker.

One tick either (re)connects and LISTENs, then calls ``on_listening`` (notifications sent
while it was not listening are lost, so the worker looks once for what it may have
missed), or hands on the notifications that arrive within ``listen_for_s``. When the
connection drops, the next tick connects again, after 0.1 s, backing off up to 5 s.

A notification of work due later carries its run_at by the server's clock. The listener
reads that clock when it connects (and every CLOCK_READ_EVERY_S after, sooner while its
answer came back too slowly to be exact: CLOCK_SLACK_S) and counts on from it with the
monotonic clock: a host whose wall clock is off (by seconds or by hours) still wakes the
claim loop when the task is due, not a poll interval later.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from psycopg import Notify

from tether.broker import notifications, workers
from tether.broker.types import AsyncConn
from tether.config import AppConfig
from tether.db import read_only
from tether.db.connection import AsyncDedicatedConnection
from tether.worker.backoff import Backoff
from tether.worker.services import Service

log = logging.getLogger("tether.worker.work_listener")

# How long one tick waits for notifications. Nothing goes on the wire while it waits, and a
# notification that arrives between two ticks is kept by psycopg for the next one, so the
# length changes nothing but how often the runner's loop turns while the worker is idle, and
# how soon a tick sees that another connection of this process met a read-only server.
LISTEN_FOR_S = 5.0

#: TCP keepalives of the listener's connection, tighter than every other's (db/connection.py
#: TCP_SETTINGS): it only receives, so a server or a link gone dead shows only through them.
#: Idle 2 s, then 3 probes 1 s apart: a dead connection is closed about 5 s after its last
#: packet (docs/high-availability.md). Probes are TCP segments, not statements: no cost to
#: the server's executor, one small packet a second each way per idle worker.
LISTENER_TCP: dict[str, int] = {
    "keepalives_idle": 2,
    "keepalives_interval": 1,
    "keepalives_count": 3,
    "tcp_user_timeout": 5_000,
}

#: How much of its worker's id a listener's connection name keeps: 'tether-listener ' and
#: these make 63 bytes, all an application_name holds, and the end of the id (pid and
#: random part) is what tells two workers apart. `tether health` finds each active worker's
#: listener in pg_stat_activity by this name (broker/sql/health.sql, worker_liveness).
LISTENER_ID_CHARS = 47


def listener_role(worker_id: str | None) -> str:
    """The role of a work listener's connection, named ``tether-<role>`` in pg_stat_activity."""
    return "listener" if worker_id is None else f"listener {worker_id[-LISTENER_ID_CHARS:]}"


#: How long a reading of the server's clock is counted on from: the monotonic clock drifts
#: from the server's by at most a few hundred milliseconds an hour.
CLOCK_READ_EVERY_S = 600.0

#: A reading counts as exact when its answer came back within this long. The server read its
#: clock somewhere between question and answer, and the reading is counted from the answer: it
#: is behind the server's clock by up to the round trip. Behind by more than a notification's
#: margin (claim_triggers.DUE_NOW_S, less the ~1 ms a notification takes to arrive), every
#: task sent for now looks due a few milliseconds later and waits for a timer. That happened:
#: a listener connects while the worker starts its children, its answer waited 10-15 ms for
#: the busy event loop, and every pickup for the next ten minutes came 8-12 ms late.
CLOCK_SLACK_S = 0.002
#: A reading that is not exact is read again this soon, then twice as late each time while no
#: exact one comes (a loaded machine), up to CLOCK_READ_EVERY_S; the closest one is kept.
CLOCK_RETRY_S = 0.1
#: The most a notified task is taken to be due sooner than the kept reading says: without an
#: exact reading, a task said to be due within this (and DUE_NOW_S) is looked for at once too.
CLOCK_DOUBT_MAX_S = 1.0


class ServerClock:
    """The server's wall clock as this process can tell it: the closest reading, counted on
    monotonically. ``monotonic``: the process's monotonic clock (a test's stand-in)."""

    def __init__(self, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._monotonic = monotonic
        self._reading: tuple[float, float] | None = None  # (server epoch, monotonic on the answer)
        self._spread = math.inf  # that reading's round trip: how far behind the server it may be
        self._tried_at = -math.inf  # monotonic time of the last reading, kept or not
        self._retry_s = CLOCK_RETRY_S  # how long after an inexact reading to read again

    def asking(self) -> float:
        """Call just before the question that reads the clock; pass the result to read()."""
        return self._monotonic()

    def read(self, epoch: float, asked_at: float, *, renew: bool = False) -> None:
        """The server's clock said ``epoch``, in an answer to a question asked at ``asked_at``
        (asking()). Counted from the answer, the server's time is never overestimated (the
        server read its clock before): a wake-up comes at most the round trip late, never
        early, when a claim would find nothing and the next look is a poll interval away. A
        reading with a longer round trip than the one kept replaces it only once that one is
        due for renewal, or with ``renew`` (a new session: maybe another server, another clock)."""
        answered = self._monotonic()
        spread = answered - asked_at
        renew = renew or self._reading is None or answered - self._reading[1] > CLOCK_READ_EVERY_S
        if renew or spread <= self._spread:
            self._reading, self._spread = (epoch, answered), spread
        self._tried_at = answered
        if self._spread <= CLOCK_SLACK_S or renew:
            self._retry_s = CLOCK_RETRY_S
        else:
            self._retry_s = min(2 * self._retry_s, CLOCK_READ_EVERY_S)

    @property
    def spread(self) -> float:
        """How far behind the server's clock the kept reading may be (inf: none yet)."""
        return self._spread

    def behind_by_at_most(self) -> float:
        """spread, within CLOCK_DOUBT_MAX_S: how much sooner than now() says a task may be due."""
        return min(self._spread, CLOCK_DOUBT_MAX_S)

    def read_in(self) -> float:
        """Seconds until the clock should be read again (0: now)."""
        if self._reading is None:
            return 0.0
        now = self._monotonic()
        renewal = self._reading[1] + CLOCK_READ_EVERY_S - now
        if self._spread > CLOCK_SLACK_S:
            renewal = min(renewal, self._tried_at + self._retry_s - now)
        return max(0.0, renewal)

    def due(self) -> bool:
        return self.read_in() <= 0.0

    def now(self) -> float:
        if self._reading is None:
            return time.time()  # not read yet: the host's clock is the best guess there is
        epoch, answered = self._reading
        return epoch + (self._monotonic() - answered)


class WorkListener(Service):
    """Calls ``on_work(queue, run_at, due_in)`` for every notification of new work on one of
    ``queues`` (``run_at``: the earliest due time announced, Unix seconds in database time;
    ``due_in``: seconds from now to it by the server's clock; both None if unreadable),
    ``on_schedules()`` for every change to a schedule of one of them, and ``on_control(verb,
    arguments)`` for every operator's request (notifications.py lists them)."""

    name = "work listener"
    log = log
    failure_level = logging.WARNING

    def __init__(
        self,
        url: str,
        config: AppConfig,
        queues: set[str],
        *,
        on_work: Callable[[str, float | None, float | None], None],
        on_listening: Callable[[], None],
        on_schedules: Callable[[], None],
        on_control: Callable[[str, list[str]], None],
        listen_for_s: float = LISTEN_FOR_S,
        worker_id: str | None = None,
    ) -> None:
        """``worker_id``: whose listener this is; with ``session_closed_threshold_ms`` set in
        ``config.recovery``, each session it listens on is recorded in that worker's row."""
        super().__init__(Backoff(0.1, 5.0))
        self.worker_id = worker_id
        self.session_closed_ms = config.recovery.session_closed_threshold_ms
        self.connection = AsyncDedicatedConnection(url, config, listener_role(worker_id), LISTENER_TCP)
        self.queues = queues
        self.on_work = on_work
        self.on_listening = on_listening
        self.on_schedules = on_schedules
        self.on_control = on_control
        self.listen_for_s = listen_for_s
        self._listening: AsyncConn | None = None  # the connection that LISTENs
        self.clock = ServerClock()
        self._refusals = 0  # read_only.refusals() when this connection began listening

    async def tick(self) -> float:
        conn = self._listening
        if conn is not None and read_only.refusals() > self._refusals:
            # Another connection of this process met a read-only server (a failover): this
            # one may sit on the old primary, where nothing new is announced. Listen anew
            # against the URL (the LISTEN checks where it lands).
            log.warning("work listener: a failover was seen by this process; listening anew")
            self._listening = conn = None
            await self.connection.close()
        if conn is None or conn.closed:
            self._refusals = read_only.refusals()
            conn = await self.connection.get()
            asked = self.clock.asking()
            self.clock.read(await notifications.listen_worker_async(conn), asked, renew=True)
            if self.worker_id is not None and self.session_closed_ms is not None:
                # The reapers judge this worker by this session from now on (the session_closed
                # rule): a reconnect must replace the one that closed before they look.
                await workers.record_listener_session(conn, self.worker_id, self.session_closed_ms)
            self._listening = conn
            self.on_listening()
            return 0.0
        if self.clock.due():  # LISTEN again (it changes nothing) to read the clock anew
            asked = self.clock.asking()
            self.clock.read(await notifications.listen_worker_async(conn), asked)
        # An inexact reading is read again soon (CLOCK_SLACK_S): this tick ends by then.
        async for note in conn.notifies(timeout=min(self.listen_for_s, self.clock.read_in())):
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
            epoch = _epoch(run_at)
            self.on_work(queue, epoch, None if epoch is None else epoch - self.clock.now())

    async def close(self) -> None:
        self._listening = None
        await self.connection.close()


def _epoch(text: str) -> float | None:
    """A notification's run_at: Unix seconds of the server's clock (None if unreadable)."""
    try:
        return float(text)
    except ValueError:
        return None
