"""Trying again after a failure: how long to wait (Backoff), and what to log (Outage).

One of each for every job of the worker that retries on a database error: each
background service (services.py), the claim loop, a recorder's statements.
An outage is logged once, at its first failure, with what failed and why; the tries
that follow are logged at DEBUG, and its end at INFO with how long it lasted. A
database that is down for minutes must not bury the log under one line per try.
"""

from __future__ import annotations

import logging
import time


class Backoff:
    """``first`` seconds after a failure, twice as long after each next one, ``most`` at most;
    ``first`` again after a success."""

    def __init__(self, first: float, most: float) -> None:
        if not 0 < first <= most:
            raise ValueError(f"Backoff needs 0 < first <= most, got first={first}, most={most}")
        self.first = first
        self.most = most
        self._next = first

    def next(self) -> float:
        """How long to wait before the next try (and the one after is longer)."""
        delay = self._next
        self._next = min(delay * 2, self.most)
        return delay

    def reset(self) -> None:
        self._next = self.first


class Outage:
    """The log of one job's failures: the first of an outage at ``level``, the others at DEBUG,
    the end at INFO."""

    def __init__(self, what: str, log: logging.Logger, level: int) -> None:
        self.what = what
        self.log = log
        self.level = level
        self.failures = 0
        self._since = 0.0

    def failed(self, exc: BaseException, retry_in: float, *, unexpected: bool = False) -> None:
        """A try failed; the next is in ``retry_in`` seconds. ``unexpected``: not a database or
        network error but a bug, logged with its traceback (at its first occurrence)."""
        self.failures += 1
        reason = str(exc) or type(exc).__name__
        if self.failures == 1:
            self._since = time.monotonic()
            self.log.log(
                self.level,
                "%s failed (%s); next try in %.1fs (further failures at DEBUG until it works again)",
                self.what,
                reason,
                retry_in,
                exc_info=exc if unexpected else None,
            )
        else:
            self.log.debug("%s failed again (%s); next try in %.1fs", self.what, reason, retry_in)

    def over(self) -> None:
        """A try succeeded: the outage, if any, is over."""
        if self.failures:
            self.log.info(
                "%s works again after %.1fs (%d failed tr%s)",
                self.what,
                time.monotonic() - self._since,
                self.failures,
                "y" if self.failures == 1 else "ies",
            )
            self.failures = 0
