"""One task under a unique key (``with_options(unique_key=..., unique_for=...)``): written
unless the key is held; the handle names the task holding it (docs/tasks.md#unique-sends)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from tether.broker import unique as unique_sends
from tether.broker.types import AsyncConn, Conn
from tether.broker.unique import UniqueKey
from tether.handle import TaskHandle
from tether.sending.one import OneSend


@dataclass(frozen=True, slots=True)
class OneUniqueSend:
    """A plain send checked and encoded (the task proposed), and the key it asks for."""

    send: OneSend
    key: UniqueKey

    all_or_none = False
    # Run again (its connection broke), its statement still answers with the key's holder.
    repeatable = False

    def write(self, conn: Conn) -> UUID:
        """Returns the task holding the key: the one proposed if this call created it."""
        s = self.send
        return unique_sends.insert_unique_task(conn, s.spec, self.key, s.task_id, s.args, s.kwargs)

    async def write_async(self, conn: AsyncConn) -> UUID:
        s = self.send
        return await unique_sends.insert_unique_task_async(
            conn, s.spec, self.key, s.task_id, s.args, s.kwargs
        )

    def handle(self, holder: UUID) -> TaskHandle[Any]:
        """The holder's handle, deduplicated unless it is the task proposed."""
        return self.send.basis.handle(holder, deduplicated=holder != self.send.task_id)
