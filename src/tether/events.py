"""Sending events to tasks waiting for them: ``app.send_event(key, payload)`` (docs/durable-steps.md#events).

A send stores one event and delivers it to the task waiting longest for its key (the task
becomes due at once and a worker is told, as for a send); with no waiter it is kept for the
first task that waits for the key. ``app.with_options(connection=conn).send_event(...)``
runs it inside the caller's transaction, as a send with ``connection=`` does
(docs/transactions.md): the event exists, and the waiter wakes, only if that commits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from tether.broker import PostgresBroker, suspensions
from tether.broker.types import CallerConn, Conn
from tether.caller_transaction import check_connection, run_in
from tether.suspending import check_key, encode_payload


class _App(Protocol):
    """What AppWithOptions uses of the app (a Tether): named here, not imported, since
    tether.app imports this module."""

    @property
    def broker(self) -> PostgresBroker: ...


@dataclass(frozen=True, slots=True)
class EventSent:
    """What a send_event did: the event's id, and the task it was delivered to (None: no task
    was waiting; the event is kept for the first one that waits for its key)."""

    event_id: int
    delivered_to: uuid.UUID | None


def send_event(
    broker: PostgresBroker, key: str, payload: Any, connection: CallerConn | None = None
) -> EventSent:
    """Check, encode and send one event; ``connection``: the caller's, in its open transaction."""
    key = check_key(key, what="send_event")
    text = encode_payload(payload, what="send_event")

    def work(conn: Conn) -> EventSent:
        sent = suspensions.send_event(conn, key=key, payload=text)
        return EventSent(sent.event_id, None if sent.delivered_to is None else uuid.UUID(sent.delivered_to))

    if connection is not None:
        return run_in(broker, connection, "send_event()", work)
    # Not repeated after a lost connection: a repeat whose first try had committed would send
    # the event twice (each send is one event).
    with broker.connection() as conn:
        return work(conn)


class AppWithOptions:
    """``app.with_options(connection=conn)``: the app's calls that can join the caller's transaction."""

    def __init__(self, app: _App, connection: Any) -> None:
        self.app = app
        self.connection = check_connection(connection)

    def send_event(self, key: str, payload: Any) -> EventSent:
        """app.send_event inside the lent connection's transaction (it commits with it)."""
        return send_event(self.app.broker, key, payload, self.connection)  # type: ignore[arg-type]
