"""Self-isolation: a worker whose heartbeats stopped getting through stops its own work.

A reaper elsewhere may declare this worker dead once its last heartbeat is older
than the running stale threshold, and then retry its tasks on another worker. A
margin before that moment this worker isolates itself (IsolationWatch, a background
service), so no task's code runs here and elsewhere at the same time: the children
holding tasks are frozen (SIGSTOP), what is claimed but not handed to a child is
dropped, and nothing is claimed.

Frozen, not killed: when a heartbeat gets through again, the children whose tasks are
still ours resume and only those whose tasks were recovered elsewhere are killed, so
a database restart or a network blip does not turn running tasks into crashes.

(Not to be confused with a fence: the guard on every write, by status, attempt and owner.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable

from tether.metrics import hooks, rules
from tether.worker.backoff import Backoff
from tether.worker.holdings import Holdings
from tether.worker.services import Service
from tether.worker.supervisor import Supervisor

log = logging.getLogger("tether.worker.isolation")


class Isolation:
    def __init__(
        self,
        worker_id: str,
        holdings: Holdings,
        supervisor: Supervisor,
        running_stale_s: float,
        on_rejoin: Callable[[], None],
    ) -> None:
        self.worker_id = worker_id
        self.holdings = holdings
        self.supervisor = supervisor
        self.running_stale_s = running_stale_s
        self.on_rejoin = on_rejoin  # claiming may resume: look for work
        self.isolated = False

    def isolate(self, silent_s: float) -> None:
        """No heartbeat got through for ``silent_s``: freeze the children, drop unhanded claims."""
        self.isolated = True
        frozen = stopped = 0
        for slot in self.supervisor.alive():
            if (held := self.holdings.of_child(slot.index)) and slot.pid is not None:
                with contextlib.suppress(ProcessLookupError):  # it died meanwhile: the supervisor sees it
                    os.kill(slot.pid, signal.SIGSTOP)
                    self.holdings.freeze(slot.index)
                    frozen += 1
                    stopped += len(held)
        dropped = self.holdings.let_go_unhanded()
        hooks.recovered(rules.SELF_ISOLATION, stopped + len(dropped))
        log.error(
            "worker %s could not write a heartbeat for %.1fs (running stale threshold %.1fs): "
            "isolating itself: %d child(ren) frozen, %d claimed task(s) dropped, claiming nothing",
            self.worker_id,
            silent_s,
            self.running_stale_s,
            frozen,
            len(dropped),
        )

    def rejoin(self, lost: set[str]) -> None:
        """A heartbeat got through: resume the frozen children whose tasks are still ours."""
        self.isolated = False
        resumed = killed = 0
        for slot in self.supervisor.alive():
            if not self.holdings.frozen(slot.index):
                continue
            self.holdings.thaw(slot.index)
            if any(t.id in lost for t in self.holdings.of_child(slot.index)):
                slot.process.kill()  # its task was recovered elsewhere: never resume that code
                killed += 1
            else:
                self.supervisor.stamps[slot.index] = time.monotonic()
                with contextlib.suppress(ProcessLookupError):  # it died meanwhile: the supervisor sees it
                    os.kill(slot.process.pid or 0, signal.SIGCONT)
                resumed += 1
        self.on_rejoin()
        log.warning(
            "worker %s: heartbeats get through again; %d child(ren) resumed, %d killed "
            "(their tasks were recovered elsewhere); claiming resumes",
            self.worker_id,
            resumed,
            killed,
        )


class IsolationWatch(Service):
    """Isolates the worker a margin before any reaper may declare it dead (a background service).

    Waiting for a failed write to notice would be too late (a write can hang for seconds),
    so this clock runs on its own, ten times per heartbeat interval (at most every 0.1 s):
    ``last_ok()`` is when the last heartbeat got through (time.monotonic()).
    """

    name = "isolation watch"
    log = log

    def __init__(self, isolation: Isolation, last_ok: Callable[[], float], every: float) -> None:
        self.look_every = min(0.1, every / 10)
        super().__init__(Backoff(self.look_every, self.look_every))  # it makes no database call
        self.isolation = isolation
        self.last_ok = last_ok
        # A margin before a reaper may act: a quarter interval (at least 0.1 s), but at most
        # half of what the threshold leaves past one interval, so that a threshold just above
        # one interval (session_closed_threshold_ms) does not isolate at every beat. The
        # running threshold, at least two intervals, always gets the quarter interval.
        margin = min(max(0.1, every / 4), (isolation.running_stale_s - every) / 2)
        self.isolate_after = isolation.running_stale_s - margin

    async def tick(self) -> float:
        silent = time.monotonic() - self.last_ok()
        if silent > self.isolate_after and not self.isolation.isolated:
            self.isolation.isolate(silent)
        return self.look_every
