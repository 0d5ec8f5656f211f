"""Pausing and resuming whole queues, and the overview of every queue (docs/queues.md).

A paused queue is one row in tether_paused_queues. While it is there, no worker claims
from the queue (every claim reads the table), and workers told of the pause give back
the tasks of the queue they claimed but had not handed to a child yet; tasks already
running go on, and sends to the queue are still accepted. Resuming deletes the row and
wakes the workers of the queue, which claim at once.

These functions take any queue name that is well formed: the CLI, which has no app,
pauses by name. ``Tether.pause_queue`` and friends also refuse a queue the app does not
declare.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tether.broker import PostgresBroker, queues
from tether.errors import InvalidOptionError
from tether.names import check_by, check_queue_name

if TYPE_CHECKING:
    from tether.broker.rows import QueueInfo as QueueInfo  # public as tether.QueueInfo

log = logging.getLogger("tether.queue_control")


def pause_queue(broker: PostgresBroker, queue: str, *, by: str | None = None) -> bool:
    """Stop workers claiming from ``queue``; True if this call paused it, False if it was paused
    already (its pause is left as it was). ``by``: who asks, stored and logged."""
    check_queue_name(queue)
    check_by(by)
    # run_request: a pause whose commit's answer was lost with its connection still says True.
    pause = broker.run_request(lambda conn: queues.pause_queue(conn, queue, by), queues.PAUSE_ANSWER)
    if pause is None:
        log.info("queue %s was already paused; pause asked by %s", queue, by or "(not given)")
        return False
    log.info("queue %s paused by %s", queue, by or "(not given)")
    return True


def resume_queue(broker: PostgresBroker, queue: str, *, by: str | None = None) -> bool:
    """Let workers claim from ``queue`` again (they do at once); True if this call resumed it,
    False if it was not paused. ``by``: who asks, logged."""
    check_queue_name(queue)
    check_by(by)
    pause = broker.run_request(lambda conn: queues.resume_queue(conn, queue), queues.PAUSE_ANSWER)
    if pause is None:
        log.info("queue %s was not paused; resume asked by %s", queue, by or "(not given)")
        return False
    log.info(
        "queue %s resumed by %s (paused since %s by %s)",
        queue,
        by or "(not given)",
        pause.paused_at.isoformat(),
        pause.paused_by or "(not given)",
    )
    return True


def list_queues(broker: PostgresBroker, *, also: Sequence[str] = (), exact: bool = False) -> list[QueueInfo]:
    """Every queue that has tasks, every paused queue and every name in ``also`` (an app's
    declared queues, say), ordered by name. On a large task table the finished counts are
    estimates (named in each QueueInfo's ``estimated``); ``exact`` counts every row."""
    if isinstance(also, str):
        raise InvalidOptionError(f"also must be a sequence of queue names, not the string {also!r}")
    for name in also:
        check_queue_name(name, "also")
    return broker.run(lambda conn: queues.queue_overview(conn, list(also), exact=exact))


if not TYPE_CHECKING:  # for a type checker, the names are imported above

    def __getattr__(name: str) -> object:
        """broker/rows.py's types, imported on first use (a send and a worker never build
        them): ``from tether.queue_control import QueueInfo`` works as before."""
        if name in ("QueueInfo",):
            value = getattr(__import__("tether.broker.rows", fromlist=[name]), name)
            globals()[name] = value  # the next lookup is a plain one
            return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
