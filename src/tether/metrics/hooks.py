"""The calls the worker's main process makes where something worth counting happens.

Each is a no-op (one test of a module global) until ``install`` gives a sink (recoveries
are also tallied for the dashboard's charts, always: metrics/recovery_tally.py): a worker
started without --metrics-port pays nothing else, and imports no prometheus_client. The
children never call these: what they did reaches the main process over their pipe
(protocol.DONE, protocol.BATCH), and the main process counts it here, so one registry in
one process holds the whole worker's counts (docs/monitoring.md#children).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from tether.metrics import recovery_tally, rules

if TYPE_CHECKING:
    from tether.broker.claims import TaskPayload
    from tether.broker.recovery import Recovered


class Sink(Protocol):
    def finished(self, task: TaskPayload, status: str, code: str | None, run_s: float | None) -> None: ...
    def finished_many(
        self, held: Callable[[str], TaskPayload | None], done: list[list[Any]], ran: list[list[Any]] | None
    ) -> None: ...
    def claimed(self, tasks: list[TaskPayload], seconds: float) -> None: ...
    def claim_failed(self) -> None: ...
    def heartbeat(self, seconds: float | None) -> None: ...
    def recovered(self, rule: str, n: int) -> None: ...
    def reaper_pass(self, done: Recovered) -> None: ...


_sink: Sink | None = None


def install(sink: Sink | None) -> None:
    global _sink
    _sink = sink


def enabled() -> bool:
    return _sink is not None


def finished(
    task: TaskPayload | None, status: str, code: str | None = None, run_s: float | None = None
) -> None:
    """A child recorded ``task``'s outcome: ``status`` the row settled in (PENDING: a retry; LOST:
    its fence matched nothing), ``code`` its error code, ``run_s`` the seconds its code ran."""
    if _sink is not None and task is not None:
        _sink.finished(task, status, code, run_s)


def finished_many(
    held: Callable[[str], TaskPayload | None], done: list[list[Any]], ran: list[list[Any]] | None
) -> None:
    """finished() for each entry of an async child's BATCH: ``done`` its [[id, status]],
    ``ran`` its [[code, run_s]] (one per entry of ``done``; None: not said), ``held`` the task
    of an id (None: not held any more, not counted). One call a batch, not one a task."""
    if _sink is not None:
        _sink.finished_many(held, done, ran)


def claimed(tasks: list[TaskPayload], seconds: float) -> None:
    """A claim statement returned ``tasks`` (perhaps none) after ``seconds``."""
    if _sink is not None:
        _sink.claimed(tasks, seconds)


def claim_failed() -> None:
    if _sink is not None:
        _sink.claim_failed()


def heartbeat(seconds: float | None) -> None:
    """A heartbeat write took ``seconds`` (None: it failed)."""
    if _sink is not None:
        _sink.heartbeat(seconds)


def recovered(rule: str, n: int = 1) -> None:
    """``n`` tasks were recovered by ``rule`` (one of tether.metrics.rules.RULES).

    Tallied for the dashboard's chart even without a sink (metrics/recovery_tally.py)."""
    recovery_tally.add(rule, n)
    if _sink is not None and n:
        _sink.recovered(rule, n)


def reaper_pass(done: Recovered | None) -> None:
    """What a reaper pass of this worker did (None: it was not this worker's to do)."""
    if done is not None:
        for rule, n in rules.of_pass(done):
            recovery_tally.add(rule, n)
    if _sink is not None and done is not None:
        _sink.reaper_pass(done)
