"""One task: ``send``, ``schedule`` and their async forms, without a unique key."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from tether.broker import tasks
from tether.broker.tasks import SendSpec
from tether.broker.types import AsyncConn, Conn
from tether.handle import TaskHandle
from tether.ids import new_task_id
from tether.options import check_when
from tether.sending.basis import SendBasis


@dataclass(frozen=True, slots=True)
class OneSend:
    """One call checked and encoded: the row of task ``task_id``."""

    basis: SendBasis
    spec: SendSpec
    task_id: UUID
    args: str
    kwargs: str

    all_or_none = False
    # One statement whose repeat after a lost connection is safe (below): send_async() may
    # write it on its loop's own connection (broker/loop_connections.py).
    on_loop_connection = True
    # An insert whose commit got through just before its connection broke meets its own
    # row when run() repeats it on another: taken as done (the id is the client's).
    repeatable = True

    @classmethod
    def prepare(
        cls,
        basis: SendBasis,
        when: timedelta | float | datetime,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> OneSend:
        """``when``: what schedule() takes (a delay, or an aware datetime to run at)."""
        good_until = basis.call_good_until(kwargs)
        given_key = basis.call_key(kwargs)
        args_json, kwargs_json = basis.task.encode_arguments(args, kwargs)
        key = basis.derived_key(given_key, args, kwargs)
        delay, run_at = check_when(when)
        spec = basis.row_spec(delay, run_at, good_until, key)
        return cls(basis, spec, new_task_id(), args_json, kwargs_json)

    def write(self, conn: Conn) -> None:
        tasks.insert_task(conn, self.spec, self.task_id, self.args, self.kwargs)

    async def write_async(self, conn: AsyncConn) -> None:
        await tasks.insert_task_async(conn, self.spec, self.task_id, self.args, self.kwargs)

    def handle(self) -> TaskHandle[Any]:
        return self.basis.handle(self.task_id)
