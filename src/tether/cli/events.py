"""``tether send-event KEY [PAYLOAD]``: an event for the task waiting for it (docs/durable-steps.md)."""

from __future__ import annotations

import json
from typing import Any

import click

from tether.cli import common
from tether.errors import EventError
from tether.events import send_event as send
from tether.suspending import check_key


@click.command("send-event")
@click.argument("key")
@click.argument("payload", required=False, default="null")
@common.db_option
@common.json_option
def send_event(key: str, payload: str, database_url: str | None, as_json: bool) -> None:
    """Send the event KEY with PAYLOAD, a JSON text (default: null), to the task waiting longest
    for KEY (``current_task().wait_for_event(KEY)``); with none waiting, it is kept for the first
    task that waits for KEY. Each send is one event. Nothing is sent if KEY or PAYLOAD is bad."""
    check_key(key, what="send-event")  # before the database is opened: bad input changes nothing
    try:
        value: Any = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise EventError(f"send-event: PAYLOAD is not JSON ({exc}): {payload[:80]!r}") from None
    sent = send(common.open_broker(database_url), key, value)
    answer = {
        "key": key,
        "event_id": sent.event_id,
        "delivered_to": None if sent.delivered_to is None else str(sent.delivered_to),
    }
    if as_json:
        common.emit_json(answer)
    elif sent.delivered_to is None:
        common.console.print(
            f"event {key!r} kept (id {sent.event_id}): no task is waiting for it yet", highlight=False
        )
    else:
        common.console.print(f"event {key!r} delivered to task {sent.delivered_to}", highlight=False)
