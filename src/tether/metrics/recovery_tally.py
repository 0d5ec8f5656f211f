"""The recoveries a worker's main process made, per minute and rule, until a heartbeat adds
them to tether_recovery_minutes (migration 15; the dashboard's chart of recoveries by rule).

Every recovery is counted here, with or without --metrics-port (tether.metrics.hooks calls
``add``); the heartbeat (worker/heartbeat.py) ``take``s the tally after a beat got through,
writes it on its own connection, and ``give_back``s it when that write fails, so a
recovery made while the database is away (self-isolation) is recorded when it is back.
A lock: the reaper's pass and startup reconciliation count from threads.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime

#: Minutes kept while the database stays away; beyond, the oldest are dropped (a chart of
#: the last day has no use for older ones, and memory stays bounded).
MAX_MINUTES = 24 * 60

Tally = dict[tuple[datetime, str], int]

_lock = threading.Lock()
_tally: Tally = {}


def add(rule: str, n: int, at: datetime | None = None) -> None:
    """``n`` tasks were recovered by ``rule`` (one of tether.metrics.rules.RULES) at ``at`` (now)."""
    if n <= 0:
        return
    minute = (at or datetime.now(UTC)).replace(second=0, microsecond=0)
    with _lock:
        _tally[(minute, rule)] = _tally.get((minute, rule), 0) + n
        _bound()


def take() -> Tally:
    """Everything tallied so far, emptied from the tally."""
    global _tally
    with _lock:
        taken, _tally = _tally, {}
    return taken


def give_back(taken: Tally) -> None:
    """A taken tally whose write failed: added back, to be written with a later beat."""
    with _lock:
        for key, n in taken.items():
            _tally[key] = _tally.get(key, 0) + n
        _bound()


def _bound() -> None:
    minutes = sorted({minute for minute, _ in _tally})
    for old in minutes[: max(0, len(minutes) - MAX_MINUTES)]:
        for key in [k for k in _tally if k[0] == old]:
            del _tally[key]
