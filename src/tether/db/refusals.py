"""A server that refuses new connections because it has no slot left, said once and clearly.

PostgreSQL refuses a connection when ``max_connections`` is reached (``sorry, too many
clients already``; ``remaining connection slots are reserved ...``), or the role's or the
database's ``CONNECTION LIMIT`` (``too many connections for role ...``). A worker then goes
on as through any outage (its services retry with backoff, its writes are fenced, it
isolates itself if its heartbeats cannot get through), but each job's own line names only
what failed for it, and the first failures of an outage are often the connections being
cut, not the refusal. So every connection a worker opens reports here: the first refusal
of an episode is one ERROR line per process that names the cause and the way out, and the
first connection that succeeds after it one INFO line.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("tether.db")

#: SQLSTATE too_many_connections, and the server's messages for it (a refused connection
#: carries no SQLSTATE through libpq, only its message).
TOO_MANY_CONNECTIONS = "53300"
_MESSAGES = ("too many clients", "too many connections", "connection slots are reserved")

_lock = threading.Lock()
_since: float | None = None  # monotonic time of the episode's first refusal
_refused = 0


def is_refusal(exc: BaseException) -> bool:
    """Did the server refuse the connection for lack of a slot?"""
    if getattr(exc, "sqlstate", None) == TOO_MANY_CONNECTIONS:
        return True
    text = str(exc).lower()
    return any(message in text for message in _MESSAGES)


def connect_failed(exc: BaseException, role: str) -> None:
    """A connection of the job ``role`` could not be opened; said once per episode if refused."""
    global _since, _refused
    if not is_refusal(exc):
        return
    with _lock:
        _refused += 1
        if _since is not None:
            return
        _since = time.monotonic()
    text = " ".join(str(exc).split())
    reason = text.rpartition("FATAL:")[2].strip() or text or type(exc).__name__  # the server's words
    log.error(
        "PostgreSQL refused a new connection (tether-%s): %s. The server's max_connections, or the "
        "role's or database's CONNECTION LIMIT, is reached. Tasks held here stay fenced: this process "
        "tries again by itself, and a worker whose heartbeats cannot get through stops its own tasks "
        "so that other workers recover them. Size max_connections for the fleet: docs/workers.md#connections",
        role,
        reason,
    )


def connected() -> None:
    """A connection was opened: the end of a refusal episode, if one was going on."""
    global _since, _refused
    if _since is None:  # (read without the lock: the common case costs nothing)
        return
    with _lock:
        since, refused, _since, _refused = _since, _refused, None, 0
    if since is not None:
        log.info(
            "PostgreSQL accepts new connections again after %.1fs (%d refused)",
            time.monotonic() - since,
            refused,
        )
